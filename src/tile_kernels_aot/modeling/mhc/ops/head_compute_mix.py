"""``mhc_head_compute_mix``: the stream weights in front of the LM head."""

from __future__ import annotations

import torch

from tile_kernels_aot.modeling.mhc.ops._impl import impl


class MHCHeadComputeMix(torch.autograd.Function):
    """``sigmoid(input_mix * scale + base) + eps``."""

    @staticmethod
    def forward(
        ctx,
        input_mix: torch.Tensor,
        mhc_scale: torch.Tensor,
        mhc_base: torch.Tensor,
        mhc_pre_eps: float,
    ) -> torch.Tensor:
        ctx.save_for_backward(input_mix, mhc_scale, mhc_base)
        return impl.mhc_head_compute_mix(input_mix, mhc_scale, mhc_base, mhc_pre_eps)

    @staticmethod
    def backward(ctx, output_mix_grad: torch.Tensor):
        return *impl.mhc_head_compute_mix_bwd(output_mix_grad, *ctx.saved_tensors), None


def mhc_head_compute_mix(
    input_mix: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_pre_eps: float,
) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.mhc_head_compute_mix`."""
    return MHCHeadComputeMix.apply(input_mix, mhc_scale, mhc_base, mhc_pre_eps)
