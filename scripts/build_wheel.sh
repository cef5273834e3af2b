#!/usr/bin/env bash
# Build a kernel bundle and a platform wheel for one CPython into wheels/dist/.
#   scripts/build_wheel.sh [--table FILE] [--python X.Y] [--jobs N]
# The bundle needs TileLang + nvcc (taken from the current python's environment);
# the wheel is built by the requested CPython from that bundle, without TileLang.
set -euo pipefail
cd "$(dirname "$0")/.."
table=aot/shapes/default.toml
pyver=3.12
jobs=$(nproc)
while [[ $# -gt 0 ]]; do
  case $1 in
    --table) table=$2; shift 2;;
    --python) pyver=$2; shift 2;;
    --jobs) jobs=$2; shift 2;;
    *) echo "unknown argument $1" >&2; exit 2;;
  esac
done
bundle=build/bundle-$(basename "$table" .toml)
python -m aot build --out "$bundle" --table "$table" --jobs "$jobs"

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
mkdir -p wheels/dist
rm -f wheels/dist/tile_kernels_aot-*-cp${pyver/./}-*.whl
TKA_BUNDLE_DIR=$PWD/$bundle "$venv/bin/pip" wheel --no-build-isolation --no-deps -w wheels/dist .
ls -l wheels/dist
