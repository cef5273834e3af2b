"""``mhc_pre_big_fuse``: the inference-time fusion of the whole pre path (no autograd): the
prebuilt ``tile_kernels_aot.mhc.mhc_pre_big_fuse`` (the norm-fn kernel, then one kernel for split,
Sinkhorn and apply) where this build has it, with the caller's leading dims (``ops._impl``)."""

from __future__ import annotations

from tile_kernels_aot.modeling.mhc.ops._impl import impl


mhc_pre_big_fuse = impl.mhc_pre_big_fuse
