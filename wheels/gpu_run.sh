#!/usr/bin/env bash
# The GPU recipe, executed on the GPU machine from the repo root (see README, "Working on a GPU"):
#   build machine: wheels/build.sh --table aot/shapes/<table>.toml   (cp312 wheel into wheels/dist/)
#   GPU machine:   bash wheels/gpu_run.sh, with wheels/dist copied beside the checkout
# It installs the wheel as a user would (no TileLang there), runs the GPU tests with the PTX
# JIT disabled, compute-sanitizer (memcheck, racecheck, synccheck) over every op's samples,
# and the bench; everything lands in $OUT (gpu-tests.log, gpu-summary.txt, memcheck.log, racecheck.log,
# synccheck.log, bench.json, bench.md, block.md: the compiled MoE block; layer.md: the routed MoE layer in one CUDA graph;
# modeling.md: the Engram gate's training step and one layer's mHC path).
# TKA_TEST_FILES: which tests/gpu files to run (default: all); TKA_SKIP_TESTS, TKA_SKIP_MEMCHECK,
# TKA_SKIP_BENCH: leave a part out.
# TKA_BENCH_SITE: extra import path for the bench only, so that it times TileKernels' JIT kernels
# beside ours: a folder, or the .tar.xz that wheels/tilekernels_site.sh makes (unpacked here
# first); the tests never see it.
set -uo pipefail
OUT=${OUT:-/tmp/tka-out}
mkdir -p "$OUT"
repo=$PWD
site=/tmp/tka-site
rm -rf "$site"
python3 -m pip install -q --no-deps --no-index --target "$site" wheels/dist/tile_kernels_aot-*-cp312-*.whl || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
cd /tmp  # import the installed package, not the checkout
status=0
if [[ ${TKA_SKIP_TESTS:-0} != 1 ]]; then
  # one process per test file: a kernel fault (a device-side assert poisons the CUDA context)
  # fails its own file only; gpu-tests.log holds every file's output, the summary one line each
  : > "$OUT/gpu-tests.log"
  # TKA_TEST_FILES: the test files to run (names or globs under tests/gpu, space-separated),
  # so that the whole pass can be split into several shorter runs on the GPU machine
  for file in $(cd "$repo/tests/gpu" && ls ${TKA_TEST_FILES:-test_*.py}); do
    file=$repo/tests/gpu/$file
    CUDA_DISABLE_PTX_JIT=1 python3 -m pytest -q -p no:cacheprovider --maxfail=40 --rootdir "$repo" "$file" \
      ${TKA_PYTEST_ARGS:-} > "$OUT/file.log" 2>&1
    rc=$?
    [[ $rc == 0 || $rc == 5 ]] || status=$rc  # 5: nothing collected or all deselected
    cat "$OUT/file.log" >> "$OUT/gpu-tests.log"
    echo "$(basename "$file"): $(tail -1 "$OUT/file.log")" | tee -a "$OUT/gpu-summary.txt"
  done
  rm -f "$OUT/file.log"
fi
if [[ ${TKA_SKIP_MEMCHECK:-0} != 1 ]]; then
  # memcheck: out-of-bounds and misaligned accesses; racecheck: shared-memory hazards;
  # synccheck: barriers reached by part of a block
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool $tool --error-exitcode 3 python3 "$repo/tests/gpu/memcheck_ops.py" > "$OUT/$tool.log" 2>&1
    rc=$?
    echo "$tool exit $rc ($(grep -cE 'SUMMARY: 0 (errors|hazards)' "$OUT/$tool.log") clean summaries)"; tail -3 "$OUT/$tool.log"
    [[ $rc == 0 ]] || status=$rc
  done
fi
if [[ ${TKA_SKIP_BENCH:-0} != 1 ]]; then
  if [[ ${TKA_BENCH_SITE:-} == *.tar.xz ]]; then
    rm -rf /tmp/tka-bench-site && mkdir -p /tmp/tka-bench-site
    (cd "$repo" && tar -C /tmp/tka-bench-site -xJf "$TKA_BENCH_SITE") && TKA_BENCH_SITE=/tmp/tka-bench-site
  fi
  PYTHONPATH=$site${TKA_BENCH_SITE:+:$TKA_BENCH_SITE} \
    python3 -m tile_kernels_aot bench --json "$OUT/bench.json" ${TKA_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.md"
  if [[ ${TKA_SKIP_BLOCK_BENCH:-0} != 1 ]]; then
    PYTHONPATH=$site${TKA_BENCH_SITE:+:$TKA_BENCH_SITE} \
      python3 -m tile_kernels_aot bench --block 2>&1 | tee "$OUT/block.md"
  fi
  if [[ ${TKA_SKIP_LAYER_BENCH:-0} != 1 ]]; then
    PYTHONPATH=$site${TKA_BENCH_SITE:+:$TKA_BENCH_SITE} \
      python3 -m tile_kernels_aot bench --layer 2>&1 | tee "$OUT/layer.md"
  fi
  if [[ ${TKA_SKIP_MODELING_BENCH:-0} != 1 ]]; then
    PYTHONPATH=$site${TKA_BENCH_SITE:+:$TKA_BENCH_SITE} \
      python3 -m tile_kernels_aot bench --modeling 2>&1 | tee "$OUT/modeling.md"
  fi
fi
exit $status
