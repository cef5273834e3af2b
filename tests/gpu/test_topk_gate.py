"""moe.topk_gate against the reference, on every prebuilt expert count and top-k 1..9."""

import pytest
import torch

from tile_kernels_aot import moe
from tile_kernels_aot.torch import moe as ref

from checks import assert_bits_equal, poisoned, prebuilt_configs

EXPERTS = [c["num_experts"] for c in prebuilt_configs("moe.topk_gate")]


def _scores(num_tokens, num_experts, gen, ties):
    if ties:  # few distinct values: many ties, broken by the smaller index
        return torch.randint(-4, 4, (num_tokens, num_experts), generator=gen, device="cuda").float()
    return torch.randn(num_tokens, num_experts, generator=gen, device="cuda")


@pytest.mark.parametrize("num_experts", EXPERTS)
@pytest.mark.parametrize("num_topk", range(1, 10))
@pytest.mark.parametrize("ties", [False, True])
def test_matches_reference(num_experts, num_topk, ties, gen):
    for num_tokens in (1, 9, 1000):  # partial blocks at the end
        scores = _scores(num_tokens, num_experts, gen, ties)
        expected = ref.topk_gate(scores.cpu(), num_topk)
        out = poisoned((num_tokens, num_topk), torch.int64)
        assert moe.topk_gate(scores, num_topk, out=out) is out
        assert_bits_equal(out, expected, f"out= {num_tokens}x{num_experts} k={num_topk}")
        assert_bits_equal(moe.topk_gate(scores, num_topk), expected, "allocated")


@pytest.mark.parametrize("num_experts", EXPERTS[:1])
def test_special_values(num_experts, gen):
    scores = torch.randn(64, num_experts, generator=gen, device="cuda")
    scores[0, 3] = float("nan")
    scores[1, :] = float("-inf")
    scores[2, 5] = float("inf")
    scores[3, :] = 0.0
    scores[3, 7] = -0.0
    expected = ref.topk_gate(scores.cpu(), 8)
    assert_bits_equal(moe.topk_gate(scores, 8), expected, "special values")
