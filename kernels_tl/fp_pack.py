"""Packing conversions the quantizing kernels share (device helpers and TileLang wrappers):

* ``bf16x2(lo, hi)``: two float32 rounded to nearest even into one word of two bf16
  (``cvt.rn.bf16x2.f32``), ``lo`` in the low half;
* ``e4m3x4(a, b, c, d)``: four float32 into one word of four e4m3 bytes (saturating,
  round to nearest even: ``cvt.rn.satfinite.e4m3x2.f32``), ``a`` in the lowest byte.

PTX puts a ``cvt`` pair's first source in the upper half of the result, hence the swapped
operands.  A kernel using them calls ``T.import_source(DEVICE_SOURCE)`` (with any other
helper source appended) once in its body.
"""

from tilelang import language as T

DEVICE_SOURCE = r"""
// two float32 -> bf16x2 (round to nearest even), lo in the low half
__device__ __forceinline__ unsigned tka_bf16x2(float lo, float hi) {
  unsigned d; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo)); return d;
}
// four float32 -> e4m3 bytes (saturating, round to nearest even), a in the lowest byte
__device__ __forceinline__ unsigned tka_e4m3x4(float a, float b, float c, float d) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return (unsigned)lo | ((unsigned)hi << 16);
}
"""


def bf16x2(lo, hi):
    """A uint32 word of two bf16: ``lo`` and ``hi`` (float32) rounded to nearest even."""
    return T.call_extern(T.uint32, "tka_bf16x2", lo, hi)


def e4m3x4(a, b, c, d):
    """A uint32 word of four e4m3 bytes (saturating), ``a`` in the lowest byte."""
    return T.call_extern(T.uint32, "tka_e4m3x4", a, b, c, d)
