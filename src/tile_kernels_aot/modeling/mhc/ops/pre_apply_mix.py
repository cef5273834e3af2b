"""``mhc_pre_apply_mix``: the sublayer input, the streams weighted by the pre mix."""

from __future__ import annotations

import torch

from tile_kernels_aot.modeling.mhc.ops._impl import impl, written


class MHCPreApplyMix(torch.autograd.Function):
    """``sum_m mix[m] * x[m]``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, mix)
        return written(ctx, impl.mhc_pre_apply_mix(x, mix, out), out)

    @staticmethod
    def backward(ctx, o_grad: torch.Tensor):
        x, mix = ctx.saved_tensors
        x_grad, mix_grad = impl.mhc_pre_apply_mix_bwd(o_grad, x, mix)
        return x_grad, mix_grad, None


def mhc_pre_apply_mix(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.mhc_pre_apply_mix`."""
    return MHCPreApplyMix.apply(x, mix, out)
