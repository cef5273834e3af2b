"""Engram gating and hashing operators, launched from prebuilt kernels (the API of
``tile_kernels.engram``)."""

from tile_kernels_aot.families import export

__all__ = export(__name__, globals())
