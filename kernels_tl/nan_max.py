"""Maxima that keep NaN (PTX ``max.NaN``, sm_80 and up): a reduction over them is NaN as soon
as one input is NaN, as ``torch.amax`` is.  The quantizing kernels take their group maxima
with these, so a NaN in a group reaches its scale factor (docs/ops.md, "NaN").

A kernel using them calls ``T.import_source(DEVICE_SOURCE)`` in its body once.
"""

from tilelang import language as T

DEVICE_SOURCE = r"""
__device__ __forceinline__ float tka_max_nan(float a, float b) {
  float d; asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d;
}
__device__ __forceinline__ unsigned tka_bf16x2_max_nan(unsigned a, unsigned b) {
  unsigned d; asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d;
}
"""


def max_nan(a, b):
    """The larger of two float32 values, NaN if either is NaN."""
    return T.call_extern(T.float32, "tka_max_nan", a, b)


def bf16x2_max_nan(a, b):
    """Lane-wise max of two bf16 pairs packed in uint32 words, NaN where either lane is NaN."""
    return T.call_extern(T.uint32, "tka_bf16x2_max_nan", a, b)
