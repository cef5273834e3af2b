"""The bench CLI's pieces that need no GPU: it refuses to run without one, and its
report shows every measured column, TileKernels' rows when they were measured, a
TileKernels failure instead of dropping it, and the ops a build from another shape table
could not run."""

import subprocess
import sys

import pytest
import torch

pytest.importorskip("tile_kernels_aot.bench", reason="the package is not installed")

from tile_kernels_aot import bench  # noqa: E402


def _row(op, tokens, **extra):
    row = {"op": op, "num_tokens": tokens, "device_us": 43.21, "kernel_us": 42.71, "tbs": 4.12, "copy_share": 0.98,
           "eager_out_us": 4.6, "eager_alloc_us": 7.19, "bare_launch_us": 3.79, "overhead_out_us": 0.81,
           "overhead_alloc_us": 3.4, "reference_us": 239.0}
    row.update(extra)
    return row


def test_report_columns_and_tilekernels_rows():
    result = {"gpu": "GPU", "torch": "2.x", "date": "2026-11-29", "copy_tbs": 4.21, "first_call_ms": 1.4, "rows": [
        _row("quant.per_token_cast", 8192, tilekernels_device_us=45.6, tilekernels_kernel_us=44.5,
             tilekernels_eager_us=73.3),
        _row("quant.per_token_cast", 128, tilekernels_error="RuntimeError: no nvcc"),
        _row("transpose.transpose", 8192, overhead_out_paired_us=0.52, overhead_alloc_paired_us=1.61),
    ]}
    text = bench.format_table(result)
    lines = text.splitlines()
    assert "copy bandwidth 4.21 TB/s" in lines[0] and "1.4 ms" in lines[0]
    ours = [line for line in lines if line.startswith("| quant.per_token_cast | 8192 | 43.2 | 42.7 |")]
    assert len(ours) == 1 and "| 98% |" in ours[0]
    assert "| - | - | +0.81 / +3.40 | 239.0 |" in ours[0]  # a row without the paired overheads (older runs)
    paired = [line for line in lines if line.startswith("| transpose.transpose | 8192 |")]
    assert len(paired) == 1 and "| +0.52 | +1.61 | +0.81 / +3.40 | 239.0 |" in paired[0]
    assert "TileKernels JIT on the same inputs, measured the same way:" in lines
    assert "| quant.per_token_cast | 8192 | 45.6 | 44.5 | 73.30 | 43.2 | 42.7 |" in lines
    assert not any(line.startswith("| transpose.transpose | 8192 | 35") for line in lines)
    assert lines[-1] == "TileKernels quant.per_token_cast at 128 tokens failed: RuntimeError: no nvcc"


def test_no_tilekernels_table_without_its_rows():
    text = bench.format_table({"gpu": "GPU", "torch": "2.x", "date": "d", "copy_tbs": 4.0, "first_call_ms": 1.0,
                               "rows": [_row("moe.topk_gate", 8192)]})
    assert "TileKernels" not in text


def test_report_lists_ops_skipped_for_a_build_without_their_shape():
    result = {"gpu": "GPU", "torch": "2.x", "date": "d", "copy_tbs": 4.0, "first_call_ms": None,
              "rows": [_row("transpose.transpose", 8192)],
              "skipped": [{"op": "moe.topk_gate", "num_tokens": 8192,
                           "reason": "moe.topk_gate: no prebuilt kernel for num_experts=256"}]}
    lines = bench.format_table(result).splitlines()
    assert lines[0].endswith("first call in a fresh process not measured (no prebuilt moe.topk_gate)")
    assert lines[-1] == "Skipped moe.topk_gate at 8192 tokens: moe.topk_gate: no prebuilt kernel for num_experts=256"
    assert sum(line.startswith("| transpose.transpose | 8192 |") for line in lines) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_without_gpu_exits_nonzero():
    out = subprocess.run([sys.executable, "-m", "tile_kernels_aot", "bench"], capture_output=True, text=True)
    assert out.returncode == 1 and "no CUDA device" in out.stderr
