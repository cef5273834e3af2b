"""mHC (manifold hyper-connection) stream operators, launched from prebuilt kernels: the
forward and backward computations of :mod:`tile_kernels_aot.torch.mhc` by the same names
(tensors with the leading dims flattened into one token dim).  The autograd Functions of
:mod:`tile_kernels_aot.modeling.mhc` run them where the build has them."""

from tile_kernels_aot.families import export

__all__ = export(__name__, globals())
