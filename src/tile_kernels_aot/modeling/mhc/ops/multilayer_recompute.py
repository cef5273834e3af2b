"""``mhc_multilayer_recompute``: several layers' sublayer inputs and streams recomputed from the saved mixes (no autograd)."""

from __future__ import annotations

from tile_kernels_aot.modeling.mhc.ops._impl import impl


mhc_multilayer_recompute = impl.mhc_multilayer_recompute
