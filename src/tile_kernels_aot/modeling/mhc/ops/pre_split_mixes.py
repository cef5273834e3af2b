"""``mhc_pre_split_mixes``: mixes split into the pre, post and stream-mixing weights."""

from __future__ import annotations

import torch

from tile_kernels_aot.modeling.mhc.ops._impl import impl


class MHCPreSplitMixes(torch.autograd.Function):
    """Mixes -> (pre, post, comb) weights."""

    @staticmethod
    def forward(
        ctx,
        input_mixes: torch.Tensor,
        mhc_scale: torch.Tensor,
        mhc_base: torch.Tensor,
        mhc_mult: int,
        mhc_post_mult_value: float,
        mhc_pre_eps: float,
    ):
        ctx.save_for_backward(input_mixes, mhc_scale, mhc_base)
        ctx.mhc_mult, ctx.mhc_post_mult_value = mhc_mult, mhc_post_mult_value
        return impl.mhc_pre_split_mixes(
            input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps
        )

    @staticmethod
    def backward(ctx, pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad):
        input_mixes, mhc_scale, mhc_base = ctx.saved_tensors
        input_grad, scale_grad, base_grad = impl.mhc_pre_split_mixes_bwd(
            pre_layer_mix_grad,
            post_layer_mix_grad,
            comb_res_mix_grad,
            input_mixes,
            mhc_scale,
            mhc_base,
            ctx.mhc_mult,
            ctx.mhc_post_mult_value,
        )
        return input_grad, scale_grad, base_grad, None, None, None


def mhc_pre_split_mixes(
    input_mixes: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_mult: int,
    mhc_post_mult_value: float,
    mhc_pre_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.mhc_pre_split_mixes`."""
    return MHCPreSplitMixes.apply(
        input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps
    )
