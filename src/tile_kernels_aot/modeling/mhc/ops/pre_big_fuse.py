"""``mhc_pre_big_fuse``: the inference-time fusion of the whole pre path (no autograd)."""

from __future__ import annotations

from tile_kernels_aot.modeling.mhc.ops._impl import impl


mhc_pre_big_fuse = impl.mhc_pre_big_fuse
