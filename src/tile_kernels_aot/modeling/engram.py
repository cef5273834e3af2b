"""Engram gate as an autograd Function (mirrors ``tile_kernels.modeling.engram``).

``EngramGateFn`` (= ``engram_gate``) runs forward and backward on the prebuilt kernels of
``tile_kernels_aot.engram``:

    fused_weight -> engram_gate_fwd            (forward, saving dot/gate/rstd_x/rstd_k)
    engram_gate_bwd -> grad_w_reduce           (backward)

``EngramGateRefFn`` (= ``engram_gate_ref``) is the same composition on the PyTorch
references of ``tile_kernels_aot.torch.engram``: it runs anywhere (CPU, float64 for
gradient checks) and is what the kernels' results are tested against.
"""

import torch

from tile_kernels_aot.torch import engram as _reference

__all__ = ["EngramGateFn", "engram_gate", "EngramGateRefFn", "engram_gate_ref"]


def _kernels():
    from tile_kernels_aot import engram  # the extension; imported on first use

    return engram


def _forward(ctx, ops, hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps):
    shape = hidden_states.shape
    hc_mult, hidden_size = shape[-2], shape[-1]
    x = hidden_states.reshape(-1, hc_mult, hidden_size).contiguous()
    k = k.reshape(-1, hc_mult, hidden_size)
    v = v.reshape(-1, hidden_size)

    w = ops.fused_weight(weight_hidden, weight_embed)
    output, dot, gate_score, rstd_x, rstd_k = ops.engram_gate_fwd(x, k, v, w, eps, clamp_value)

    ctx.save_for_backward(x, k, v, weight_hidden, weight_embed, w, dot, gate_score, rstd_x, rstd_k)
    ctx.clamp_value = clamp_value
    ctx.shape = shape
    return output.view(shape)


def _backward(ctx, ops, grad_output):
    x, k, v, weight_hidden, weight_embed, w, dot, gate_score, rstd_x, rstd_k = ctx.saved_tensors
    shape = ctx.shape
    hc_mult, hidden_size = shape[-2], shape[-1]

    grad_x, grad_k, grad_v, grad_w_partial = ops.engram_gate_bwd(
        grad_output.reshape(-1, hc_mult, hidden_size).contiguous(),
        x, k, v, w, dot, gate_score, rstd_x, rstd_k, ctx.clamp_value,
    )

    # Weight gradients accumulate into main_grad where the caller keeps one,
    # else into fresh fp32 (fp64 for fp64 weights) zero buffers.
    main_wh = getattr(weight_hidden, "main_grad", None)
    main_we = getattr(weight_embed, "main_grad", None)
    grad_dtype = torch.promote_types(torch.float32, weight_hidden.dtype)
    grad_wh = main_wh if main_wh is not None else torch.zeros_like(weight_hidden, dtype=grad_dtype)
    grad_we = main_we if main_we is not None else torch.zeros_like(weight_embed, dtype=grad_dtype)
    ops.grad_w_reduce(grad_w_partial, weight_hidden, weight_embed, grad_wh, grad_we)

    return (
        grad_x.view(shape),
        grad_k.view(shape),
        grad_v.view(*shape[:-2], hidden_size),
        None if main_wh is not None else grad_wh,
        None if main_we is not None else grad_we,
        None,
        None,
    )


class EngramGateFn(torch.autograd.Function):
    """Fused RMSNorm + engram gate, on the prebuilt kernels.

    ``output = hidden_states + sigmoid(signed_sqrt(<RMSNorm(x) * wh, RMSNorm(k) * we> / sqrt(H))) * v``
    per token and stream, where ``signed_sqrt(z) = copysign(sqrt(max(|z|, clamp_value)), z)``.

    ``apply(hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps)``:

    * ``hidden_states``, ``k``: ``[..., hc_mult, H]`` bfloat16 (CUDA);
    * ``v``: ``[..., H]`` bfloat16 (shared by the ``hc_mult`` streams);
    * ``weight_hidden``, ``weight_embed``: ``[hc_mult, H]`` bfloat16 RMSNorm weights;
    * ``clamp_value``, ``eps``: floats (no gradient).

    Returns ``output`` with the shape and dtype of ``hidden_states``.

    Weight gradients are float32.  When a weight carries a ``main_grad``
    attribute (an fp32 gradient buffer), its gradient is accumulated into
    ``main_grad`` in place and ``None`` is returned for it instead.
    """

    @staticmethod
    def forward(ctx, hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps):
        return _forward(ctx, _kernels(), hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps)

    @staticmethod
    def backward(ctx, grad_output):
        return _backward(ctx, _kernels(), grad_output)


class EngramGateRefFn(torch.autograd.Function):
    """``EngramGateFn`` on the PyTorch references (any device; float64 inputs compute in
    float64).  Same arguments, results and ``main_grad`` handling."""

    @staticmethod
    def forward(ctx, hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps):
        return _forward(ctx, _reference, hidden_states, k, v, weight_hidden, weight_embed, clamp_value, eps)

    @staticmethod
    def backward(ctx, grad_output):
        return _backward(ctx, _reference, grad_output)


engram_gate = EngramGateFn.apply
engram_gate_ref = EngramGateRefFn.apply
