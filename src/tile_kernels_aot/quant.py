"""Quantization operators, launched from prebuilt kernels (same API as ``tile_kernels.quant``)."""

from tile_kernels_aot._C import quant as _kernels

per_token_cast = _kernels.per_token_cast
per_token_cast_with_sf_only = _kernels.per_token_cast_with_sf_only
per_token_cast_with_precomputed_sf = _kernels.per_token_cast_with_precomputed_sf
swiglu_forward_and_per_token_cast = _kernels.swiglu_forward_and_per_token_cast

__all__ = [
    "per_token_cast",
    "per_token_cast_with_sf_only",
    "per_token_cast_with_precomputed_sf",
    "swiglu_forward_and_per_token_cast",
]
