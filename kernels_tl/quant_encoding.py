"""Encoding pieces the quantizing kernels share (``quant.per_token_cast``, ``quant.per_block_cast``).

* ``MAX_VALUE`` / ``CLAMP_MIN``: the formats' largest magnitude and the amax clamp;
* ``scale_factors``: a group's factor bits and inverse from its amax (fp32, power of two with
  ``round_sf``, or the UE8M0 byte with ``packed_sf``), the reference's arithmetic
  (``tile_kernels_aot.torch.quant.scale_factors_from_amax``);
* ``e2m1_nibble``: the FP4 code of a float32 value without the hardware convert;
  ``has_fp4_convert``: whether the target being lowered for has one (sm_100a and up);
* ``store_scale_factor``: one tile's factor into a factor grid given by two strides, as an fp32
  word or a byte of a packed UE8M0 word (needs ``STORE_BYTE_SOURCE`` imported);
* ``PASS_CONFIGS``: the lowering options of these kernels.

Kernels using ``scale_factors`` need ``kernels_tl.nan_max.DEVICE_SOURCE`` imported.
"""

from tilelang import language as T

from kernels_tl.nan_max import max_nan

PASS_CONFIGS = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
    # every global access is guarded by the kernel's own row / piece / group tests
    "tl.disable_safe_memory_legalize": True,
}

MAX_VALUE = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}
CLAMP_MIN = {"e4m3": 1e-4, "e2m1": 6.0 * 2.0**-126, "e5m6": 1e-4}


def has_fp4_convert() -> bool:
    """Whether the target being lowered for has cvt.*.e2m1x2 (sm_100a and up)."""
    import tvm

    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "cuda":
        return False
    arch = str(target.attrs.get("arch", ""))
    return arch.startswith("sm_") and arch.endswith(("a", "f")) and int(arch[3:-1]) >= 100


def e2m1_nibble(v):
    """FP4 nibble of a float32 value, round-to-nearest-even, saturating at 6.

    The magnitude code is the number of rounding boundaries at or below |v|:
    between neighbours q_i < q_{i+1} the boundary is their midpoint, which
    belongs to the neighbour with the even code (0.25 -> 0, 0.75 -> 1.0, ...).
    The sign bit is the float's, so small negatives give -0 (0x8)."""
    a = T.abs(v)
    code = (
        T.Cast("uint32", a > T.float32(0.25)) + T.Cast("uint32", a >= T.float32(0.75))
        + T.Cast("uint32", a > T.float32(1.25)) + T.Cast("uint32", a >= T.float32(1.75))
        + T.Cast("uint32", a > T.float32(2.5)) + T.Cast("uint32", a >= T.float32(3.5))
        + T.Cast("uint32", a > T.float32(5.0))
    )
    sign = (T.reinterpret(v, T.uint32) >> T.uint32(28)) & T.uint32(8)
    return code | sign


@T.macro
def scale_factors(amax, fmt: str, round_sf, packed_sf, sf_bits, sf_inv, j):
    """``sf_bits[j]`` (fp32 factor bits, or with ``packed_sf`` the UE8M0 byte) and ``sf_inv[j]``
    of group ``j``, whose NaN-keeping maximum is ``amax[j]`` (buffers, so that the generated code
    reads them in place): ``c = max(amax, clamp)``, ``sf = c / MAX``,
    ``sf_inv = MAX / c``; with ``round_sf`` (run-time) the power of two ``2**ceil(log2(sf))``
    taken on the bits.  A NaN or infinite amax keeps the unrounded factors (UE8M0 byte 0xFF)."""
    max_value = MAX_VALUE[fmt]
    clamped = max_nan(amax[j], T.float32(CLAMP_MIN[fmt]))  # a NaN amax stays NaN
    sf_value = clamped / T.float32(max_value)
    if round_sf != 0:
        # biased exponent of 2**ceil(log2(sf)): minus one moves exact powers of two down a binade
        biased = ((T.reinterpret(sf_value, T.uint32) - T.uint32(1)) >> T.uint32(23)) + T.uint32(1)
        # a NaN or infinite amax keeps the unrounded factors (UE8M0 byte 0xFF)
        finite = (T.reinterpret(sf_value, T.uint32) & T.uint32(0x7F800000)) != T.uint32(0x7F800000)
        sf_bits[j] = T.if_then_else(
            packed_sf != 0, T.if_then_else(finite, biased, T.uint32(0xFF)),
            T.if_then_else(finite, biased << T.uint32(23), T.reinterpret(sf_value, T.uint32)))
        sf_inv[j] = T.if_then_else(finite, T.reinterpret((T.uint32(254) - biased) << T.uint32(23), T.float32),
                                   T.float32(max_value) / clamped)
    else:
        sf_bits[j] = T.reinterpret(sf_value, T.uint32)
        sf_inv[j] = T.float32(max_value) / clamped


# One byte of a packed UE8M0 word: the tiles of one word may be written by different blocks.
STORE_BYTE_SOURCE = r"""
__device__ __forceinline__ void tka_store_byte(unsigned* word, int byte, unsigned value) {
  reinterpret_cast<unsigned char*>(word)[byte] = static_cast<unsigned char>(value);
}
"""


@T.macro
def store_scale_factor(sf, sf_row, tile_col, byte, bits, packed_sf, sf_row_stride, sf_col_stride, num_sf_cols):
    """Tile (sf_row, tile_col)'s factor into the grid ``sf`` (32-bit words, element
    ``[m, k]`` at ``m * sf_row_stride + k * sf_col_stride``): the fp32 ``bits``, or with
    ``packed_sf`` the UE8M0 ``byte`` as byte ``k % 4`` of word ``[m, k // 4]``; the row's last tile
    also zeroes the word's unused bytes (the reference's padding)."""
    if packed_sf != 0:
        at = sf_row * sf_row_stride + (tile_col // 4) * sf_col_stride
        T.evaluate(T.call_extern("void", "tka_store_byte", T.address_of(sf[at]), tile_col % 4, byte))
        if tile_col == num_sf_cols - 1:
            for b in T.unroll(1, 4):
                if tile_col % 4 + b < 4:
                    T.evaluate(T.call_extern("void", "tka_store_byte", T.address_of(sf[at]),
                                             tile_col % 4 + b, T.uint32(0)))
    else:
        sf[sf_row * sf_row_stride + tile_col * sf_col_stride] = bits
