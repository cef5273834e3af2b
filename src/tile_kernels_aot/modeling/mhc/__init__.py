"""mHC (manifold hyper-connections) as autograd Functions, at TileKernels 1.0.0's paths:
``tile_kernels_aot.modeling.mhc.ops.<op>`` and ``tile_kernels_aot.modeling.mhc.functional``,
every name also exported here:

* ops: ``expand_to_mhc``, ``sinkhorn_normalize``, ``mhc_pre_norm_fn``,
  ``mhc_pre_split_mixes``, ``mhc_pre_apply_mix``, ``mhc_post`` (with
  ``mhc_post_fwd`` / ``mhc_post_bwd``), ``mhc_head_compute_mix``,
  ``mhc_pre_big_fuse``, ``mhc_multilayer_recompute``;
* pipeline: ``expand_from_embedding``, ``mhc_pre``, ``mhc_head``.

Every forward and backward runs the prebuilt kernel of ``tile_kernels_aot.mhc`` where this
build has it and the PyTorch reference of :mod:`tile_kernels_aot.torch.mhc` otherwise
(``mhc_multilayer_recompute``: one fused kernel over the layers; ``mhc_pre_big_fuse``: the norm-fn
kernel, then one kernel for split, Sinkhorn and apply); a reference that composes others, in a
build without its own kernel, runs its steps on their kernels
(``tile_kernels_aot.modeling.mhc.ops._impl.sources()`` lists which);
the backward formulas are the ``*_bwd`` references, checked with ``torch.autograd.gradcheck``.

Two deliberate differences from upstream:

* Gradients always flow through autograd's return values.  Upstream hands the
  residual gradient from ``mhc_post``'s backward to the pre path through an
  attribute on the residual's storage (``grad_from_mhc_post``) and accumulates
  into it in place; ``fuse_grad_acc`` is accepted here for signature
  compatibility and has no effect.  Megatron-style ``main_grad`` accumulation is
  not done either.  The resulting gradients are the same sums.
* ``mhc_pre`` with gradients disabled folds ``norm_weight`` into ``fn`` before
  the fused inference path.  Upstream 1.0.0 silently drops ``norm_weight`` on
  that path, so its inference and training outputs differ when a norm weight
  is given; here they agree.
"""

from tile_kernels_aot.modeling.mhc.functional import expand_from_embedding, mhc_head, mhc_pre
from tile_kernels_aot.modeling.mhc.ops import *  # noqa: F403
from tile_kernels_aot.modeling.mhc.ops import __all__ as _ops

__all__ = [*_ops, "expand_from_embedding", "mhc_head", "mhc_pre"]
