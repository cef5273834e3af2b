#!/usr/bin/env bash
# The wheel build matrix: one kernel bundle (per table), then a platform wheel per CPython
# from it into wheels/dist/, each checked by wheels/verify.py.
#   wheels/build.sh [--table FILE] [--python "3.10 3.11 3.12 3.13"] [--jobs N]
# The bundle needs TileLang + nvcc (from the current python's environment); the wheels are
# built by each requested CPython from that bundle, without TileLang (scikit-build-core +
# pybind11 in a small venv per CPython).  CI's per-arch matrix can build bundles with
# --arch on separate machines and merge them; this script builds both archs at once.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
table=aot/shapes/default.toml
pyvers="3.12"
jobs=$(nproc)
while [[ $# -gt 0 ]]; do
  case $1 in
    --table) table=$2; shift 2;;
    --python) pyvers=$2; shift 2;;
    --jobs) jobs=$2; shift 2;;
    *) echo "unknown argument $1" >&2; exit 2;;
  esac
done
bundle=build/bundle-$(basename "$table" .toml)
python -m aot build --out "$bundle" --table "$table" --jobs "$jobs"

mkdir -p wheels/dist
for pyver in $pyvers; do
  # A small venv of the target CPython with the extension's build requirements.
  venv=build/venv-wheel-$pyver
  if [[ ! -x $venv/bin/python ]]; then
    py=""
    for candidate in "$HOME"/.pyenv/versions/"$pyver"*/bin/python "$(command -v "python$pyver" || true)"; do
      if [[ -x $candidate ]] && "$candidate" -c "import sys; assert sys.version.startswith('$pyver')" 2>/dev/null; then
        py=$candidate; break
      fi
    done
    [[ -n $py ]] || { echo "no working python$pyver found" >&2; exit 1; }
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q "scikit-build-core>=0.10" "pybind11>=2.12" ninja
  fi
  rm -f wheels/dist/tile_kernels_aot-*-cp${pyver/./}-*.whl
  TKA_BUNDLE_DIR=$repo/$bundle "$venv/bin/pip" wheel -q --no-build-isolation --no-deps -w wheels/dist .
  python wheels/verify.py wheels/dist/tile_kernels_aot-*-cp${pyver/./}-*.whl
done
