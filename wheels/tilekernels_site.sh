#!/usr/bin/env bash
# The comparison site for the bench: TileKernels 1.0.0 + TileLang 0.1.11 and their dependencies
# that the GPU machine lacks, for CPython 3.12 on x86-64, unpacked into one folder and packed as
# .whl/upstream-site.tar.xz (~40 MB, under one 64 MiB transfer; as wheels they are ~83 MB).
# TileLang's AMD composable_kernel headers are left out.  On the GPU machine:
#   TKA_BENCH_SITE=.whl/upstream-site.tar.xz bash wheels/gpu_run.sh      (.whl beside the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/wheels" \
  tile-kernels==1.0.0 tilelang==0.1.11 apache-tvm-ffi==0.1.11 z3-solver==4.15.4.0 torch-c-dlpack-ext==0.1.5
mkdir -p "$work/site" .whl
for w in "$work"/wheels/*.whl; do (cd "$work/site" && python -m zipfile -e "$w" .); done
rm -rf "$work/site/tilelang/3rdparty/composable_kernel"
tar -C "$work/site" -cf - . | xz -9 -T0 > .whl/upstream-site.tar.xz
ls -la .whl/upstream-site.tar.xz
