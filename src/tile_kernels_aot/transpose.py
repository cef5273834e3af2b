"""Transpose operators, launched from prebuilt kernels (same API as ``tile_kernels.transpose``)."""

from tile_kernels_aot._C import transpose as _kernels

transpose = _kernels.transpose
batched_transpose = _kernels.batched_transpose

__all__ = ["transpose", "batched_transpose"]
