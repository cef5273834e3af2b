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


def _row(op, sample, tokens, host=True, **extra):
    row = {"op": op, "sample": sample, "num_tokens": tokens, "device_us": 43.21, "kernel_us": 42.71, "tbs": 4.12,
           "copy_share": 0.98, "reference_us": 239.0}
    if host:  # the host loops ran (a decode-sized sample)
        row.update({"eager_out_us": 4.6, "eager_alloc_us": 7.19, "bare_launch_us": 3.79, "overhead_out_us": 0.81,
                    "overhead_alloc_us": 3.4, "overhead_out_paired_us": 0.52, "overhead_alloc_paired_us": 1.61})
    row.update(extra)
    return row


def test_report_columns_and_tilekernels_rows():
    result = {"gpu": "GPU", "torch": "2.x", "date": "2026-11-29", "copy_tbs": 4.21, "first_call_ms": 1.4, "rows": [
        _row("quant.per_token_cast", "prefill", 8192, host=False, tilekernels_device_us=45.6, tilekernels_kernel_us=44.5,
             tilekernels_eager_us=73.3),
        _row("quant.per_token_cast", "decode", 128, tilekernels_error="RuntimeError: no nvcc"),
        _row("transpose.transpose", "decode", 128),
    ]}
    text = bench.format_table(result)
    lines = text.splitlines()
    assert "copy bandwidth 4.21 TB/s" in lines[0] and "1.4 ms" in lines[0]
    ours = [line for line in lines if line.startswith("| quant.per_token_cast | prefill | 8192 | 43.2 | 42.7 |")]
    assert len(ours) == 1 and "| 98% |" in ours[0]
    assert "| - | - | - | - | - | - | 239.0 |" in ours[0]  # no host loops at prefill sizes
    decode = [line for line in lines if line.startswith("| transpose.transpose | decode | 128 |")]
    assert len(decode) == 1 and "| 4.60 | 7.19 | 3.79 | +0.52 | +1.61 | +0.81 / +3.40 | 239.0 |" in decode[0]
    assert "TileKernels JIT on the same inputs, measured the same way:" in lines
    assert "| quant.per_token_cast | prefill | 8192 | 45.6 | 44.5 | 73.30 | 43.2 | 42.7 |" in lines
    assert not any(line.startswith("| transpose.transpose | decode | 128 | 35") for line in lines)
    assert lines[-1] == "TileKernels quant.per_token_cast at 128 tokens failed: RuntimeError: no nvcc"


def test_no_tilekernels_table_without_its_rows():
    text = bench.format_table({"gpu": "GPU", "torch": "2.x", "date": "d", "copy_tbs": 4.0, "first_call_ms": 1.0,
                               "rows": [_row("moe.topk_gate", "prefill", 8192)]})
    assert "TileKernels" not in text


def test_report_lists_samples_skipped_for_a_build_without_their_config():
    result = {"gpu": "GPU", "torch": "2.x", "date": "d", "copy_tbs": 4.0, "first_call_ms": None,
              "rows": [_row("transpose.transpose", "prefill", 8192)],
              "skipped": [{"op": "moe.topk_gate", "sample": "prefill", "num_tokens": 8192,
                           "reason": "moe.topk_gate: no prebuilt kernel for num_experts=256"}]}
    lines = bench.format_table(result).splitlines()
    assert lines[0].endswith("first call in a fresh process not measured (no prebuilt moe.topk_gate)")
    assert lines[-1] == ("Skipped moe.topk_gate (prefill, 8192 tokens): "
                         "moe.topk_gate: no prebuilt kernel for num_experts=256")
    assert sum(line.startswith("| transpose.transpose | prefill | 8192 |") for line in lines) == 1


def test_every_sample_of_this_build_is_a_bench_case():
    from tile_kernels_aot import manifest

    cases = bench._cases()
    assert len(cases) == sum(len(r["samples"]) for r in manifest.ops())
    assert bench._cases(["moe.topk_gate"]) == [c for c in cases if c[0]["name"] == "topk_gate"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_without_gpu_exits_nonzero():
    out = subprocess.run([sys.executable, "-m", "tile_kernels_aot", "bench"], capture_output=True, text=True)
    assert out.returncode == 1 and "no CUDA device" in out.stderr


def test_a_kernel_fault_ends_the_run_with_the_rows_so_far():
    """A fault that poisons the CUDA context (every later call fails with it) stops the run
    after the faulting sample; a refused call or a missing config does not."""
    fault = RuntimeError("moe.expand_to_fused: launch failed: CUDA_ERROR_ILLEGAL_ADDRESS "
                         "(an illegal memory access was encountered)")
    assert bench._context_lost(fault)
    assert bench._context_lost(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not bench._context_lost(ValueError("quant.per_token_cast: no prebuilt kernel for hidden=100"))
    assert not bench._context_lost(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    # the rows measured before the fault have no kernel time (CUPTI needs the lost context)
    row = _row("moe.reduce_fused", "decode", 128)
    del row["kernel_us"]
    text = bench.format_table({"gpu": "GPU", "torch": "2.x", "date": "d", "copy_tbs": 4.0, "first_call_ms": None,
                               "rows": [row], "skipped": [{"op": "moe.reduce_fused", "sample": "upstream",
                                                           "num_tokens": 18356, "reason": f"failed: {fault}"}]})
    assert any(line.startswith("| moe.reduce_fused | decode | 128 | 43.2 | - |") for line in text.splitlines())


def test_upstream_arguments():
    """TileKernels gets integer pairs as tuples (its asserts refuse the list a sample's JSON
    gives) and, for mHC ops, a leading sequence dimension on token-leading tensors."""
    x = torch.zeros(4, 8)
    args, kwargs = bench.upstream_args("quant.per_token_cast", [x, "e4m3", 128], {"x_block_size": [128, 128]}, 4)
    assert args[0] is x and kwargs == {"x_block_size": (128, 128)}
    args, kwargs = bench.upstream_args("mhc.sinkhorn_normalize", [x, torch.zeros(3, 4)], {"repeat": 10}, 4)
    assert args[0].shape == (1, 4, 8) and args[1].shape == (3, 4) and kwargs == {"repeat": 10}


def test_tilekernels_kernel_calls_take_the_ops_parameters():
    """Each ``_UPSTREAM_KERNELS`` call is handed our op's arguments (by position, or by name when
    a sample gives keywords): its parameters are the op's, in order, with the same defaults."""
    import importlib
    import inspect
    from pathlib import Path

    from kernels_tl.schema import REQUIRED

    ops = {}
    for path in sorted(Path(__file__).resolve().parents[2].glob("kernels_tl/*/*/schema.py")):
        schema = importlib.import_module(".".join(path.with_suffix("").parts[-4:])).SCHEMA
        ops.update({f"{op.module}.{op.name}": op for op in schema.ops})
    for name, call in bench._UPSTREAM_KERNELS.items():
        params = [(p.name, p.default) for p in inspect.signature(call).parameters.values()]
        want = [(p.name, inspect.Parameter.empty if p.default is REQUIRED else p.default) for p in ops[name].params]
        assert params == want, name
