"""The routed path of one MoE layer (``tile_kernels_aot.moe_layer``: gate, mapping without a
host sync, expand, SwiGLU + cast with routing weights, reduce) captured in one CUDA graph,
bit-identical to the same composition of the PyTorch references, at decode and prefill."""

import pytest
import torch

import tile_kernels_aot as tk
from tile_kernels_aot import moe_layer

from checks import assert_bits_equal
from ops import OPS, qualname

LAYER_OPS = {"moe.top2_sum_gate", "moe.get_fused_mapping", "quant.per_token_cast", "moe.expand_to_fused_with_sf",
             "quant.swiglu_forward_and_per_token_cast", "moe.reduce_fused"}


@pytest.mark.parametrize("num_tokens", [128, 8192])
def test_layer_in_one_graph_matches_the_references(num_tokens):
    missing = LAYER_OPS - {qualname(r) for r in OPS}
    if missing:
        pytest.skip(f"the layer needs {sorted(missing)}")
    w_gate, bias = moe_layer.weights()
    x = moe_layer.tokens(num_tokens, seed=num_tokens)
    graph, outputs = moe_layer.captured(tk, x, w_gate, bias)
    for name in outputs:  # poison: the replay must rewrite everything
        if outputs[name].is_floating_point():
            outputs[name].view(torch.uint8).fill_(0x7F)
        else:
            outputs[name].fill_(-7)
    x.copy_(moe_layer.tokens(num_tokens, seed=num_tokens + 1))  # a fresh batch in the static input
    graph.replay()
    torch.cuda.synchronize()
    expected = moe_layer.routed_layer(moe_layer.references(), x, w_gate, bias)
    assert outputs.keys() == expected.keys()
    for name, tensor in expected.items():
        assert_bits_equal(outputs[name], tensor, f"{num_tokens} tokens: {name}")
    routed = expected["token_topk_to_pos"] >= 0
    assert routed.any() and expected["out"].abs().sum() > 0  # the layer did route and compute something
