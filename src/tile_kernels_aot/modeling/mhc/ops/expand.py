"""``expand_to_mhc``: an embedding copied into ``mhc_mult`` residual streams."""

from __future__ import annotations

import torch

from tile_kernels_aot.modeling.mhc.ops._impl import impl, written


class ExpandToMHCFn(torch.autograd.Function):
    """``(..., H) -> (..., M, H)``; backward sums over the streams."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, mhc_mult: int, out: torch.Tensor | None) -> torch.Tensor:
        return written(ctx, impl.expand_to_mhc(hidden, mhc_mult, out), out)

    @staticmethod
    def backward(ctx, out_grad: torch.Tensor):
        return impl.expand_to_mhc_bwd(out_grad), None, None


def expand_to_mhc(hidden: torch.Tensor, mhc_mult: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.expand_to_mhc`."""
    return ExpandToMHCFn.apply(hidden, mhc_mult, out)
