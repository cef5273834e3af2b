"""mHC (manifold hyper-connections) as autograd Functions over the references.

Same names and arguments as TileKernels 1.0.0's ``tile_kernels.modeling.mhc``
(its ``ops`` and ``functional`` modules, flattened into this one module):

* ops: ``expand_to_mhc``, ``sinkhorn_normalize``, ``mhc_pre_norm_fn``,
  ``mhc_pre_split_mixes``, ``mhc_pre_apply_mix``, ``mhc_post`` (with
  ``mhc_post_fwd`` / ``mhc_post_bwd``), ``mhc_head_compute_mix``,
  ``mhc_pre_big_fuse``, ``mhc_multilayer_recompute``;
* pipeline: ``expand_from_embedding``, ``mhc_pre``, ``mhc_head``.

Every forward and backward runs on :mod:`tile_kernels_aot.torch.mhc`, so this is
the plain-PyTorch model of the training path (the backward formulas are the
``*_bwd`` references, checked with ``torch.autograd.gradcheck``).

Two deliberate differences from upstream:

* Gradients always flow through autograd's return values.  Upstream hands the
  residual gradient from ``mhc_post``'s backward to the pre path through an
  attribute on the residual's storage (``grad_from_mhc_post``) and accumulates
  into it in place; ``fuse_grad_acc`` is accepted here for signature
  compatibility and has no effect.  Megatron-style ``main_grad`` accumulation is
  not done either.  The resulting gradients are the same sums.
* ``mhc_pre`` with gradients disabled folds ``norm_weight`` into ``fn`` before
  the fused inference path.  Upstream 1.0.0 silently drops ``norm_weight`` on
  that path, so its inference and training outputs differ when a norm weight
  is given; here they agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tile_kernels_aot.torch import mhc as _ref

__all__ = [
    "ExpandToMHCFn",
    "MHCHeadComputeMix",
    "MHCPreNormFn",
    "MHCPost",
    "MHCPreApplyMix",
    "MHCPreSplitMixes",
    "expand_to_mhc",
    "sinkhorn_normalize",
    "mhc_pre_norm_fn",
    "mhc_pre_split_mixes",
    "mhc_pre_apply_mix",
    "mhc_post",
    "mhc_post_fwd",
    "mhc_post_bwd",
    "mhc_head_compute_mix",
    "mhc_pre_big_fuse",
    "mhc_multilayer_recompute",
    "expand_from_embedding",
    "mhc_pre",
    "mhc_head",
]

# Forward-only entry points: the same functions as the references.
mhc_post_fwd = _ref.mhc_post_fwd
mhc_post_bwd = _ref.mhc_post_bwd
mhc_pre_big_fuse = _ref.mhc_pre_big_fuse
mhc_multilayer_recompute = _ref.mhc_multilayer_recompute


def _written(ctx, result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Return ``result`` or, when an ``out`` buffer was filled, mark it dirty."""
    if out is not None:
        ctx.mark_dirty(out)
    return result


# ----------------------------------------------------------------------------
# ops
# ----------------------------------------------------------------------------


class ExpandToMHCFn(torch.autograd.Function):
    """``(..., H) -> (..., M, H)``; backward sums over the streams."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, mhc_mult: int, out: torch.Tensor | None) -> torch.Tensor:
        return _written(ctx, _ref.expand_to_mhc(hidden, mhc_mult, out), out)

    @staticmethod
    def backward(ctx, out_grad: torch.Tensor):
        return _ref.expand_to_mhc_bwd(out_grad), None, None


def expand_to_mhc(hidden: torch.Tensor, mhc_mult: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.expand_to_mhc`."""
    return ExpandToMHCFn.apply(hidden, mhc_mult, out)


class _SinkhornNormalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.repeat, ctx.eps = repeat, eps
        return _ref.sinkhorn_normalize(x, repeat, eps)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        return _ref.sinkhorn_normalize_bwd(grad_output, x, ctx.repeat, ctx.eps), None, None


def sinkhorn_normalize(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.sinkhorn_normalize`."""
    return _SinkhornNormalize.apply(x, repeat, eps)


class _MHCFnNormwMerge(torch.autograd.Function):
    """``fn * normw`` (the RMSNorm weight folded into the projection)."""

    @staticmethod
    def forward(ctx, fn: torch.Tensor, normw: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(fn, normw)
        return _ref.mhc_fn_normw_merge(fn, normw)

    @staticmethod
    def backward(ctx, out_fn_grad: torch.Tensor):
        fn, normw = ctx.saved_tensors
        return _ref.mhc_fn_normw_merge_bwd(fn, normw, out_fn_grad)


class MHCPreNormFn(torch.autograd.Function):
    """RMS-normalised projection ``(x @ fn.T) * rsqrt(mean(x**2) + eps)``."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        fn: torch.Tensor,
        norm_eps: float,
        fuse_grad_acc: bool,
        n_splits: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, fn)
        ctx.norm_eps = norm_eps
        return _ref.mhc_pre_norm_fn(x, fn, None, norm_eps, fuse_grad_acc, n_splits)

    @staticmethod
    def backward(ctx, out_grad: torch.Tensor):
        x, fn = ctx.saved_tensors
        x_grad, fn_grad, _ = _ref.mhc_pre_norm_fn_bwd(out_grad, x, fn, None, ctx.norm_eps)
        return x_grad, fn_grad, None, None, None


def mhc_pre_norm_fn(
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    fuse_grad_acc: bool = True,
    n_splits: int = 16,
) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.mhc_pre_norm_fn`.

    ``fuse_grad_acc`` and ``n_splits`` are accepted for compatibility and do not
    change results (see the module docstring).
    """
    if mhc_norm_weight is not None:
        mhc_fn = _MHCFnNormwMerge.apply(mhc_fn, mhc_norm_weight)
    return MHCPreNormFn.apply(residual, mhc_fn, mhc_norm_eps, fuse_grad_acc, n_splits)


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
        return _ref.mhc_pre_split_mixes(
            input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps
        )

    @staticmethod
    def backward(ctx, pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad):
        input_mixes, mhc_scale, mhc_base = ctx.saved_tensors
        input_grad, scale_grad, base_grad = _ref.mhc_pre_split_mixes_bwd(
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


class MHCPreApplyMix(torch.autograd.Function):
    """``sum_m mix[m] * x[m]``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, mix)
        return _written(ctx, _ref.mhc_pre_apply_mix(x, mix, out), out)

    @staticmethod
    def backward(ctx, o_grad: torch.Tensor):
        x, mix = ctx.saved_tensors
        x_grad, mix_grad = _ref.mhc_pre_apply_mix_bwd(o_grad, x, mix)
        return x_grad, mix_grad, None


def mhc_pre_apply_mix(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.mhc_pre_apply_mix`."""
    return MHCPreApplyMix.apply(x, mix, out)


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
        return _written(ctx, _ref.mhc_post_fwd(x, residual, post_layer_mix, comb_res_mix, out), out)

    @staticmethod
    def backward(ctx, d_o: torch.Tensor):
        return *_ref.mhc_post_bwd(*ctx.saved_tensors, d_o, fuse_grad_acc=False), None


def mhc_post(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.mhc_post`."""
    return MHCPost.apply(x, residual, post_layer_mix, comb_res_mix, out)


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
        return _ref.mhc_head_compute_mix(input_mix, mhc_scale, mhc_base, mhc_pre_eps)

    @staticmethod
    def backward(ctx, output_mix_grad: torch.Tensor):
        return *_ref.mhc_head_compute_mix_bwd(output_mix_grad, *ctx.saved_tensors), None


def mhc_head_compute_mix(
    input_mix: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_pre_eps: float,
) -> torch.Tensor:
    """Differentiable :func:`tile_kernels_aot.torch.mhc.mhc_head_compute_mix`."""
    return MHCHeadComputeMix.apply(input_mix, mhc_scale, mhc_base, mhc_pre_eps)


# ----------------------------------------------------------------------------
# pipeline (upstream's functional module)
# ----------------------------------------------------------------------------


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
        fused_fn = fn if norm_weight is None else _ref.mhc_fn_normw_merge(fn, norm_weight)
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
