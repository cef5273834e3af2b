"""The mHC pipeline of a decoder layer (TileKernels' ``tile_kernels.modeling.mhc.functional``):
``expand_from_embedding``, ``mhc_pre`` (the training path op by op, or with gradients disabled
the fused ``mhc_pre_big_fuse``) and ``mhc_head``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tile_kernels_aot.modeling.mhc.ops import (expand_to_mhc, mhc_head_compute_mix, mhc_pre_apply_mix,
                                               mhc_pre_big_fuse, mhc_pre_norm_fn, mhc_pre_split_mixes,
                                               sinkhorn_normalize)
from tile_kernels_aot.modeling.mhc.ops._impl import impl


def expand_from_embedding(x: torch.Tensor, mhc_mult: int = 4) -> torch.Tensor:
    """Turn an embedding ``(..., H)`` into ``mhc_mult`` residual streams ``(..., M, H)``."""
    return expand_to_mhc(x, mhc_mult)


def mhc_pre(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    mhc_mult: int = 4,
    post_mult_value: float = 1.0,
    pre_eps: float = 1e-6,
    sinkhorn_eps: float = 1e-6,
    sinkhorn_repeat: int = 10,
    n_splits: int = 16,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """mHC pre path of one sublayer: norm-fn, split, Sinkhorn, apply mix.

    Args:
        residual: ``(..., M, H)`` bf16 streams.
        fn: ``(M * (M + 2), M * H)`` float32 projection.
        scale: ``(3,)`` float32.  base: ``(M * (M + 2),)`` float32.
        norm_weight: optional ``(M * H,)`` float32 RMSNorm weight.
        norm_eps, mhc_mult, post_mult_value, pre_eps, sinkhorn_eps,
        sinkhorn_repeat: see the individual ops.  n_splits: no effect.

    Returns:
        ``layer_input (..., H)`` bf16 and ``(post_mix (..., M, 1), comb_mix
        (..., M, M))`` float32 to hand to :func:`mhc_post`.  With gradients
        disabled the fused :func:`mhc_pre_big_fuse` path gives the same values.
    """
    if not torch.is_grad_enabled():
        fused_fn = fn if norm_weight is None else impl.mhc_fn_normw_merge(fn, norm_weight)
        post_mix, comb_mix, layer_input = mhc_pre_big_fuse(
            residual,
            fused_fn,
            scale,
            base,
            rms_eps=norm_eps,
            mhc_pre_eps=pre_eps,
            mhc_sinkhorn_eps=sinkhorn_eps,
            mhc_post_mult_value=post_mult_value,
            sinkhorn_repeat=sinkhorn_repeat,
            n_splits=n_splits,
        )
        return layer_input, (post_mix, comb_mix)

    mixes = mhc_pre_norm_fn(residual, fn, norm_weight, norm_eps, n_splits=n_splits)
    pre_mix, post_mix, comb_mix = mhc_pre_split_mixes(mixes, scale, base, mhc_mult, post_mult_value, pre_eps)
    comb_mix = sinkhorn_normalize(comb_mix, repeat=sinkhorn_repeat, eps=sinkhorn_eps)
    layer_input = mhc_pre_apply_mix(residual, pre_mix)
    return layer_input, (post_mix, comb_mix)


def mhc_head(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    mhc_mult: int = 4,
    pre_eps: float = 1e-6,
    n_splits: int = 16,
) -> torch.Tensor:
    """mHC head: collapse the streams in front of the LM head.

    ``fn`` is ``(M, M * H)`` (or already zero-padded to ``M * (M + 2)`` rows);
    the first ``M`` normalised projections go through
    :func:`mhc_head_compute_mix` and weight the streams.

    Args:
        residual: ``(..., M, H)`` bf16.  scale: ``(1,)`` or a scalar tensor.
        base: ``(M,)``.  norm_weight, norm_eps, mhc_mult, pre_eps: as in
        :func:`mhc_pre`.  n_splits: no effect.

    Returns:
        ``(..., H)`` bf16 input to the LM head.
    """
    mhc_mult3 = mhc_mult * (mhc_mult + 2)
    if fn.shape[0] < mhc_mult3:
        fn = F.pad(fn, (0, 0, 0, mhc_mult3 - fn.shape[0]))
    mixes = mhc_pre_norm_fn(residual, fn, norm_weight, norm_eps, n_splits=n_splits)[..., :mhc_mult]
    if scale.numel() == 1:
        scale = scale.reshape(1)
    mix = mhc_head_compute_mix(mixes, scale, base, pre_eps)
    return mhc_pre_apply_mix(residual, mix.unsqueeze(-1))
