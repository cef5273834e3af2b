"""The launch contract, for every op: bit-identical reruns, per-token rows independent of
the batch, CUDA graph capture and replay, a non-default stream, empty inputs, reuse of freed
output memory, and no JIT."""

import os
import subprocess
import sys

import pytest
import torch

import tile_kernels_aot
from tile_kernels_aot import moe, quant, transpose

from checks import assert_bits_equal, prebuilt_configs


def _x(n, h, dtype, gen):
    return torch.randn(n, h, generator=gen, device=gen.device).to(dtype)


def _cases():
    """(name, call(num_tokens, gen) -> (fn, args), per_token) for the first prebuilt config of each op."""
    cases = []
    if prebuilt_configs("moe.topk_gate"):
        e = prebuilt_configs("moe.topk_gate")[0]["num_experts"]
        cases.append(("moe.topk_gate", lambda n, g: (moe.topk_gate, (torch.randn(n, e, generator=g, device=g.device), min(8, e))), True))
    if prebuilt_configs("quant.per_token_cast"):
        cases.append(("quant.per_token_cast", lambda n, g: (quant.per_token_cast, (_x(n, 2048, torch.bfloat16, g), "e4m3", 128)), True))
    if prebuilt_configs("quant.swiglu_forward_and_per_token_cast"):
        cases.append(("quant.swiglu_forward_and_per_token_cast",
                      lambda n, g: (quant.swiglu_forward_and_per_token_cast, (_x(n, 4096, torch.bfloat16, g), "e4m3", 128)), True))
    if prebuilt_configs("transpose.batched_transpose"):
        cases.append(("transpose.transpose", lambda n, g: (transpose.transpose, (_x(max(n, 64) // 64 * 64, 256, torch.bfloat16, g),)), False))
    return cases


CASES = _cases()
IDS = [c[0] for c in CASES]


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("name,call,per_token", CASES, ids=IDS)
def test_bit_identical_reruns(name, call, per_token, gen):
    fn, args = call(3000, gen)
    first = _outputs(fn(*args))
    for _ in range(3):
        for a, b in zip(first, _outputs(fn(*args))):
            assert_bits_equal(b, a, f"{name} rerun")


@pytest.mark.parametrize("name,call,per_token", [c for c in CASES if c[2]], ids=[c[0] for c in CASES if c[2]])
def test_row_independent_of_batch(name, call, per_token, gen):
    fn, args = call(1000, gen)
    full = _outputs(fn(*args))
    for start, stop in ((0, 1), (5, 6), (3, 131), (999, 1000)):
        part = _outputs(fn(args[0][start:stop].contiguous(), *args[1:]))
        for a, b in zip(full, part):
            if a.dim() == 2 and a.shape[0] == 1000:  # per-token tensors (data, row-major sf)
                assert_bits_equal(b, a[start:stop], f"{name} rows {start}:{stop}")
            elif a.dim() == 2 and a.shape[1] == 1000:  # transposed views never occur here
                raise AssertionError("unexpected layout")


def _assert_replay_writes(graph, captured, expected, name):
    """Zeroes the graph's outputs, replays it and checks that it wrote `expected` into them."""
    for t in captured:
        t.zero_() if t.dtype != torch.float8_e4m3fn else t.view(torch.uint8).zero_()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(expected, captured):
        assert_bits_equal(b, a, f"{name} graph replay")


@pytest.mark.parametrize("name,call,per_token", CASES, ids=IDS)
def test_cuda_graph_and_side_stream(name, call, per_token, gen):
    fn, args = call(512, gen)
    expected = _outputs(fn(*args))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        on_stream = _outputs(fn(*args))
    stream.synchronize()
    for a, b in zip(expected, on_stream):
        assert_bits_equal(b, a, f"{name} side stream")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _outputs(fn(*args))
    _assert_replay_writes(graph, captured, expected, name)


@pytest.mark.parametrize("name,call,per_token", [c for c in CASES if c[2]], ids=[c[0] for c in CASES if c[2]])
def test_empty_input(name, call, per_token, gen):
    fn, args = call(4, gen)
    full = _outputs(fn(*args))
    empty = _outputs(fn(args[0][:0], *args[1:]))
    for f, e in zip(full, empty):
        assert e.shape[0] == 0 or e.shape[1] == 0 or e.numel() == 0
        assert e.dtype == f.dtype and e.device == f.device


def _pointers(outputs):
    return {t.data_ptr() for t in outputs}


@pytest.mark.parametrize("name,call,per_token", CASES, ids=IDS)
def test_freed_outputs_reused_on_their_stream_only(name, call, per_token, gen):
    """A small call's outputs, once freed, back the next call on the same stream; a live
    output is never reused, and another stream allocates afresh."""
    tile_kernels_aot.empty_cache()
    fn, args = call(128, gen)
    _, other = call(128, gen)
    expected, expected_other = _outputs(fn(*args)), _outputs(fn(*other))
    first = _outputs(fn(*args))
    freed = _pointers(first)
    del first
    second = _outputs(fn(*other))
    assert _pointers(second) == freed, f"{name}: freed output memory was not reused"
    third = _outputs(fn(*args))  # `second` is alive: fresh memory
    assert not _pointers(third) & _pointers(second)
    for a, b in zip(expected_other, second):
        assert_bits_equal(b, a, f"{name} output in reused memory")
    for a, b in zip(expected, third):
        assert_bits_equal(b, a, f"{name} output beside a live one")
    del second
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        on_stream = _outputs(fn(*args))
        assert not _pointers(on_stream) & freed, f"{name}: another stream's freed memory was reused"
        kept = _pointers(on_stream)
        del on_stream
        again = _outputs(fn(*other))
        assert _pointers(again) == kept
    stream.synchronize()
    for a, b in zip(expected_other, again):
        assert_bits_equal(b, a, f"{name} side stream, reused memory")


@pytest.mark.parametrize("name,call,per_token", CASES, ids=IDS)
def test_graph_memory_not_shared_with_eager_calls(name, call, per_token, gen):
    """A capture takes no freed eager memory, and outputs freed inside a capture (the graph
    pool's) back no eager call: eager outputs alive across a replay stay intact."""
    tile_kernels_aot.empty_cache()
    fn, args = call(128, gen)
    _, other = call(128, gen)
    expected, expected_other = _outputs(fn(*args)), _outputs(fn(*other))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        freed = _pointers(_outputs(fn(*other)))  # freed at once: kept for this stream
        with torch.cuda.graph(graph, stream=stream):
            _outputs(fn(*args))  # an intermediate, freed inside the capture
            captured = _outputs(fn(*args))
        assert not _pointers(captured) & freed, f"{name}: the capture took freed eager memory"
        eager = [_outputs(fn(*other)) for _ in range(3)]
    _assert_replay_writes(graph, captured, expected, name)
    for outputs in eager:
        for a, b in zip(expected_other, outputs):
            assert_bits_equal(b, a, f"{name} eager output across a replay")


@pytest.mark.skipif(not prebuilt_configs("transpose.batched_transpose"), reason="no transpose in this build")
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_back_to_back_calls_order_their_memory_accesses(graphed, gen):
    """Kernels launch as programmatic dependents of the previous grid; each must still read
    what the previous call wrote, and write only after the previous call has read."""
    a0 = torch.randn(4096, 2048, generator=gen, device="cuda").bfloat16()
    c = torch.randn(2048, 4096, generator=gen, device="cuda").bfloat16()
    a, b, d = a0.clone(), torch.empty_like(c), torch.empty_like(a0)

    def chain():
        for _ in range(4):
            transpose.transpose(a, out=b)  # b = a0^T
            transpose.transpose(c, out=a)  # overwrites what the previous call reads
            transpose.transpose(b, out=d)  # reads what the call before the previous wrote: d = a0
            transpose.transpose(d, out=b)  # b = a0^T again, right after d was written
            transpose.transpose(b, out=a)  # a = a0 for the next round

    if graphed:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            chain()
        for t in (b, d):
            t.fill_(float("nan"))
        a.copy_(a0)
        graph.replay()
    else:
        chain()
    torch.cuda.synchronize()
    assert_bits_equal(a, a0, "a after the chain")
    assert_bits_equal(d, a0, "d after the chain")
    assert_bits_equal(b, a0.t().contiguous(), "b after the chain")


def test_empty_cache_returns_kept_memory(gen):
    """Freed small outputs stay allocated (kept for reuse) until empty_cache(); large ones
    go straight back to torch."""
    x = torch.randn(128, 2048, generator=gen, device="cuda").bfloat16()
    tile_kernels_aot.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    quant.per_token_cast(x, "e4m3", 128)
    assert torch.cuda.memory_allocated() > base
    tile_kernels_aot.empty_cache()
    assert torch.cuda.memory_allocated() == base
    big = torch.randn(4096, 2048, generator=gen, device="cuda").bfloat16()  # 8 MiB of fp8 out
    base = torch.cuda.memory_allocated()
    quant.per_token_cast(big, "e4m3", 128)
    assert torch.cuda.memory_allocated() == base


NO_JIT_PROCESS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('tilelang', 'tvm', 'tvm_ffi'):
            raise ImportError(name)
sys.meta_path.insert(0, Block())
import torch
from tile_kernels_aot import manifest, moe, quant, transpose
from tile_kernels_aot.torch import moe as rmoe, quant as rquant, swiglu as rswiglu, transpose as rtranspose
g = torch.Generator(device="cuda").manual_seed(1)
checks = 0
for c in manifest.configs("moe.topk_gate")[:1]:
    s = torch.randn(300, c["num_experts"], generator=g, device="cuda")
    assert torch.equal(moe.topk_gate(s, 2), rmoe.topk_gate(s, 2)); checks += 1
if manifest.configs("quant.per_token_cast"):
    x = torch.randn(300, 2048, generator=g, device="cuda").bfloat16()
    (a, b), (c, d) = quant.per_token_cast(x, "e4m3", 128), rquant.per_token_cast(x, "e4m3", 128)
    assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)) and torch.equal(b, d); checks += 1
if manifest.configs("quant.swiglu_forward_and_per_token_cast"):
    x = torch.randn(300, 4096, generator=g, device="cuda").bfloat16()
    (a, b) = quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128)
    (c, d) = rswiglu.swiglu_forward_and_per_token_cast(x, "e4m3", 128)
    assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)) and torch.equal(b, d); checks += 1
if manifest.configs("transpose.batched_transpose"):
    x = torch.randn(256, 320, generator=g, device="cuda").bfloat16()
    assert torch.equal(transpose.transpose(x), rtranspose.transpose(x)); checks += 1
assert not any(m.split(".")[0] in ("tilelang", "tvm", "tvm_ffi") for m in sys.modules)
print("ok", checks)
"""


def test_no_jit_at_run_time():
    """A fresh process with TileLang unimportable and the driver's PTX JIT disabled runs every op."""
    env = dict(os.environ, CUDA_DISABLE_PTX_JIT="1")
    result = subprocess.run([sys.executable, "-c", NO_JIT_PROCESS], capture_output=True, text=True, env=env, cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok"), result.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name,call,per_token", CASES, ids=IDS)
def test_second_device(name, call, per_token):
    """Inputs on cuda:1 while cuda:0 is current: the op runs on cuda:1 (on its current stream),
    returns outputs there, and leaves torch's current device alone."""
    torch.cuda.set_device(0)
    g1 = torch.Generator(device="cuda:1").manual_seed(7)
    g0 = torch.Generator(device="cuda:0").manual_seed(7)
    with torch.cuda.device(1):
        fn, args1 = call(300, g1)
    fn, args0 = call(300, g0)
    on1 = _outputs(fn(*args1))
    assert torch.cuda.current_device() == 0
    on0 = _outputs(fn(*args0))
    for a, b in zip(on0, on1):
        assert b.device == torch.device("cuda", 1)
        assert_bits_equal(b, a, f"{name} on cuda:1")
