"""MoE routing operators, launched from prebuilt kernels (same API as ``tile_kernels.moe``)."""

from tile_kernels_aot._C import moe as _kernels

topk_gate = _kernels.topk_gate

__all__ = ["topk_gate"]
