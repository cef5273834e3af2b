"""The mHC ops as autograd Functions, one module per op, at TileKernels' paths
(``tile_kernels.modeling.mhc.ops.<op>``)."""

from tile_kernels_aot.modeling.mhc.ops.expand import ExpandToMHCFn, expand_to_mhc
from tile_kernels_aot.modeling.mhc.ops.head_compute_mix import MHCHeadComputeMix, mhc_head_compute_mix
from tile_kernels_aot.modeling.mhc.ops.multilayer_recompute import mhc_multilayer_recompute
from tile_kernels_aot.modeling.mhc.ops.norm_fn import MHCPreNormFn, mhc_pre_norm_fn
from tile_kernels_aot.modeling.mhc.ops.post import MHCPost, mhc_post, mhc_post_bwd, mhc_post_fwd
from tile_kernels_aot.modeling.mhc.ops.pre_apply_mix import MHCPreApplyMix, mhc_pre_apply_mix
from tile_kernels_aot.modeling.mhc.ops.pre_big_fuse import mhc_pre_big_fuse
from tile_kernels_aot.modeling.mhc.ops.pre_split_mixes import MHCPreSplitMixes, mhc_pre_split_mixes
from tile_kernels_aot.modeling.mhc.ops.sinkhorn import sinkhorn_normalize

__all__ = ["ExpandToMHCFn", "MHCHeadComputeMix", "MHCPreNormFn", "MHCPost", "MHCPreApplyMix", "MHCPreSplitMixes",
           "expand_to_mhc", "mhc_head_compute_mix", "mhc_multilayer_recompute", "mhc_pre_norm_fn", "mhc_post",
           "mhc_post_bwd", "mhc_post_fwd", "mhc_pre_apply_mix", "mhc_pre_big_fuse", "mhc_pre_split_mixes",
           "sinkhorn_normalize"]
