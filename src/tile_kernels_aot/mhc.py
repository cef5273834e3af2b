"""Manifold hyper-connection (mHC) operators, launched from prebuilt kernels (the kernels behind
``tile_kernels.modeling.mhc.ops``)."""

from tile_kernels_aot.families import export

__all__ = export(__name__, globals())
