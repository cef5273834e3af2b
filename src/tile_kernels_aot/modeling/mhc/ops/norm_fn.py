"""``mhc_pre_norm_fn``: the RMS-normalised projection of the flattened streams."""

from __future__ import annotations

import torch

from tile_kernels_aot.modeling.mhc.ops._impl import impl
from tile_kernels_aot.torch import mhc as _reference


def _pre_norm_fn(x, fn, norm_eps, fuse_grad_acc, n_splits):
    """The forward on the kernel for what it takes (CUDA, bf16 streams, float32 projection;
    leading dims flattened), on the reference otherwise (CPU, float64 for gradcheck)."""
    if x.is_cuda and x.dtype == torch.bfloat16 and fn.dtype == torch.float32 and x.dim() >= 3:
        flat = x.reshape(-1, *x.shape[-2:])
        out = impl.mhc_pre_norm_fn(flat, fn, None, norm_eps, fuse_grad_acc, n_splits)
        return out.reshape(*x.shape[:-2], fn.shape[0])
    return _reference.mhc_pre_norm_fn(x, fn, None, norm_eps, fuse_grad_acc, n_splits)


class _MHCFnNormwMerge(torch.autograd.Function):
    """``fn * normw`` (the RMSNorm weight folded into the projection)."""

    @staticmethod
    def forward(ctx, fn: torch.Tensor, normw: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(fn, normw)
        return impl.mhc_fn_normw_merge(fn, normw)

    @staticmethod
    def backward(ctx, out_fn_grad: torch.Tensor):
        fn, normw = ctx.saved_tensors
        return impl.mhc_fn_normw_merge_bwd(fn, normw, out_fn_grad)


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
        out = _pre_norm_fn(x, fn, norm_eps, fuse_grad_acc, n_splits)
        ctx.save_for_backward(x, fn, out)
        ctx.norm_eps = norm_eps
        return out

    @staticmethod
    def backward(ctx, out_grad: torch.Tensor):
        x, fn, out = ctx.saved_tensors
        return (*_pre_norm_fn_bwd(out_grad, x, fn, out, ctx.norm_eps), None, None, None)


def _pre_norm_fn_bwd(out_grad, x, fn, out, norm_eps):
    """``(x_grad, fn_grad)``.  On the kernel's inputs (CUDA, bf16 streams, float32 projection):
    ``S = sum(x**2)`` in one float32 reduction over x, the per-token part from the saved output
    and ``S`` (``u_grad``, ``S_grad``; tiny), then the K-wide part on the kernel
    (``mhc_pre_norm_fn_bwd_mul``: ``x_grad``, ``fn_grad`` in one pass over x).  Otherwise the
    reference (CPU, float64 for gradcheck)."""
    if x.is_cuda and x.dtype == torch.bfloat16 and fn.dtype == torch.float32 and x.dim() >= 3:
        k = fn.shape[-1]
        sqrsum = torch.linalg.vector_norm(x.flatten(-2), dim=-1, dtype=torch.float32).square()
        out_mul_grad, sqrsum_grad = _reference._norm_fn_bwd_norm(out_grad, out.float(), sqrsum, k, norm_eps)
        return impl.mhc_pre_norm_fn_bwd_mul(out_mul_grad.contiguous(), sqrsum_grad.contiguous(), x, fn)
    x_grad, fn_grad, _ = impl.mhc_pre_norm_fn_bwd(out_grad, x, fn, None, norm_eps)
    return x_grad, fn_grad


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
