"""Where the mHC ops' forward and backward computations come from.

Each name of :mod:`tile_kernels_aot.torch.mhc` that the autograd Functions call resolves to
the prebuilt kernel of ``tile_kernels_aot.mhc`` when this build has one of that name, and to
the PyTorch reference otherwise; :func:`sources` says which, per name.
"""

from __future__ import annotations

import torch

from tile_kernels_aot.torch import mhc as _reference


def _kernels():
    try:
        from tile_kernels_aot import mhc
    except ImportError:  # no mHC kernels in this build
        return None
    return mhc


class _Impl:
    """Attribute access to the kernel of a name when built, else its reference."""

    def __getattr__(self, name):
        kernels = _kernels()
        fn = getattr(kernels, name, None) if kernels is not None else None
        fn = fn or getattr(_reference, name)
        setattr(self, name, fn)
        return fn


impl = _Impl()


def sources() -> dict:
    """``{name: 'kernel' | 'reference'}`` for every computation the mHC ops use."""
    kernels = _kernels()
    return {name: "kernel" if kernels is not None and hasattr(kernels, name) else "reference"
            for name in _reference.__all__}


def written(ctx, result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Return ``result`` or, when an ``out`` buffer was filled, mark it dirty."""
    if out is not None:
        ctx.mark_dirty(out)
    return result
