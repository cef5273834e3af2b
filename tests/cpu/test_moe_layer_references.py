"""The routed MoE layer's composition over the PyTorch references on the CPU: the path the GPU
test captures in one graph is well formed (every token routed to distinct experts, fused rows
sized from the arguments, a deterministic output)."""

import torch

from tile_kernels_aot import moe_layer


def test_reference_layer_routes_every_token_and_is_deterministic():
    w_gate, bias = moe_layer.weights("cpu")
    x = moe_layer.tokens(16, "cpu")
    first = moe_layer.routed_layer(moe_layer.references(), x, w_gate, bias)
    again = moe_layer.routed_layer(moe_layer.references(), x, w_gate, bias)
    topk_idx = first["topk_idx"]
    assert topk_idx.shape == (16, moe_layer.TOP_K)
    assert all(len(set(row.tolist())) == moe_layer.TOP_K for row in topk_idx)
    assert first["fused_q"].shape == (moe_layer.fused_rows(16), moe_layer.HIDDEN)
    assert (first["token_topk_to_pos"] >= 0).all()
    assert first["out"].shape == (16, moe_layer.HIDDEN // 2) and torch.isfinite(first["out"].float()).all()
    for name, tensor in first.items():
        assert torch.equal(tensor.view(torch.uint8), again[name].view(torch.uint8)), name
