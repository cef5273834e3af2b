"""``sinkhorn_normalize``: the stream-mixing matrix made (nearly) doubly stochastic."""

from __future__ import annotations

import torch

from tile_kernels_aot.modeling.mhc.ops._impl import impl


class _SinkhornNormalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.repeat, ctx.eps = repeat, eps
        return impl.sinkhorn_normalize(x, repeat, eps)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        return impl.sinkhorn_normalize_bwd(grad_output, x, ctx.repeat, ctx.eps), None, None


def sinkhorn_normalize(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.sinkhorn_normalize`."""
    return _SinkhornNormalize.apply(x, repeat, eps)
