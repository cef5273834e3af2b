"""moe.get_fused_mapping beyond its samples: inputs past each warp's shared-memory id cache, a
row count smaller than the layout, entries >= num_experts, the sync mode with out= buffers, and
the no-sync mode under CUDA-graph capture (the samples run at most 4096 tokens and the reference
refuses the first three cases)."""

import pytest
import torch

from tile_kernels_aot import manifest, samples

from checks import assert_bits_equal, poison, prebuilt_configs

pytestmark = pytest.mark.skipif(not prebuilt_configs("moe.get_fused_mapping"), reason="not in this build")

OUTPUTS = ("pos_to_expert", "pos_to_token", "pos_to_token_topk", "token_topk_to_pos", "expert_start", "expert_end",
           "num_tokens_per_expert")


def _ops():
    from tile_kernels_aot import moe
    from tile_kernels_aot.torch.moe import get_fused_mapping as reference

    return moe.get_fused_mapping, reference


def _topk_idx(tokens, num_topk, num_experts, gen, unrouted=0.1):
    idx = torch.rand(tokens, num_experts, generator=gen, device="cuda").topk(num_topk, dim=1, largest=False).indices
    dropped = torch.rand(tokens, num_topk, generator=gen, device="cuda") < unrouted
    return idx.masked_fill(dropped, -1).contiguous()


def _assert_same(got, expected, what):
    for name, g, e in zip(OUTPUTS, got, expected):
        assert_bits_equal(g, e, f"{what} {name}")
    assert list(got[7]) == list(expected[7]), f"{what}: list"


@pytest.mark.parametrize("tokens,num_topk,num_experts,alignment", [(40000, 8, 256, 128), (70001, 9, 36, 64),
                                                                    (300000, 8, 9, 128)])
def test_past_the_shared_id_cache(tokens, num_topk, num_experts, alignment, gen):
    """Warp ranges longer than the 1024 ids each warp keeps in shared memory: the rest is re-read."""
    fn, ref = _ops()
    idx = _topk_idx(tokens, num_topk, num_experts, gen)
    rows = tokens * num_topk + num_experts * (alignment - 1)
    _assert_same(fn(idx, num_experts, rows, alignment), ref(idx, num_experts, rows, alignment), f"{tokens} tokens")
    _assert_same(fn(idx, num_experts, 0, alignment), ref(idx, num_experts, 0, alignment), f"{tokens} tokens, sync")


@pytest.mark.parametrize("short", [1, 100, 5000])
def test_too_few_rows_place_what_fits(short, gen):
    """num_expanded_tokens below sum(aligned counts) (the reference refuses it): the rows that
    fit are the reference's, the pairs past them get token_topk_to_pos -1, the per-expert
    outputs describe the whole layout; nothing is written past the buffer."""
    fn, ref = _ops()
    idx = _topk_idx(3000, 8, 64, gen)
    full = ref(idx, 64, 0, 32)
    need = sum(full[7])
    rows = need - short
    guard = torch.full((rows + 4096,), -7777, dtype=torch.int32, device="cuda")
    outs = [guard[:rows], torch.empty(rows, dtype=torch.int32, device="cuda"),
            torch.empty(rows, dtype=torch.int32, device="cuda")]
    got = fn(idx, 64, rows, 32, pos_to_expert=outs[0], pos_to_token=outs[1], pos_to_token_topk=outs[2])
    for k in range(3):
        assert_bits_equal(got[k], full[k][:rows], f"short by {short}: {OUTPUTS[k]}")
    positions = full[3]
    assert_bits_equal(got[3], torch.where(positions < rows, positions, -1), f"short by {short}: token_topk_to_pos")
    for k in range(4, 7):
        assert_bits_equal(got[k], full[k], f"short by {short}: {OUTPUTS[k]}")
    assert (guard[rows:] == -7777).all(), "written past the row outputs"


def test_entries_past_num_experts_are_unrouted(gen):
    """Entries >= num_experts (the reference refuses them; no sync can) count as -1."""
    fn, ref = _ops()
    idx = torch.randint(-1, 40, (2000, 6), generator=gen, device="cuda")
    rows = 2000 * 6 + 32 * 15
    got = fn(idx, 32, rows, 16)
    expected = ref(torch.where(idx >= 32, -1, idx), 32, rows, 16)
    _assert_same(got, expected, "entries >= num_experts")


def test_sync_mode_into_given_rows(gen):
    """Sync mode with out= row outputs: their length is the row count; the list comes from the
    sync; a buffer shorter than the layout is refused after the sync."""
    fn, ref = _ops()
    idx = _topk_idx(1000, 8, 32, gen)
    expected = ref(idx, 32, 0, 64)
    need = sum(expected[7])
    given = [torch.empty(need + 300, dtype=torch.int32, device="cuda") for _ in range(3)]
    for t in given:
        poison(t)
    got = fn(idx, 32, 0, 64, pos_to_expert=given[0], pos_to_token=given[1], pos_to_token_topk=given[2])
    assert all(g is t for g, t in zip(got, given)) and got[7] == expected[7]
    padded = ref(idx, 32, need + 300, 64, force_no_sync=True)
    for k in range(7):
        assert_bits_equal(got[k], padded[k], f"sync into given rows: {OUTPUTS[k]}")
    with pytest.raises(ValueError, match="moe.get_fused_mapping: pos_to_expert .* fewer than the fused layout needs"):
        fn(idx, 32, 0, 64, pos_to_expert=torch.empty(need - 1, dtype=torch.int32, device="cuda"))


def test_no_sync_mode_is_captured_in_a_cuda_graph(gen):
    """num_expanded_tokens given (or force_no_sync): no host sync, so the call records into a
    CUDA graph, and a replay after new routing gives the new mapping."""
    fn, ref = _ops()
    idx = _topk_idx(512, 8, 256, gen)
    rows = 512 * 8 + 256 * 63
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn(idx, 256, rows, 64)
        with torch.cuda.graph(graph, stream=stream):
            captured = fn(idx, 256, rows, 64, True)
    assert captured[7] == []
    idx.copy_(_topk_idx(512, 8, 256, gen))
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(captured, ref(idx, 256, rows, 64, True), "graph replay")


def test_every_sample_mode_is_deterministic(gen):
    """Reruns of a prefill-sized call are bit-identical (no atomic decides a row)."""
    fn, _ = _ops()
    record = manifest.op("moe.get_fused_mapping")
    sample = next(s for s in record["samples"] if s["name"] == "prefill")
    args, kwargs = samples.make_args(sample, 8192, gen)
    first = fn(*args, **kwargs)
    for _ in range(5):
        _assert_same(fn(*args, **kwargs), first, "rerun")

