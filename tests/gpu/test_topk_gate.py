"""moe.topk_gate against the reference, on expert counts of every prebuilt size class and top-k 1..9."""

import pytest
import torch

from tile_kernels_aot import moe
from tile_kernels_aot.torch import moe as ref

from checks import assert_bits_equal, poisoned, prebuilt_configs

CLASSES = [c["max_experts"] for c in prebuilt_configs("moe.topk_gate")]
# Each class at its ends (one expert in the last slot; every slot full) and the model expert
# counts it serves (a padded last slot): max_experts - 31 .. max_experts run on one kernel.
MODELS = (16, 36, 60, 72, 100, 160, 288, 384)
EXPERTS = sorted({n for m in CLASSES for n in (m - 31, m, *(e for e in MODELS if m - 32 < e <= m))})


def _scores(num_tokens, num_experts, gen, ties):
    if ties:  # few distinct values: many ties, broken by the smaller index
        return torch.randint(-4, 4, (num_tokens, num_experts), generator=gen, device="cuda").float()
    return torch.randn(num_tokens, num_experts, generator=gen, device="cuda")


@pytest.mark.parametrize("num_experts", EXPERTS)
@pytest.mark.parametrize("num_topk", range(1, 10))
@pytest.mark.parametrize("ties", [False, True])
def test_matches_reference(num_experts, num_topk, ties, gen):
    if num_topk > num_experts:
        pytest.skip("num_topk > num_experts")
    for num_tokens in (1, 9, 1000):  # partial blocks at the end
        scores = _scores(num_tokens, num_experts, gen, ties)
        expected = ref.topk_gate(scores.cpu(), num_topk)
        out = poisoned((num_tokens, num_topk), torch.int64)
        assert moe.topk_gate(scores, num_topk, out=out) is out
        assert_bits_equal(out, expected, f"out= {num_tokens}x{num_experts} k={num_topk}")
        assert_bits_equal(moe.topk_gate(scores, num_topk), expected, "allocated")


@pytest.mark.parametrize("num_experts", sorted({*[n for n in EXPERTS if n >= 8][:1], *EXPERTS[-1:]}))
def test_special_values(num_experts, gen):
    scores = torch.randn(64, num_experts, generator=gen, device="cuda")
    scores[0, 3] = float("nan")
    scores[1, :] = float("-inf")
    scores[2, 5] = float("inf")
    scores[3, :] = 0.0
    scores[3, 7] = -0.0
    expected = ref.topk_gate(scores.cpu(), 8)
    assert_bits_equal(moe.topk_gate(scores, 8), expected, "special values")


@pytest.mark.parametrize("num_experts", [n for n in EXPERTS if n >= 9])
def test_near_ties(num_experts, gen):
    """Scores equal in all but their lowest mantissa bits: the one-reduction pass cannot
    order them from its composite keys and must redo the row with the plain keys."""
    scores = torch.randn(512, num_experts, generator=gen, device="cuda")
    base = torch.tensor(3.0).view(torch.int32).item()
    low = torch.randint(0, 1024, (512, 6), generator=gen, device="cuda", dtype=torch.int32)
    cols = torch.stack([torch.randperm(num_experts, generator=gen, device="cuda")[:6] for _ in range(512)])
    scores.scatter_(1, cols, (base + low).view(torch.float32))
    scores[::2, 0] = scores[::2, 1]  # exact ties too, in half of the rows
    for num_topk in (1, 2, 8, 9):
        expected = ref.topk_gate(scores.cpu(), num_topk)
        assert_bits_equal(moe.topk_gate(scores, num_topk), expected, f"near ties k={num_topk}")


@pytest.mark.parametrize("num_experts", EXPERTS)
@pytest.mark.parametrize("ties", [False, True])
def test_large_topk(num_experts, ties, gen):
    """Ranks are collected 32 at a time: top-k past one warp of ranks, up to all experts."""
    scores = _scores(300, num_experts, gen, ties)
    scores[7, :5] = float("nan")
    for num_topk in sorted({32, 33, num_experts}):
        if num_topk > num_experts:
            continue
        expected = ref.topk_gate(scores.cpu(), num_topk)
        out = poisoned((300, num_topk), torch.int64)
        moe.topk_gate(scores, num_topk, out=out)
        assert_bits_equal(out, expected, f"{num_experts} experts k={num_topk}")
