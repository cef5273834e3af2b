"""``mhc_multilayer_recompute``: several layers' sublayer inputs and streams recomputed from the saved mixes (no autograd):
the fused kernel of ``tile_kernels_aot.mhc`` (the streams kept on chip across layers) for CUDA tensors, the reference
otherwise."""

from __future__ import annotations

from tile_kernels_aot.modeling.mhc.ops._impl import impl


mhc_multilayer_recompute = impl.mhc_multilayer_recompute
