"""The bench: device time, eager time per call and host overhead of every op.

For each op at a prefill shape (8192 tokens) and a decode shape (128 tokens):

* device time: CUDA-graph replay of launches that rotate over input sets
  larger than L2, so the time is DRAM time, not cache time;
* eager time per call, outputs passed in (``out=``) and allocated by the call,
  from a pipelined loop (what a caller on the hot path sees);
* the bare ``cuLaunchKernel`` cost of the same kernel with the same arguments,
  measured in the same run (``_C._replay_last_launch``), and the host overhead
  of our launch path above it;
* bytes moved (from the kernel spec's formula in the manifest), TB/s, and the
  share of the device-to-device copy bandwidth measured in the same run;
* the PyTorch reference and, when importable, TileKernels' JIT kernels, timed
  the same way.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time

import torch

from tile_kernels_aot import manifest

L2_BYTES = 60 * 1024 * 1024
PREFILL, DECODE = 8192, 128


def _rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def _cases():
    """(op, make(n, gen) -> (args, kwargs, out_names, dims), reference name, upstream name)."""

    def topk_gate(n, gen):
        return (_rand((n, 256), torch.float32, gen), 8), {}, ("out",), {"num_tokens": n, "num_experts": 256, "num_topk": 8}

    def per_token_cast(n, gen):
        dims = {"num_tokens": n, "hidden": 7168, "num_groups": 7168 // 128, "in_dtype": "bfloat16", "fmt": "e4m3"}
        return (_rand((n, 7168), torch.bfloat16, gen), "e4m3", 128), {}, ("out", "out_sf"), dims

    def swiglu(n, gen):
        dims = {"num_tokens": n, "hidden": 2048, "num_sf": 2048 // 128, "in_dtype": "bfloat16", "sf_format": "fp32"}
        return (_rand((n, 4096), torch.bfloat16, gen), "e4m3", 128), {}, ("out", "out_sf"), dims

    def transpose(n, gen):
        return (_rand((n, 4096), torch.bfloat16, gen),), {}, ("out",), {"num_batches": 1, "rows": n, "cols": 4096, "dtype": "bfloat16"}

    return [
        ("moe.topk_gate", topk_gate, "moe", "topk_gate"),
        ("quant.per_token_cast", per_token_cast, "quant", "per_token_cast"),
        ("quant.swiglu_forward_and_per_token_cast", swiglu, "swiglu", "swiglu_forward_and_per_token_cast"),
        ("transpose.transpose", transpose, "transpose", "transpose"),
    ]


def _resolve(dotted: str):
    import importlib

    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _graph_time_us(calls, reps=20):
    """Mean device time of one call, from CUDA-graph replays of all ``calls``."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for c in calls[:2]:
            c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def _eager_us(fn, n=5000):
    """Host time per call of a pipelined loop (synchronized only at the end)."""
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def _event_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth_tbs() -> float:
    """Device-to-device copy of 1 GiB (bytes read + written over time), timed eagerly with
    events (captured in a CUDA graph it becomes a memcpy node, which runs at about 2.7 TB/s
    here), after ~0.5 s of copies so the clocks have ramped up; the best of several rounds."""
    src = torch.randn(256 * 1024 * 1024, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    for _ in range(1000):
        dst.copy_(src)
    best = min(_event_us(lambda: dst.copy_(src), reps=20) for _ in range(3))
    del src, dst
    return 2 * 4 * 256 * 1024 * 1024 / best / 1e6


def first_call_ms() -> float:
    """A fresh process: torch imported and CUDA initialised first (not counted), then
    the package imported and one op called and synchronized."""
    code = (
        "import time, torch\n"
        "x = torch.randn(128, 256, device='cuda'); torch.cuda.synchronize()\n"
        "t = time.perf_counter()\n"
        "from tile_kernels_aot import moe\n"
        "moe.topk_gate(x, 8); torch.cuda.synchronize()\n"
        "print((time.perf_counter() - t) * 1e3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def bench_op(op, make, ref_module, ref_name, n, copy_tbs):
    from tile_kernels_aot import _C

    fn = _resolve(f"tile_kernels_aot.{op}")
    gen = torch.Generator(device="cuda").manual_seed(n)
    args, kwargs, out_names, dims = make(n, gen)
    first = fn(*args, **kwargs)
    outs = first if isinstance(first, tuple) else (first,)
    per_call = sum(t.numel() * t.element_size() for t in args if isinstance(t, torch.Tensor))
    per_call += sum(t.untyped_storage().nbytes() for t in outs)
    sets = max(2, min(64, math.ceil(3 * L2_BYTES / max(per_call, 1))))
    inputs = [make(n, gen)[0] for _ in range(sets)]
    out_sets = [dict(zip(out_names, (o if isinstance(o, tuple) else (o,)))) for o in (fn(*a, **kwargs) for a in inputs)]
    calls = [lambda a=a, o=o: fn(*a, **kwargs, **o) for a, o in zip(inputs, out_sets)]
    device_us = _graph_time_us(calls)
    bytes_moved = manifest.op_bytes(op, dims)
    out_kw = out_sets[0]
    eager_out = _eager_us(lambda: fn(*args, **kwargs, **out_kw))
    eager_alloc = _eager_us(lambda: fn(*args, **kwargs))
    fn(*args, **kwargs, **out_kw)
    bare = _eager_us(lambda: _C._replay_last_launch(1))
    ref = _resolve(f"tile_kernels_aot.torch.{ref_module}.{ref_name}")
    ref_us = _event_us(lambda: ref(*args, **kwargs), reps=5)
    row = {
        "op": op, "num_tokens": n, "dims": dims, "device_us": device_us, "bytes": bytes_moved,
        "tbs": bytes_moved / device_us / 1e6, "copy_share": bytes_moved / device_us / 1e6 / copy_tbs,
        "eager_out_us": eager_out, "eager_alloc_us": eager_alloc, "bare_launch_us": bare,
        "overhead_out_us": eager_out - bare, "overhead_alloc_us": eager_alloc - bare,
        "reference_us": ref_us, "input_sets": sets,
    }
    try:
        import tile_kernels  # noqa: F401

        upstream = _resolve(f"tile_kernels.{op}")
        row["tilekernels_jit_us"] = _event_us(lambda: upstream(*args, **kwargs))
        row["tilekernels_eager_us"] = _eager_us(lambda: upstream(*args, **kwargs), n=500)
    except ImportError:
        pass
    return row


def run(json_path=None, only=None) -> int:
    if not torch.cuda.is_available():
        print("bench: no CUDA device", file=sys.stderr)
        return 1
    copy_tbs = copy_bandwidth_tbs()
    rows = []
    for op, make, ref_module, ref_name in _cases():
        if only and op not in only:
            continue
        for n in (PREFILL, DECODE):
            rows.append(bench_op(op, make, ref_module, ref_name, n, copy_tbs))
    first = first_call_ms()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_tbs": copy_tbs,
              "first_call_ms": first, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    print(format_table(result))
    return 0


def format_table(result: dict) -> str:
    lines = [f"{result['gpu']}, torch {result['torch']}, {result['date']}: copy bandwidth {result['copy_tbs']:.2f} TB/s, "
             f"first call in a fresh process {result['first_call_ms']:.1f} ms", "",
             "| op | tokens | device us | TB/s | % of copy | eager out= us | eager alloc us | bare launch us | "
             "overhead out= us | overhead alloc us | torch ref us |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['op']} | {r['num_tokens']} | {r['device_us']:.1f} | {r['tbs']:.2f} | {100 * r['copy_share']:.0f}% | "
                     f"{r['eager_out_us']:.2f} | {r['eager_alloc_us']:.2f} | {r['bare_launch_us']:.2f} | "
                     f"{r['overhead_out_us']:+.2f} | {r['overhead_alloc_us']:+.2f} | {r['reference_us']:.1f} |")
    return "\n".join(lines)
