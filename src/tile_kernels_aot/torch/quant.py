"""Reference implementations of the ``quant`` family (FP8 / FP4 / E5M6 casts).

These are the specification the quantization kernels are tested against.  Every
public operator keeps TileKernels 1.0.0's public kernel API (``tile_kernels.quant``):
same names, parameters, defaults and return structure, and the same output
dtypes, shapes and strides.

Formats
-------
``'e4m3'``  ``torch.float8_e4m3fn``; largest value ``MAX = 448``.
``'e2m1'``  FP4 (1 sign, 2 exponent, 1 mantissa bit; values 0, 0.5, 1, 1.5, 2, 3,
            4, 6), stored two per byte in ``torch.int8``: element ``2j`` in the low
            nibble of byte ``j``, element ``2j + 1`` in the high nibble.  The last
            dimension of the stored tensor is half the logical one.  ``MAX = 6``.
``'e5m6'``  12-bit float (1 sign, 5 exponent, 6 mantissa bits: the top 12 bits of
            an IEEE half).  Eight values ``h0..h7`` are packed big-end-first into
            three 32-bit words ``w0 = h0<<20 | h1<<8 | h2>>4``,
            ``w1 = h2<<28 | h3<<16 | h4<<4 | h5>>8``, ``w2 = h5<<24 | h6<<12 | h7``
            (mod 2**32), stored little-endian as ``torch.uint8``: a row of ``H``
            values takes ``H * 3 // 2`` bytes.  ``MAX = 65024``.

Scale factors (the arithmetic every kernel must reproduce bit for bit)
---------------------------------------------------------------------
A group (or block) of elements shares one scale factor ``sf``; the stored
value is the *dequantization* factor (``x ~= q * sf``).  With ``amax`` the
largest ``|x|`` of the group (a max is exact, so reducing in bf16 and widening
to float32, as the kernels do, gives the same number as reducing in float32):

1. ``c = max(amax, clamp_min)`` in float32, ``clamp_min`` = ``float32(1e-4)``
   for e4m3 and e5m6, ``6 * 2**-126`` for e2m1;
2. ``sf = c / MAX`` -- a correctly rounded float32 *division* (not ``c * (1/MAX)``);
3. without ``round_sf``: ``sf_inv = MAX / c`` -- again a correctly rounded
   division of MAX by ``c`` (not ``1 / sf``);
   with ``round_sf``: ``e = ceil(log2(sf))`` computed on the bits,
   ``e = ((bits(sf) - 1) >> 23) + 1 - 127``; then ``sf = 2**e``, ``sf_inv = 2**-e``;
4. ``q = encode(float32(x) * sf_inv)``: one float32 multiplication rounded to
   nearest even, then the format's encoding:

   - e4m3: saturate to ``[-448, 448]``, round to nearest even (subnormals
     included; the sign of a zero result is kept);
   - e2m1: round to nearest even among the FP4 values, saturating at 6; the
     sign bit is the float's sign bit, so a negative value that rounds to zero
     is stored as ``-0`` (nibble ``0x8``);
   - e5m6: ``h = half_rz(v)`` (IEEE half, rounded toward zero, overflow to the
     largest finite half), ``e = h >> 4``, then ``e += 1`` when
     ``(e & 1) + (bits(v) & 0x1FFFF) > 0x10000`` (a round-to-nearest-even on
     the float32 bits, as upstream's kernel does it), ``e &= 0xFFF``.

Partial groups (the last group of a row when the group size does not divide the
width, the last token block when it does not divide the token count) reduce over
their existing elements only.  Inputs containing NaN or Inf are outside the
contract.

Dequantizing (``cast_back``) is ``float32(q) * sf`` rounded once to the output dtype.

Scale-factor layouts
--------------------
For a logical ``[M, K]`` grid of factors (``M`` token blocks, ``K`` channel blocks):

* fp32, row-major: ``float32 [M, K]``, contiguous;
* fp32, TMA-aligned column-major (``use_tma_aligned_col_major_sf``):
  ``float32 [M, K]`` with strides ``(1, align(M, 4))`` -- the token dimension is
  padded to a multiple of 4 (16 bytes) and consecutive tokens are adjacent;
* packed UE8M0 (``use_packed_ue8m0``, requires the column-major form above and
  power-of-two factors): the biased exponent byte ``e + 127`` of each factor,
  four consecutive channel blocks per ``int32`` (block ``4c + j`` in byte ``j``,
  little-endian), i.e. ``int32 [M, ceil(K / 4)]`` with strides ``(1, align(M, 4))``.

The references fill padding (TMA pad rows, unused bytes of the last packed int32)
with zeros; TileKernels' kernels leave them unspecified, so compare only the
logical region (for packed factors: the first ``K`` bytes of each row).
"""

from typing import Optional, Union

import torch
import torch.nn.functional as F

QuantTensor = tuple[torch.Tensor, torch.Tensor]

__all__ = [
    # primitives shared with the fused SwiGLU casts
    "FORMAT_DTYPES",
    "scale_factors_from_amax",
    "quantize_with_scales",
    "layout_scale_factors",
    # TileKernels' public quant API
    "per_token_cast",
    "per_token_cast_with_sf_only",
    "per_token_cast_with_precomputed_sf",
    "per_block_cast",
    "per_block_cast_with_sf_only",
    "per_block_cast_with_precomputed_sf",
    "per_channel_cast",
    "per_channel_cast_fused",
    "per_channel_cast_and_transpose",
    "cast_back",
    "per_token_cast_back",
    "per_block_cast_lossless",
    "unpack_from_e2m1fn_x2",
]

# Storage dtype of each format.
FORMAT_DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e2m1": torch.int8,
    "e5m6": torch.uint8,
}
# Largest finite magnitude of each format.
_MAX_VALUE = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}
# Default lower clamp of the group amax (python floats; applied in float32).
_CLAMP_MIN = {"e4m3": 1e-4, "e2m1": 6.0 * 2.0**-126, "e5m6": 1e-4}

# Value of each FP4 nibble, indexed by the nibble.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_TMA_ALIGN = 4  # 16 bytes of 4-byte factors


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _align(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{op}: {msg}")


def _check_fmt(op: str, fmt: str, allowed: tuple) -> None:
    _check(fmt in allowed, op, f"fmt must be one of {allowed}, got {fmt!r}")


# --------------------------------------------------------------------------
# Primitives
# --------------------------------------------------------------------------


def scale_factors_from_amax(
    amax: torch.Tensor,
    fmt: str,
    round_sf: bool = False,
    clamp_min: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale factor and its inverse from the absolute maximum of each group.

    Args:
        amax: tensor of any shape holding ``max |x|`` per group (any float dtype;
            it is converted to float32, which is exact for bf16/fp16/fp32).
        fmt: ``'e4m3'``, ``'e2m1'`` or ``'e5m6'`` (selects ``MAX`` and the
            default clamp).
        round_sf: round the factor up to a power of two.
        clamp_min: lower bound applied to ``amax`` (default: ``1e-4`` for
            e4m3/e5m6, ``6 * 2**-126`` for e2m1); must be positive.

    Returns:
        ``(sf, sf_inv)``, two float32 tensors of ``amax``'s shape:
        ``c = max(amax, clamp_min)``, ``sf = c / MAX``, and
        ``sf_inv = MAX / c`` (both correctly rounded divisions); with
        ``round_sf``, ``e = ((bits(sf) - 1) >> 23) + 1 - 127`` (= ceil(log2 sf)),
        ``sf = 2**e``, ``sf_inv = 2**-e`` for a finite ``sf``.  A NaN amax (a
        group holding a NaN) gives ``sf = sf_inv = NaN``, an infinite one
        ``sf = inf``, ``sf_inv = 0``, with or without ``round_sf``.  ``x * sf_inv``
        is the value to encode, ``q * sf`` the dequantized one.
    """
    _check_fmt("scale_factors_from_amax", fmt, tuple(_MAX_VALUE))
    if clamp_min is None:
        clamp_min = _CLAMP_MIN[fmt]
    _check(clamp_min > 0, "scale_factors_from_amax", f"clamp_min must be positive, got {clamp_min}")
    amax = amax.to(torch.float32)
    clamped = torch.clamp_min(amax, torch.tensor(clamp_min, dtype=torch.float32, device=amax.device))
    # Tensor / tensor: an elementwise, correctly rounded division on every
    # backend (dividing by a python scalar may turn into a multiplication by
    # its reciprocal).
    max_value = torch.full_like(clamped, _MAX_VALUE[fmt])
    sf = clamped / max_value
    if not round_sf:
        return sf, max_value / clamped
    # ceil(log2(sf)) for a positive float: subtracting one from the bits moves
    # exact powers of two into the previous binade, everything else stays.
    bits = sf.view(torch.int32)
    exponent = ((bits - 1) >> 23) + 1 - 127
    # A group whose amax is NaN or infinite keeps its unrounded factors: sf NaN or Inf (UE8M0
    # byte 0xFF), sf_inv NaN or 0, as without round_sf (the exponent trick holds for finite
    # factors only).
    finite = torch.isfinite(sf)
    rounded = torch.where(finite, exponent + 127, 0) << 23
    rounded_inv = torch.where(finite, 127 - exponent, 0) << 23
    return (torch.where(finite, rounded.view(torch.float32), sf),
            torch.where(finite, rounded_inv.view(torch.float32), max_value / clamped))


def _e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(v, -448.0, 448.0).to(torch.float8_e4m3fn)


def _e2m1_nibbles(v: torch.Tensor) -> torch.Tensor:
    """FP4 nibble (uint8, 0..15) of each float32 value, RNE, saturating."""
    a = v.abs()
    # Magnitude code = number of rounding boundaries below |v|.  At a tie
    # the boundary counts when the upper neighbour has an even code.
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    sign = torch.signbit(v).to(torch.uint8) << 3
    return code | sign


def _pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    rows, cols = nibbles.shape
    pairs = nibbles.reshape(rows, cols // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def _e5m6_codes(v: torch.Tensor) -> torch.Tensor:
    """12-bit E5M6 code (int64) of each float32 value, as upstream's kernel rounds."""
    bits = v.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = (bits >> 16) & 0x8000
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    # IEEE half rounded toward zero.
    normal = ((exp - 112) << 10) | (mant >> 13)
    subnormal = (mant | 0x800000) >> (126 - exp).clamp(0, 63)
    mag = torch.where(exp >= 113, normal, torch.where(exp >= 103, subnormal, torch.zeros_like(bits)))
    mag = torch.where(exp >= 143, torch.full_like(mag, 0x7BFF), mag)  # RZ overflow: largest finite
    is_nan = (exp == 255) & (mant != 0)
    mag = torch.where(exp == 255, torch.where(is_nan, torch.full_like(mag, 0x7FFF), torch.full_like(mag, 0x7C00)), mag)
    code = (sign | mag) >> 4
    round_up = ((code & 1) + (bits & 0x1FFFF)) > 0x10000
    return (code + round_up.to(torch.int64)) & 0xFFF


def _pack_e5m6(codes: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    h = codes.reshape(rows, cols // 8, 8)
    mask = 0xFFFFFFFF
    w0 = ((h[..., 0] << 20) | (h[..., 1] << 8) | (h[..., 2] >> 4)) & mask
    w1 = ((h[..., 2] << 28) | (h[..., 3] << 16) | (h[..., 4] << 4) | (h[..., 5] >> 8)) & mask
    w2 = ((h[..., 5] << 24) | (h[..., 6] << 12) | h[..., 7]) & mask
    words = torch.stack([w0, w1, w2], dim=-1)  # [rows, cols // 8, 3]
    byte_list = [(words >> (8 * i)) & 0xFF for i in range(4)]  # little-endian
    out = torch.stack(byte_list, dim=-1).to(torch.uint8)
    return out.reshape(rows, cols // 8 * 12)


def _encode(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Encode a 2-D float32 tensor of already scaled values into ``fmt``'s storage."""
    if fmt == "e4m3":
        return _e4m3_encode(v)
    if fmt == "e2m1":
        return _pack_nibbles(_e2m1_nibbles(v))
    return _pack_e5m6(_e5m6_codes(v))


def _per_block(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int], fn) -> torch.Tensor:
    """``fn(x[i, j], s[i // bm, j // bk])`` for a 2-D ``x`` and a block grid ``s``."""
    rows, cols = x.shape
    bm, bk = block
    mb, kb = _ceil_div(rows, bm), _ceil_div(cols, bk)
    padded = F.pad(x, (0, kb * bk - cols, 0, mb * bm - rows))
    out = fn(padded.view(mb, bm, kb, bk), s[:mb, :kb].reshape(mb, 1, kb, 1))
    return out.reshape(mb * bm, kb * bk)[:rows, :cols].contiguous()


def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``max |x|`` (float32) over each ``block`` of a 2-D tensor; partial blocks use
    their existing elements (padding with zeros cannot raise a max of ``|x|``)."""
    rows, cols = x.shape
    bm, bk = block
    mb, kb = _ceil_div(rows, bm), _ceil_div(cols, bk)
    padded = F.pad(x.abs().to(torch.float32), (0, kb * bk - cols, 0, mb * bm - rows))
    return padded.view(mb, bm, kb, bk).amax(dim=(1, 3))


def quantize_with_scales(
    x: torch.Tensor,
    sf_inv: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
) -> torch.Tensor:
    """Quantize values with per-block inverse scale factors.

    Args:
        x: ``[rows, cols]`` float tensor (bf16/fp32; converted to float32, exactly).
        sf_inv: ``[ceil(rows / bm), ceil(cols / bk)]`` float32 inverse factors.
        fmt: ``'e4m3'``, ``'e2m1'`` or ``'e5m6'``.
        block_size: ``(bm, bk)`` = (tokens, channels) per factor; ``(1, g)`` for
            per-token groups of ``g`` channels, ``(t, 1)`` for per-channel blocks.

    Returns:
        ``encode(float32(x[i, j]) * sf_inv[i // bm, j // bk])`` (one float32
        multiply, then the encoding described in the module docstring):
        e4m3 ``float8_e4m3fn [rows, cols]``; e2m1 ``int8 [rows, cols // 2]``
        (cols even); e5m6 ``uint8 [rows, cols * 3 // 2]`` (cols % 8 == 0).
    """
    _check_fmt("quantize_with_scales", fmt, tuple(FORMAT_DTYPES))
    _check(x.dim() == 2, "quantize_with_scales", f"x must be 2-D, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    need = (_ceil_div(rows, block_size[0]), _ceil_div(cols, block_size[1]))
    _check(tuple(sf_inv.shape) == need, "quantize_with_scales",
           f"sf_inv must have shape {need} for x {tuple(x.shape)} and block_size {tuple(block_size)}, "
           f"got {tuple(sf_inv.shape)}")
    _check(fmt != "e2m1" or cols % 2 == 0, "quantize_with_scales", f"e2m1 needs an even width, got {cols}")
    _check(fmt != "e5m6" or cols % 8 == 0, "quantize_with_scales", f"e5m6 needs a width divisible by 8, got {cols}")
    scaled = _per_block(x.to(torch.float32), sf_inv.to(torch.float32), block_size, torch.mul)
    return _encode(scaled, fmt)


def layout_scale_factors(
    sf: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """Lay out a ``[M, K]`` float32 grid of scale factors in TileKernels' sf form.

    Args:
        sf: ``float32 [M, K]`` factors (``M`` token blocks, ``K`` channel blocks).
            For ``use_packed_ue8m0`` they must be powers of two (``round_sf``).
        use_tma_aligned_col_major_sf: column-major with the token dim padded.
        use_packed_ue8m0: exponent bytes, four per int32 (requires the above).

    Returns:
        * neither flag: ``float32 [M, K]``, contiguous;
        * column-major: ``float32 [M, K]``, strides ``(1, align(M, 4))``;
        * packed: ``int32 [M, ceil(K / 4)]``, strides ``(1, align(M, 4))``; byte
          ``j`` (little-endian) of element ``[m, c]`` is the biased exponent
          ``bits(sf[m, 4c + j]) >> 23`` (zero past ``K``).
        Padding is zero-filled.
    """
    op = "layout_scale_factors"
    _check(sf.dim() == 2 and sf.dtype == torch.float32, op,
           f"sf must be a 2-D float32 tensor, got {sf.dtype} of shape {tuple(sf.shape)}")
    _check(not use_packed_ue8m0 or use_tma_aligned_col_major_sf, op,
           "use_packed_ue8m0 requires use_tma_aligned_col_major_sf (packed UE8M0 factors are column-major)")
    if not use_tma_aligned_col_major_sf:
        return sf.contiguous()
    rows, groups = sf.shape
    if use_packed_ue8m0:
        exponents = ((sf.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        exponents = F.pad(exponents, (0, _align(groups, 4) - groups))
        sf = exponents.view(torch.int32)  # [M, ceil(K / 4)], little-endian bytes
    cols = sf.shape[1]
    buf = torch.zeros((cols, _align(rows, _TMA_ALIGN)), dtype=sf.dtype, device=sf.device)
    buf[:, :rows] = sf.T
    return buf.T[:rows]


# --------------------------------------------------------------------------
# Decoding helpers
# --------------------------------------------------------------------------


def unpack_from_e2m1fn_x2(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode packed FP4 (E2M1) bytes.

    Args:
        x: ``int8`` or ``uint8`` tensor ``[..., L]`` (at least 1-D); each byte
            holds two FP4 values, the first in the low nibble.
        out_dtype: dtype of the result.

    Returns:
        ``out_dtype [..., 2L]`` with ``out[..., 2j] = fp4(x[..., j] & 0xF)`` and
        ``out[..., 2j + 1] = fp4(x[..., j] >> 4)``; nibble ``s e1 e0 m`` is
        ``(-1)**s * 2**(e - 1) * (1 + m / 2)`` for ``e > 0`` and
        ``(-1)**s * m / 2`` for ``e == 0`` (nibble 8 is ``-0.0``).
    """
    if x.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"unpack_from_e2m1fn_x2: x must be int8 or uint8, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("unpack_from_e2m1fn_x2: x must have at least 1 dimension")
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=x.device)
    b = x.view(torch.uint8).to(torch.int64)
    values = torch.stack([table[b & 0xF], table[b >> 4]], dim=-1)
    return values.reshape(*x.shape[:-1], x.shape[-1] * 2).to(out_dtype)


def _decode_e5m6(x: torch.Tensor) -> torch.Tensor:
    """``uint8 [rows, H * 3 // 2]`` packed E5M6 -> ``float32 [rows, H]`` (exact)."""
    rows, nbytes = x.shape
    b = x.contiguous().view(rows, nbytes // 12, 3, 4).to(torch.int64)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    w0, w1, w2 = words[..., 0], words[..., 1], words[..., 2]
    fields = [
        w0 >> 20, w0 >> 8, (w0 << 4) | (w1 >> 28), w1 >> 16,
        w1 >> 4, (w1 << 8) | (w2 >> 24), w2 >> 12, w2,
    ]
    codes = torch.stack([f & 0xFFF for f in fields], dim=-1).reshape(rows, nbytes // 12 * 8)
    half_bits = (codes << 4).to(torch.int32)
    half_bits = torch.where(half_bits >= 0x8000, half_bits - 0x10000, half_bits).to(torch.int16)
    return half_bits.view(torch.float16).to(torch.float32)


def _decode_values(data: torch.Tensor) -> torch.Tensor:
    """Quantized storage (e4m3 or packed e2m1) -> float32 values, exactly."""
    if data.dtype == torch.float8_e4m3fn:
        return data.to(torch.float32)
    return unpack_from_e2m1fn_x2(data, torch.float32)


def _decode_sf(x_sf: torch.Tensor, grid: tuple[int, int], op: str) -> torch.Tensor:
    """Scale factors in any of TileKernels' forms -> logical ``float32 [M, K]``.

    float32 factors are used as they are; ``int32`` factors are packed UE8M0
    (byte ``j`` of column ``c`` is block ``4c + j``; exponent byte ``b`` means
    ``2**(b - 127)``, ``b = 0`` gives 0.0).  Strides do not matter here.
    """
    rows, groups = grid
    _check(x_sf.dim() == 2, op, f"scale factors must be 2-D, got shape {tuple(x_sf.shape)}")
    if x_sf.dtype == torch.float32:
        _check(tuple(x_sf.shape) == grid, op, f"float32 scale factors must have shape {grid}, got {tuple(x_sf.shape)}")
        return x_sf
    _check(x_sf.dtype == torch.int32, op, f"scale factors must be float32 or int32 (packed UE8M0), got {x_sf.dtype}")
    want = (rows, _ceil_div(groups, 4))
    _check(tuple(x_sf.shape) == want, op, f"packed UE8M0 scale factors must have shape {want}, got {tuple(x_sf.shape)}")
    words = x_sf.to(torch.int64) & 0xFFFFFFFF
    exponents = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1)
    exponents = exponents.reshape(rows, 4 * want[1])[:, :groups].to(torch.int32)  # (rows may be 0)
    return (exponents << 23).view(torch.float32)


def _dequantize(x: QuantTensor, block: tuple[int, int], op: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, s, v)``: decoded values, per-element factors, ``v = q * s`` (float32)."""
    data, x_sf = x
    q = _decode_values(data)
    rows, cols = q.shape
    grid = (_ceil_div(rows, block[0]), _ceil_div(cols, block[1]))
    sf = _decode_sf(x_sf, grid, op)
    s = _per_block(torch.ones_like(q), sf, block, torch.mul)
    return q, s, q * s


def _check_quant_input(x: QuantTensor, op: str) -> None:
    _check(isinstance(x, tuple) and len(x) == 2, op, "a pre-quantized x must be a tuple (data, sf)")
    data = x[0]
    _check(data.dim() == 2, op, f"x data must be 2-D, got shape {tuple(data.shape)}")
    _check(data.dtype in (torch.float8_e4m3fn, torch.int8), op,
           f"x data must be float8_e4m3fn or int8 (packed e2m1), got {data.dtype}")


def _check_sf_flags(op: str, use_tma_aligned_col_major_sf: bool, round_sf: bool, use_packed_ue8m0: bool) -> None:
    if use_packed_ue8m0:
        _check(use_tma_aligned_col_major_sf, op,
               "use_packed_ue8m0 requires use_tma_aligned_col_major_sf=True (packed UE8M0 factors are column-major)")
        _check(round_sf, op, "use_packed_ue8m0 requires round_sf=True (UE8M0 holds powers of two only)")


# --------------------------------------------------------------------------
# Per-token casts
# --------------------------------------------------------------------------


def _per_token_impl(
    op: str,
    x: Union[torch.Tensor, QuantTensor],
    fmt: str,
    num_per_channels: int,
    x_block_size: Optional[tuple[int, int]],
    use_tma_aligned_col_major_sf: bool,
    round_sf: bool,
    use_packed_ue8m0: bool,
    sf_only: bool = False,
    sf: Optional[torch.Tensor] = None,
):
    cast_only = sf is not None
    with_sf = isinstance(x, tuple)
    _check_fmt(op, fmt, ("e5m6", "e4m3", "e2m1") if not (sf_only or cast_only) else ("e4m3", "e2m1"))
    if with_sf:
        _check_quant_input(x, op)
        _check(x_block_size is not None, op, "x_block_size is required when x is a (data, sf) tuple")
        _check(fmt != "e5m6", op, "e5m6 takes a plain bf16/fp32 x")
        _check(not sf_only and not cast_only, op, "a pre-quantized x is supported by per_token_cast only")
        rows, hidden = x[0].shape[0], x[0].shape[1] * (2 if x[0].dtype == torch.int8 else 1)
    else:
        _check(isinstance(x, torch.Tensor) and x.dim() == 2, op, "x must be a 2-D tensor")
        _check(x.dtype in (torch.bfloat16, torch.float32), op, f"x must be bfloat16 or float32, got {x.dtype}")
        _check(x_block_size is None, op, "x_block_size is only meaningful for a (data, sf) tuple x")
        rows, hidden = x.shape

    if fmt == "e5m6":
        _check(num_per_channels == hidden, op, f"e5m6 needs num_per_channels == hidden ({hidden}), got {num_per_channels}")
        _check(hidden % 8 == 0, op, f"e5m6 needs hidden % 8 == 0, got {hidden}")
    else:
        _check(num_per_channels in (16, 32, 64, 128) or (num_per_channels == hidden and hidden % 64 == 0), op,
               f"num_per_channels must be 16, 32, 64, 128, or hidden (a multiple of 64); "
               f"got {num_per_channels} for hidden {hidden}")
    _check(not (num_per_channels == hidden and (with_sf or sf_only or cast_only)), op,
           "one group per row (num_per_channels == hidden) is supported by per_token_cast on a plain x only")
    _check(fmt != "e2m1" or hidden % 2 == 0, op, f"e2m1 needs an even hidden, got {hidden}")

    block = (1, num_per_channels)
    if cast_only:
        _check(not use_tma_aligned_col_major_sf and not use_packed_ue8m0, op,
               "precomputed sf must be row-major float32 (use_tma_aligned_col_major_sf and "
               "use_packed_ue8m0 must be False)")
        grid = (rows, _ceil_div(hidden, num_per_channels))
        _check(sf.dtype == torch.float32 and tuple(sf.shape) == grid, op,
               f"sf must be float32 of shape {grid}, got {sf.dtype} of shape {tuple(sf.shape)}")
        sf_inv = torch.full_like(sf, 1.0) / sf
        return quantize_with_scales(x, sf_inv, fmt, block)

    _check_sf_flags(op, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    if with_sf:
        q, s_in, values = _dequantize(x, tuple(x_block_size), op)
    else:
        values = x
    out_sf, sf_inv = scale_factors_from_amax(_block_amax(values, block), fmt, round_sf)
    out_sf = layout_scale_factors(out_sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)
    if sf_only:
        return out_sf
    if with_sf:
        # Upstream's kernel folds both factors first: q * (s_in * sf_inv).
        factor = _per_block(s_in, sf_inv, block, torch.mul)
        out = _encode(q * factor, fmt)
    else:
        out = quantize_with_scales(x, sf_inv, fmt, block)
    return out, out_sf


def per_token_cast(
    x: Union[torch.Tensor, QuantTensor],
    fmt: str,
    num_per_channels: int,
    x_block_size: Optional[tuple[int, int]] = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> QuantTensor:
    """Quantize each row in groups of ``num_per_channels`` channels.

    Args:
        x: ``[T, H]`` bfloat16/float32 (rows may be strided), or a pre-quantized
            pair ``(data, x_sf)``: ``data`` float8_e4m3fn ``[T, H]`` or int8
            ``[T, H // 2]`` (packed e2m1), ``x_sf`` its factors over
            ``x_block_size`` blocks in any sf form (float32 ``[ceil(T/bm),
            ceil(H/bk)]`` or packed int32 ``[ceil(T/bm), ceil(ceil(H/bk)/4)]``).
        fmt: ``'e4m3'``, ``'e2m1'`` or ``'e5m6'`` (e5m6: plain x,
            ``num_per_channels == H``, ``H % 8 == 0``).
        num_per_channels: group size, 16/32/64/128, or ``H`` (one group per row,
            ``H % 64 == 0``, plain x only).  ``H`` need not be a multiple: the last
            group of a row is then partial.
        x_block_size: ``(bm, bk)`` of ``x_sf`` for a pre-quantized x.
        use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: sf form (see
            the module docstring; packed needs the other two).

    Returns:
        ``(out, out_sf)``: ``out`` e4m3 ``float8_e4m3fn [T, H]``, e2m1
        ``int8 [T, H // 2]`` or e5m6 ``uint8 [T, H * 3 // 2]``; ``out_sf`` the
        ``[T, ceil(H / num_per_channels)]`` factor grid in the requested form.

    Math: ``amax`` per group of the input values (for a pre-quantized x, of
    ``v = float32(q) * s_in``, i.e. ``max |v|``), factors as in
    :func:`scale_factors_from_amax`.  A plain x is encoded as
    ``encode(float32(x) * sf_inv)``; a pre-quantized x as
    ``encode(float32(q) * (s_in * sf_inv))`` -- the two factors are multiplied
    first, as upstream's kernel does (upstream's torch reference computes
    ``(q * s_in) * sf_inv``; the two agree whenever the factors are powers of two).
    """
    return _per_token_impl("per_token_cast", x, fmt, num_per_channels, x_block_size,
                           use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)


def per_token_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size: Optional[tuple[int, int]] = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """The ``out_sf`` of :func:`per_token_cast` alone.

    Supported for a plain bf16/fp32 ``x`` ``[T, H]``, ``fmt`` e4m3/e2m1 and
    ``num_per_channels`` in 16/32/64/128 (not one group per row).  Returns the
    ``[T, ceil(H / num_per_channels)]`` factor grid in the requested sf form,
    identical to ``per_token_cast(...)[1]``.
    """
    return _per_token_impl("per_token_cast_with_sf_only", x, fmt, num_per_channels, x_block_size,
                           use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, sf_only=True)


def per_token_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    sf: torch.Tensor,
    x_block_size: Optional[tuple[int, int]] = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """Quantize per token with given factors.

    Args:
        x: plain bf16/fp32 ``[T, H]``.
        fmt: ``'e4m3'`` or ``'e2m1'``.
        num_per_channels: 16/32/64/128.
        sf: row-major ``float32 [T, ceil(H / num_per_channels)]`` dequantization
            factors (e.g. the ``out_sf`` of an earlier ``per_token_cast``).
        use_tma_aligned_col_major_sf, use_packed_ue8m0: must be False.
        round_sf: ignored (the factors are given).

    Returns:
        ``out`` only: ``encode(float32(x) * (1 / sf))`` with ``1 / sf`` a
        correctly rounded float32 reciprocal; dtype/shape as in per_token_cast.
    """
    return _per_token_impl("per_token_cast_with_precomputed_sf", x, fmt, num_per_channels, x_block_size,
                           use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, sf=sf)


# --------------------------------------------------------------------------
# Per-block casts
# --------------------------------------------------------------------------


def _per_block_impl(
    op: str,
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool,
    round_sf: bool,
    use_packed_ue8m0: bool,
    sf_only: bool = False,
    sf: Optional[torch.Tensor] = None,
):
    _check_fmt(op, fmt, ("e4m3", "e2m1"))
    _check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.is_contiguous(), op, "x must be a contiguous 2-D tensor")
    _check(x.dtype in (torch.bfloat16, torch.float32), op, f"x must be bfloat16 or float32, got {x.dtype}")
    rows, hidden = x.shape
    _check(hidden % 64 == 0, op, f"hidden must be a multiple of 64, got {hidden}")
    bm, bk = block_size
    _check(bm in (32, 128) and bk in (32, 128), op, f"block_size must be in {{32, 128}} x {{32, 128}}, got {tuple(block_size)}")
    block = (bm, bk)
    if sf is not None:
        _check(not use_tma_aligned_col_major_sf and not use_packed_ue8m0, op,
               "precomputed sf must be row-major float32 (use_tma_aligned_col_major_sf and "
               "use_packed_ue8m0 must be False)")
        grid = (_ceil_div(rows, bm), _ceil_div(hidden, bk))
        _check(sf.dtype == torch.float32 and tuple(sf.shape) == grid, op,
               f"sf must be float32 of shape {grid}, got {sf.dtype} of shape {tuple(sf.shape)}")
        return quantize_with_scales(x, torch.full_like(sf, 1.0) / sf, fmt, block)
    _check_sf_flags(op, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    out_sf, sf_inv = scale_factors_from_amax(_block_amax(x, block), fmt, round_sf)
    out_sf = layout_scale_factors(out_sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)
    if sf_only:
        return out_sf
    return quantize_with_scales(x, sf_inv, fmt, block), out_sf


def per_block_cast(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> QuantTensor:
    """Quantize with one factor per ``block_size = (bm, bk)`` tile.

    Args:
        x: contiguous bf16/fp32 ``[T, H]``, ``H % 64 == 0``.
        fmt: ``'e4m3'`` or ``'e2m1'``.
        block_size: ``(bm, bk)``, each 32 or 128 (the last tiles may be partial).
        use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: sf form.

    Returns:
        ``(out, out_sf)``: ``out`` e4m3 ``[T, H]`` or e2m1 ``int8 [T, H // 2]``;
        ``out_sf`` the ``[ceil(T / bm), ceil(H / bk)]`` grid in the requested
        form.  ``amax`` per tile, factors as in :func:`scale_factors_from_amax`,
        ``out = encode(float32(x) * sf_inv)``.
    """
    return _per_block_impl("per_block_cast", x, fmt, block_size,
                           use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)


def per_block_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """The ``out_sf`` of :func:`per_block_cast` alone (same arguments)."""
    return _per_block_impl("per_block_cast_with_sf_only", x, fmt, block_size,
                           use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, sf_only=True)


def per_block_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    block_size: tuple[int, int],
    sf: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """Quantize per block with given factors.

    ``sf`` is row-major ``float32 [ceil(T / bm), ceil(H / bk)]``; the sf-form
    flags must be False and ``round_sf`` is ignored.  Returns ``out`` only:
    ``encode(float32(x) * (1 / sf))`` (correctly rounded reciprocal).
    """
    return _per_block_impl("per_block_cast_with_precomputed_sf", x, fmt, block_size,
                           use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, sf=sf)


# --------------------------------------------------------------------------
# Per-channel casts
# --------------------------------------------------------------------------


def per_channel_cast_fused(
    x: Union[torch.Tensor, QuantTensor],
    fmt: str,
    num_per_tokens: int,
    round_sf: bool = False,
    num_per_channels: Optional[int] = None,
    pos_to_token: Optional[torch.Tensor] = None,
) -> QuantTensor:
    """FP8 cast with one factor per channel per ``num_per_tokens`` rows, with an
    optional row gather and an optional re-quantization of an FP8 input.

    Args:
        x: contiguous bf16/fp32 ``[T, H]``, or a pair ``(data, x_sf)`` with
            ``data`` float8_e4m3fn ``[T, H]`` and ``x_sf`` contiguous float32
            ``[T, H // 128]`` (per-token factors over 128 channels).
        fmt: ``'e4m3'``.
        num_per_tokens: 128.
        round_sf: power-of-two factors.
        num_per_channels: 128 for a pre-quantized x, None otherwise.
        pos_to_token: optional contiguous int32 ``[T_out]`` (``T_out % 16 == 0``):
            output row ``p`` is input row ``pos_to_token[p]``, or zeros when it is
            negative.  Without it ``T_out = T`` and ``T % 128 == 0``.

    Returns:
        ``(out, out_sf)``: ``float8_e4m3fn [T_out, H]`` and contiguous
        ``float32 [ceil(T_out / 128), H]``.  With ``v`` the gathered rows
        (``v = float32(q) * s_in`` for a pre-quantized x, a gathered-away row
        being +0), ``amax`` per (128-row block, channel) over the existing rows,
        factors as in :func:`scale_factors_from_amax` (e4m3), and
        ``out = encode(v * sf_inv)`` (for a pre-quantized x: ``(q * s_in) * sf_inv``,
        two roundings, as upstream's kernel and reference both do).
    """
    op = "per_channel_cast_fused"
    _check_fmt(op, fmt, ("e4m3",))
    _check(num_per_tokens == 128, op, f"num_per_tokens must be 128, got {num_per_tokens}")
    with_sf = isinstance(x, tuple)
    if with_sf:
        _check_quant_input(x, op)
        data, x_sf = x
        _check(data.dtype == torch.float8_e4m3fn, op, f"pre-quantized data must be float8_e4m3fn, got {data.dtype}")
        _check(num_per_channels == 128, op, f"num_per_channels must be 128 for a pre-quantized x, got {num_per_channels}")
        rows, hidden = data.shape
        _check(x_sf.dtype == torch.float32 and x_sf.dim() == 2 and x_sf.is_contiguous()
               and x_sf.shape[0] == rows and x_sf.shape[1] * 128 == hidden, op,
               f"x_sf must be contiguous float32 [{rows}, {hidden} / 128], got {x_sf.dtype} {tuple(x_sf.shape)}")
        _check(data.is_contiguous(), op, "x data must be contiguous")
    else:
        _check(num_per_channels is None, op, "num_per_channels must be None for a plain x")
        _check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.is_contiguous(), op, "x must be a contiguous 2-D tensor")
        _check(x.dtype in (torch.bfloat16, torch.float32), op, f"x must be bfloat16 or float32, got {x.dtype}")
        rows, hidden = x.shape

    if with_sf:
        values = data.to(torch.float32) * x_sf.repeat_interleave(128, dim=1)
    else:
        values = x.to(torch.float32)
    if pos_to_token is not None:
        _check(pos_to_token.dim() == 1 and pos_to_token.is_contiguous() and pos_to_token.dtype == torch.int32, op,
               f"pos_to_token must be a contiguous 1-D int32 tensor, got {pos_to_token.dtype} {tuple(pos_to_token.shape)}")
        _check(pos_to_token.shape[0] % 16 == 0, op, f"len(pos_to_token) must be a multiple of 16, got {pos_to_token.shape[0]}")
        valid = (pos_to_token >= 0).unsqueeze(1)
        gathered = values[pos_to_token.clamp(min=0).long()]
        values = torch.where(valid, gathered, torch.zeros_like(gathered))
    else:
        _check(rows % 128 == 0, op, f"the token count must be a multiple of 128, got {rows}")

    block = (num_per_tokens, 1)
    out_sf, sf_inv = scale_factors_from_amax(_block_amax(values, block), fmt, round_sf)
    return quantize_with_scales(values, sf_inv, fmt, block), out_sf


def per_channel_cast(x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False) -> QuantTensor:
    """FP8 cast with one factor per channel per 128 rows.

    Args:
        x: contiguous bf16/fp32 ``[T, H]``, ``T % 128 == 0``, ``H % 64 == 0``.
        fmt: ``'e4m3'``.
        num_per_tokens: 128.
        round_sf: power-of-two factors.

    Returns:
        ``(out, out_sf)``: ``float8_e4m3fn [T, H]`` and contiguous
        ``float32 [T / 128, H]``; ``amax`` per (128-row block, channel), factors
        as in :func:`scale_factors_from_amax`, ``out = encode(float32(x) * sf_inv)``.
    """
    op = "per_channel_cast"
    _check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.is_contiguous(), op, "x must be a contiguous 2-D tensor")
    _check_fmt(op, fmt, ("e4m3",))
    rows, hidden = x.shape
    _check(rows % 128 == 0 and hidden % 64 == 0, op, f"x must be [T, H] with T % 128 == 0 and H % 64 == 0, got {tuple(x.shape)}")
    _check(num_per_tokens == 128, op, f"num_per_tokens must be 128, got {num_per_tokens}")
    return per_channel_cast_fused(x, "e4m3", num_per_tokens=num_per_tokens, round_sf=round_sf)


def per_channel_cast_and_transpose(x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False) -> QuantTensor:
    """FP8 cast with one factor per channel per ``num_per_tokens`` rows, output
    transposed.

    Args:
        x: contiguous bfloat16 ``[T, H]``, ``T % 128 == 0``, ``H % 64 == 0``.
        fmt: ``'e4m3'``.
        num_per_tokens: 32 or 128.
        round_sf: power-of-two factors.

    Returns:
        ``(out, out_sf)``: ``out`` contiguous ``float8_e4m3fn [H, T]`` with
        ``out[h, t] = encode(float32(x[t, h]) * sf_inv[t // num_per_tokens, h])``
        and contiguous ``float32 [T / num_per_tokens, H]`` factors (``amax`` per
        (row block, channel), as in :func:`scale_factors_from_amax`).
    """
    op = "per_channel_cast_and_transpose"
    _check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.is_contiguous(), op, "x must be a contiguous 2-D tensor")
    _check(x.dtype == torch.bfloat16, op, f"x must be bfloat16, got {x.dtype}")
    _check_fmt(op, fmt, ("e4m3",))
    rows, hidden = x.shape
    _check(rows % 128 == 0 and hidden % 64 == 0, op, f"x must be [T, H] with T % 128 == 0 and H % 64 == 0, got {tuple(x.shape)}")
    _check(num_per_tokens in (32, 128), op, f"num_per_tokens must be 32 or 128, got {num_per_tokens}")
    block = (num_per_tokens, 1)
    out_sf, sf_inv = scale_factors_from_amax(_block_amax(x, block), fmt, round_sf)
    out = quantize_with_scales(x, sf_inv, fmt, block)
    return out.T.contiguous(), out_sf


# --------------------------------------------------------------------------
# Dequantization
# --------------------------------------------------------------------------


def cast_back(
    x: QuantTensor,
    fmt: str,
    x_block_size: tuple[int, int],
    x_special_fmt: Optional[str] = None,
) -> torch.Tensor:
    """Dequantize ``(data, sf)`` to bf16 or fp32.

    Args:
        x: ``(data, sf)``: ``data`` float8_e4m3fn ``[T, H]``, int8 ``[T, H // 2]``
            (packed e2m1) or, with ``x_special_fmt='e5m6'``, uint8
            ``[T, H * 3 // 2]``; ``sf`` the factors over ``x_block_size`` blocks
            in any sf form (float32 ``[ceil(T/bm), ceil(H/bk)]`` or packed int32
            ``[ceil(T/bm), ceil(ceil(H/bk)/4)]``; strides are irrelevant here).
        fmt: ``'bf16'`` or ``'fp32'``.
        x_block_size: ``(bm, bk)``.
        x_special_fmt: None or ``'e5m6'``.

    Returns:
        ``[T, H]`` of the requested dtype:
        ``(float32(q[i, j]) * sf[i // bm, j // bk])`` rounded once (RNE) to it.
        ``H % 64 == 0`` for e4m3/e2m1, ``H % 8 == 0`` for e5m6.
    """
    op = "cast_back"
    _check(fmt in ("bf16", "fp32"), op, f"fmt must be 'bf16' or 'fp32', got {fmt!r}")
    _check(x_special_fmt in (None, "e5m6"), op, f"x_special_fmt must be None or 'e5m6', got {x_special_fmt!r}")
    out_dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    _check(isinstance(x, tuple) and len(x) == 2, op, "x must be a tuple (data, sf)")
    data, x_sf = x
    _check(data.dim() == 2, op, f"data must be 2-D, got shape {tuple(data.shape)}")
    if x_special_fmt == "e5m6":
        _check(data.dtype == torch.uint8, op, f"e5m6 data must be uint8, got {data.dtype}")
        _check(data.shape[1] % 12 == 0, op, f"e5m6 data width must be a multiple of 12 bytes, got {data.shape[1]}")
        q = _decode_e5m6(data)
    else:
        _check(data.dtype in (torch.float8_e4m3fn, torch.int8), op,
               f"data must be float8_e4m3fn or int8 (packed e2m1), got {data.dtype}")
        q = _decode_values(data)
        _check(q.shape[1] % 64 == 0, op, f"hidden must be a multiple of 64, got {q.shape[1]}")
    rows, cols = q.shape
    block = tuple(x_block_size)
    sf = _decode_sf(x_sf, (_ceil_div(rows, block[0]), _ceil_div(cols, block[1])), op)
    return _per_block(q, sf, block, torch.mul).to(out_dtype)


def per_token_cast_back(
    x: QuantTensor,
    fmt: str,
    num_per_channels: int,
    x_special_fmt: Optional[str] = None,
) -> torch.Tensor:
    """``cast_back(x, fmt, (1, num_per_channels), x_special_fmt)``."""
    return cast_back(x, fmt, (1, num_per_channels), x_special_fmt=x_special_fmt)


# --------------------------------------------------------------------------
# Lossless FP4 -> FP8 re-blocking
# --------------------------------------------------------------------------


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def per_block_cast_lossless(
    x: QuantTensor,
    fmt: str,
    x_block_size: tuple[int, int],
    out_block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> QuantTensor:
    """Re-express an FP4 (e2m1) tensor with power-of-two factors as FP8 (e4m3)
    over larger blocks, without rounding.

    Args:
        x: ``(data, x_sf)``: contiguous int8 ``[T, H // 2]`` packed e2m1
            (``H % 32 == 0``) and power-of-two factors over ``x_block_size``
            (float32 or packed UE8M0, any sf form).
        fmt: ``'e4m3'``.
        x_block_size: ``(bm_in, bk_in)``; ``bk_in`` a power of two.
        out_block_size: ``(bm_out, bk_out)``, multiples of the input block;
            ``bk_out`` a power of two.
        use_tma_aligned_col_major_sf, use_packed_ue8m0: form of ``out_sf``
            (packed needs column-major).  round_sf: ignored (always powers of two).

    Returns:
        ``(out, out_sf)``: ``float8_e4m3fn [T, H]`` and the
        ``[ceil(T / bm_out), ceil(H / bk_out)]`` factor grid.  With ``b_in`` the
        biased exponent of each input factor (``bits >> 23`` of a float32 one,
        the byte of a packed one) and ``B = max(b_in over the input blocks of an
        output block that exist) - 6`` (clamped at 0), ``out_sf = 2**(B - 127)``
        (byte ``B`` when packed) and ``out = fp4 * 2**(b_in - B)``, exact.
        Raises ValueError when some ``b_in < B - 5`` (the value could not be
        represented exactly; upstream's kernel traps on a device assert there).
    """
    op = "per_block_cast_lossless"
    _check_quant_input(x, op)
    data, x_sf = x
    _check(fmt == "e4m3" and data.dtype == torch.int8, op, "only e2m1 (int8) -> e4m3 is supported")
    _check(data.is_contiguous(), op, "x data must be contiguous")
    rows, hidden = data.shape[0], data.shape[1] * 2
    _check(hidden % 32 == 0, op, f"hidden must be a multiple of 32, got {hidden}")
    (bm_in, bk_in), (bm_out, bk_out) = tuple(x_block_size), tuple(out_block_size)
    _check(_is_power_of_two(bk_in) and _is_power_of_two(bk_out), op, "block widths must be powers of two")
    _check(bm_out % bm_in == 0 and bk_out % bk_in == 0, op,
           f"out_block_size {tuple(out_block_size)} must be a multiple of x_block_size {tuple(x_block_size)}")
    _check(not use_packed_ue8m0 or use_tma_aligned_col_major_sf, op,
           "use_packed_ue8m0 requires use_tma_aligned_col_major_sf=True (packed UE8M0 factors are column-major)")

    in_grid = (_ceil_div(rows, bm_in), _ceil_div(hidden, bk_in))
    sf_in = _decode_sf(x_sf, in_grid, op)
    b_in = (sf_in.view(torch.int32) >> 23) & 0xFF  # biased exponents [M_in, K_in]
    rm, rk = bm_out // bm_in, bk_out // bk_in
    out_grid = (_ceil_div(rows, bm_out), _ceil_div(hidden, bk_out))
    padded = F.pad(b_in, (0, out_grid[1] * rk - in_grid[1], 0, out_grid[0] * rm - in_grid[0]))
    b_out = padded.view(out_grid[0], rm, out_grid[1], rk).amax(dim=(1, 3))
    b_out = torch.clamp_min(b_out - 6, 0)
    b_out_per_in = b_out.repeat_interleave(rm, 0).repeat_interleave(rk, 1)[: in_grid[0], : in_grid[1]]
    _check(bool((b_in + 5 >= b_out_per_in).all()), op,
           "input factors within one output block span more than 2**11; the cast would not be lossless")
    shift = ((b_in - b_out_per_in + 127) << 23).view(torch.float32)  # 2**(b_in - B)
    out = _per_block(_decode_values(data), shift, (bm_in, bk_in), torch.mul)
    out_sf = (b_out << 23).view(torch.float32)
    return _e4m3_encode(out), layout_scale_factors(out_sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)
