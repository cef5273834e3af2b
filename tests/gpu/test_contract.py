"""The launch contract, for every op: bit-identical reruns, per-token rows independent of
the batch, CUDA graph capture and replay, a non-default stream, empty inputs, reuse of freed
output memory, and no JIT."""

import os
import subprocess
import sys

import pytest
import torch

import tile_kernels_aot
from tile_kernels_aot import quant, samples, transpose

from checks import assert_bits_equal, prebuilt_configs
from ops import OPS, function, in_place, qualname


def _first_sample(record):
    """The op's first sample that does not wait for the device (those are captured in graphs)."""
    return next(s for s in record["samples"] if not s.get("host_sync"))


def _case(record):
    """(name, call(num_tokens, gen) -> (fn, args, kwargs), per_token): the op's first sample at
    another token count (rounded up to one the op accepts)."""
    fn, sample = function(record), _first_sample(record)

    def call(n, gen):
        args, kwargs = samples.make_args(sample, samples.token_counts(record, n)[0], gen)
        return fn, args, kwargs

    call.in_place = in_place(record)  # no outputs of its own: the allocation tests do not apply
    return qualname(record), call, record["token_dim"] is not None


CASES = [_case(r) for r in OPS if samples.is_prebuilt(r, _first_sample(r))]
IDS = [c[0] for c in CASES]
PER_TOKEN = [c for c in CASES if c[2]]


def _outputs(result):
    """The tensors of a call's result, a returned tensor list's tensors each (an op wrapped in
    Python may return more, e.g. a list of ints)."""
    if isinstance(result, list):  # an in-place op's one updated tensor list
        return tuple(result)
    if not isinstance(result, tuple):
        return (result,)
    tensors = []
    for t in result:
        if isinstance(t, torch.Tensor):
            tensors.append(t)
        elif isinstance(t, list) and t and all(isinstance(v, torch.Tensor) for v in t):
            tensors += t
    return tuple(tensors)


@pytest.mark.parametrize("name,call,per_token", CASES, ids=IDS)
def test_bit_identical_reruns(name, call, per_token, gen):
    fn, args, kwargs = call(3000, gen)
    first = _outputs(fn(*args, **kwargs))
    for _ in range(3):
        for a, b in zip(first, _outputs(fn(*args, **kwargs))):
            assert_bits_equal(b, a, f"{name} rerun")


def _rows(value, start, stop, n):
    """Rows start:stop of a per-token argument (a tensor with n rows, a (data, sf) pair or a
    tensor list of them), else the value itself."""
    if isinstance(value, tuple):
        return tuple(_rows(v, start, stop, n) for v in value)
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [_rows(v, start, stop, n) for v in value]
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n:
        return value[start:stop].contiguous()
    return value


@pytest.mark.parametrize("name,call,per_token", PER_TOKEN, ids=[c[0] for c in PER_TOKEN])
def test_row_independent_of_batch(name, call, per_token, gen):
    fn, args, kwargs = call(1000, gen)
    full = _outputs(fn(*args, **kwargs))
    for start, stop in ((0, 1), (5, 6), (3, 131), (999, 1000)):
        part = _outputs(fn(*[_rows(a, start, stop, 1000) for a in args],
                           **{k: _rows(v, start, stop, 1000) for k, v in kwargs.items()}))
        for a, b in zip(full, part):
            assert a.shape[0] == 1000, f"{name}: a per-token output has {a.shape[0]} rows"
            assert_bits_equal(b, a[start:stop], f"{name} rows {start}:{stop}")


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
    fn, args, kwargs = call(512, gen)
    expected = _outputs(fn(*args, **kwargs))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        on_stream = _outputs(fn(*args, **kwargs))
    stream.synchronize()
    for a, b in zip(expected, on_stream):
        assert_bits_equal(b, a, f"{name} side stream")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _outputs(fn(*args, **kwargs))
    _assert_replay_writes(graph, captured, expected, name)


@pytest.mark.parametrize("name,call,per_token", PER_TOKEN, ids=[c[0] for c in PER_TOKEN])
def test_empty_input(name, call, per_token, gen):
    fn, args, kwargs = call(4, gen)
    full = _outputs(fn(*args, **kwargs))
    _, empty_args, empty_kwargs = call(0, gen)
    empty = _outputs(fn(*empty_args, **empty_kwargs))
    for f, e in zip(full, empty):
        assert e.shape[0] == 0 or e.shape[1] == 0 or e.numel() == 0
        assert e.dtype == f.dtype and e.device == f.device


def _pointers(outputs):
    return {t.data_ptr() for t in outputs}


@pytest.mark.parametrize("name,call,per_token", CASES, ids=IDS)
def test_freed_outputs_reused_on_their_stream_only(name, call, per_token, gen):
    """A small call's outputs, once freed, back the next call on the same stream; a live
    output is never reused, and another stream allocates afresh."""
    if call.in_place:
        pytest.skip("an in-place op allocates no outputs")
    tile_kernels_aot.empty_cache()
    fn, args, kwargs = call(128, gen)
    _, other, other_kw = call(128, gen)
    expected, expected_other = _outputs(fn(*args, **kwargs)), _outputs(fn(*other, **other_kw))
    first = _outputs(fn(*args, **kwargs))
    freed = _pointers(first)
    del first
    second = _outputs(fn(*other, **other_kw))
    assert _pointers(second) == freed, f"{name}: freed output memory was not reused"
    third = _outputs(fn(*args, **kwargs))  # `second` is alive: fresh memory
    assert not _pointers(third) & _pointers(second)
    for a, b in zip(expected_other, second):
        assert_bits_equal(b, a, f"{name} output in reused memory")
    for a, b in zip(expected, third):
        assert_bits_equal(b, a, f"{name} output beside a live one")
    del second
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        on_stream = _outputs(fn(*args, **kwargs))
        assert not _pointers(on_stream) & freed, f"{name}: another stream's freed memory was reused"
        kept = _pointers(on_stream)
        del on_stream
        again = _outputs(fn(*other, **other_kw))
        assert _pointers(again) == kept
    stream.synchronize()
    for a, b in zip(expected_other, again):
        assert_bits_equal(b, a, f"{name} side stream, reused memory")


# the largest allocation of a call's outputs the runtime keeps for reuse (csrc/runtime.cc)
KEPT_BLOB_BYTES = 8 << 20


def _blob_bytes(outputs) -> int:
    """The bytes of the one allocation a call's fresh outputs share (each 16-byte aligned)."""
    return sum((t.untyped_storage().nbytes() + 15) // 16 * 16 for t in outputs)


@pytest.mark.parametrize("name,call,per_token", CASES, ids=IDS)
def test_graph_memory_not_shared_with_eager_calls(name, call, per_token, gen):
    """A capture takes no freed eager memory, and outputs freed inside a capture (the graph
    pool's) back no eager call: eager outputs alive across a replay stay intact."""
    if call.in_place:
        pytest.skip("an in-place op allocates no outputs")
    tile_kernels_aot.empty_cache()
    fn, args, kwargs = call(128, gen)
    _, other, other_kw = call(128, gen)
    expected, expected_other = _outputs(fn(*args, **kwargs)), _outputs(fn(*other, **other_kw))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        freed = _pointers(_outputs(fn(*other, **other_kw)))  # freed at once: kept for this stream
        with torch.cuda.graph(graph, stream=stream):
            _outputs(fn(*args, **kwargs))  # an intermediate, freed inside the capture
            captured = _outputs(fn(*args, **kwargs))
        # Only memory the package keeps for reuse (blobs up to KEPT_BLOB_BYTES) is its
        # own to keep from a capture; larger outputs go back to torch at once, and entering
        # torch.cuda.graph empties torch's cache, so the driver may hand the capture the same
        # addresses afresh: not shared memory (the eager outputs alive across the replay below
        # are what must stay intact).
        if _blob_bytes(captured) <= KEPT_BLOB_BYTES:
            assert not _pointers(captured) & freed, f"{name}: the capture took freed eager memory"
        eager = [_outputs(fn(*other, **other_kw)) for _ in range(3)]
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
    # the 8 MiB of data went back to torch; only its 256 KiB scale factors are kept
    assert torch.cuda.memory_allocated() - base < big.numel()
    tile_kernels_aot.empty_cache()
    assert torch.cuda.memory_allocated() == base


NO_JIT_PROCESS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('tilelang', 'tvm', 'tvm_ffi'):
            raise ImportError(name)
sys.meta_path.insert(0, Block())
import torch
from tile_kernels_aot import manifest, samples
g = torch.Generator(device="cuda").manual_seed(1)
checks = 0
for record in manifest.ops():
    sample = record["samples"][0]
    if not samples.is_prebuilt(record, sample):
        continue
    args, kwargs = samples.make_args(sample, samples.token_counts(record, 300)[0], g)
    ours = samples.outputs_by_name(record, samples.function(record)(*args, **kwargs))
    ref = samples.outputs_by_name(record, samples.reference(record)(*args, **kwargs))
    for name, t in ours.items():
        if name in record.get("tolerance", {}):  # compared within its tolerance in test_ops
            continue
        e = ref[name]
        assert torch.equal(t.cpu().contiguous().view(torch.uint8), e.cpu().contiguous().view(torch.uint8)), (record["name"], name)
    checks += 1
assert checks > 0
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
        fn, args1, kw1 = call(300, g1)
    fn, args0, kw0 = call(300, g0)
    on1 = _outputs(fn(*args1, **kw1))
    assert torch.cuda.current_device() == 0
    on0 = _outputs(fn(*args0, **kw0))
    for a, b in zip(on0, on1):
        assert b.device == torch.device("cuda", 1)
        assert_bits_equal(b, a, f"{name} on cuda:1")
