"""``mhc_post`` (and its forward and backward ``mhc_post_fwd``, ``mhc_post_bwd``): the new streams."""

from __future__ import annotations

import torch

from tile_kernels_aot.modeling.mhc.ops._impl import impl, written


# the forward and backward without autograd
mhc_post_fwd = impl.mhc_post_fwd
mhc_post_bwd = impl.mhc_post_bwd


class MHCPost(torch.autograd.Function):
    """``post[n] * x + sum_m comb[m, n] * residual[m]``."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        residual: torch.Tensor,
        post_layer_mix: torch.Tensor,
        comb_res_mix: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, residual, post_layer_mix, comb_res_mix)
        return written(ctx, impl.mhc_post_fwd(x, residual, post_layer_mix, comb_res_mix, out), out)

    @staticmethod
    def backward(ctx, d_o: torch.Tensor):
        return *impl.mhc_post_bwd(*ctx.saved_tensors, d_o, fuse_grad_acc=False), None


def mhc_post(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.mhc_post`."""
    return MHCPost.apply(x, residual, post_layer_mix, comb_res_mix, out)
