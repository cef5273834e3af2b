"""Defining properties of the quant references (no TileKernels needed).

The formats and the scale-factor arithmetic are checked against brute-force
definitions (nearest representable value, ties to even, by searching the
whole value table; divisions done in float64 and rounded once, which is exact
for float32 operands), and the operators against slow loops over groups.
tests/oracle/test_quant.py compares the same functions with TileKernels 1.0.0.
"""

import math
import struct

import pytest
import torch

from tile_kernels_aot.torch import quant as ref

MAX = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}
CLAMP = {"e4m3": 1e-4, "e2m1": 6.0 * 2.0**-126, "e5m6": 1e-4}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _f32(v: float) -> float:
    """Round a python float (double) to the nearest float32."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _align(a, b):
    return -(-a // b) * b


# ----------------------------------------------------------------------------
# Value tables and brute-force encoders
# ----------------------------------------------------------------------------


def _e4m3_table():
    """Values of all finite non-negative e4m3 codes 0..126 (code 127 is NaN)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _nearest_code(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the table entry nearest to |values| (ties to the even index),
    saturating at the last entry."""
    a = values.abs().to(torch.float64).clamp(max=table[-1].item()).unsqueeze(-1)
    dist = (a - table).abs()
    best = dist.min(dim=-1, keepdim=True).values
    candidates = dist == best
    idx = torch.arange(table.numel())
    # among equally near entries (at most two) prefer the even index
    score = torch.where(candidates, (idx % 2) * 1000 + idx, torch.full_like(idx, 10**9))
    return score.argmin(dim=-1)


def _interesting_values(seed, table):
    """Random magnitudes over the format's range, the exact table values, the
    midpoints between neighbours (ties) and values just beside them, and
    values beyond the largest one; both signs."""
    g = _gen(seed)
    top = table[-1].item()
    rand = torch.rand(4000, generator=g, dtype=torch.float64) * top * 1.2
    small = torch.rand(1000, generator=g, dtype=torch.float64) * table[2].item()
    mids = (table[1:] + table[:-1]) / 2
    near = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    vals = torch.cat([rand, small, table, mids, near, torch.tensor([top * 1.01, top * 4, 1e30])])
    vals = torch.cat([vals, -vals]).to(torch.float32)
    return vals


def _encode_codes(values, fmt):
    """Stored codes of ``quantize_with_scales(values, 1)`` as sign/magnitude ints."""
    x = values.reshape(1, -1)
    out = ref.quantize_with_scales(x, torch.ones((1, 1)), fmt, (1, x.shape[1]))
    if fmt == "e4m3":
        b = out.view(torch.uint8).to(torch.int64).flatten()
        return b >> 7, b & 0x7F
    b = out.view(torch.uint8).to(torch.int64).flatten()
    nib = torch.stack([b & 0xF, b >> 4], dim=-1).flatten()
    return nib >> 3, nib & 0x7


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_encoding_is_round_to_nearest_even_saturating(fmt):
    table = _e4m3_table() if fmt == "e4m3" else E2M1_MAGNITUDES
    vals = _interesting_values(1, table)
    sign, mag = _encode_codes(vals, fmt)
    assert torch.equal(mag, _nearest_code(vals, table))
    assert torch.equal(sign, torch.signbit(vals).to(torch.int64))


def test_e2m1_keeps_sign_of_zero():
    vals = torch.tensor([0.0, -0.0, 0.1, -0.1, -0.25, 0.25, -1e-30, 1e-30])
    sign, mag = _encode_codes(vals, "e2m1")
    assert mag.tolist() == [0] * 8
    assert sign.tolist() == [0, 1, 0, 1, 1, 0, 1, 0]


def test_unpack_from_e2m1fn_x2_every_byte():
    def nibble_value(n):
        s, e, m = n >> 3, (n >> 1) & 3, n & 1
        mag = m / 2 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
        return -mag if s else mag

    for dtype in (torch.int8, torch.uint8):
        x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        out = ref.unpack_from_e2m1fn_x2(x)
        assert out.dtype == torch.float32 and out.shape == (512,)
        for byte in range(256):
            assert out[2 * byte].item() == nibble_value(byte & 0xF)
            assert out[2 * byte + 1].item() == nibble_value(byte >> 4)
        assert torch.signbit(out[16]).item()  # nibble 8 is -0.0
    x = torch.randint(-128, 128, (3, 4, 5), generator=_gen(2), dtype=torch.int8)
    out = ref.unpack_from_e2m1fn_x2(x, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 4, 10)
    with pytest.raises(ValueError):
        ref.unpack_from_e2m1fn_x2(torch.tensor(3, dtype=torch.int8))
    with pytest.raises(TypeError):
        ref.unpack_from_e2m1fn_x2(torch.zeros(4, dtype=torch.int16))


# ----------------------------------------------------------------------------
# e5m6
# ----------------------------------------------------------------------------


def test_e5m6_bit_layout():
    codes = torch.tensor([[0x123, 0x456, 0x789, 0xABC, 0xDEF, 0x012, 0x345, 0x678]])
    packed = ref._pack_e5m6(codes)
    words = [0x12345678, 0x9ABCDEF0, 0x12345678]
    expected = [b for w in words for b in w.to_bytes(4, "little")]
    assert packed.dtype == torch.uint8 and packed.tolist() == [expected]


def _e5m6_roundtrip(v):
    n = v.numel()
    x = torch.cat([v.flatten(), torch.ones((-n) % 8)]).reshape(1, -1)  # whole 8-value words
    out = ref.quantize_with_scales(x, torch.ones((1, 1)), "e5m6", (1, x.shape[1]))
    assert out.dtype == torch.uint8 and out.shape == (1, x.shape[1] * 3 // 2)
    back = ref.cast_back((out, torch.ones((1, 1))), "fp32", (1, x.shape[1]), x_special_fmt="e5m6")
    return back.flatten()[:n]


def test_e5m6_rounds_to_nearest_even_in_the_normal_range():
    g = _gen(3)
    exps = torch.randint(-14, 16, (4096,), generator=g).to(torch.float64)
    mant = 1 + torch.rand(4096, generator=g, dtype=torch.float64)
    v = (mant * 2.0**exps).to(torch.float32)
    # ties: half-way between two e5m6 neighbours
    ulp = 2.0 ** (torch.floor(torch.log2(v.double())) - 6)
    ties = ((torch.floor(v.double() / ulp) + 0.5) * ulp).to(torch.float32)
    v = torch.cat([v, ties, -v, -ties])
    v = v[v.abs() <= 65024.0]
    back = _e5m6_roundtrip(v)
    vd = v.double()
    ulp = 2.0 ** (torch.floor(torch.log2(vd.abs())) - 6)
    expected = torch.round(vd / ulp) * ulp  # torch.round is half-to-even
    assert torch.equal(back.double(), expected)


def test_e5m6_representable_values_survive():
    k = torch.arange(-4095, 4096, dtype=torch.float64)
    subnormal = k[k.abs() < 64] * 2.0**-20
    normal = torch.tensor([(1 + m / 64) * 2.0**e for e in range(-14, 16) for m in range(64)], dtype=torch.float64)
    normal = normal[normal <= 65024.0]
    v = torch.cat([subnormal, normal, -normal]).to(torch.float32)
    assert torch.equal(_e5m6_roundtrip(v), v)


# ----------------------------------------------------------------------------
# Scale factors
# ----------------------------------------------------------------------------


def _amax_samples(seed):
    g = _gen(seed)
    exps = torch.randint(-140, 60, (3000,), generator=g).to(torch.float64)
    v = (torch.rand(3000, generator=g, dtype=torch.float64) + 0.5) * 2.0**exps
    exact = torch.tensor([448.0 * 2.0**k for k in range(-20, 20)] + [6.0 * 2.0**k for k in range(-20, 20)]
                         + [65024.0 * 2.0**k for k in range(-10, 10)] + [0.0, 1e-4, 1e-45])
    return torch.cat([v.to(torch.float32), exact.to(torch.float32)])


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e5m6"])
def test_scale_factors_are_correctly_rounded_divisions(fmt):
    amax = _amax_samples(4)
    sf, inv = ref.scale_factors_from_amax(amax, fmt)
    assert sf.dtype == inv.dtype == torch.float32
    clamp = _f32(CLAMP[fmt])
    for a, s, i in zip(amax.tolist(), sf.tolist(), inv.tolist()):
        c = max(a, clamp)
        assert s == _f32(c / MAX[fmt])
        assert i == _f32(MAX[fmt] / c)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e5m6"])
def test_round_sf_gives_the_next_power_of_two(fmt):
    amax = _amax_samples(5)
    sf, inv = ref.scale_factors_from_amax(amax, fmt, round_sf=True)
    clamp = _f32(CLAMP[fmt])
    for a, s, i in zip(amax.tolist(), sf.tolist(), inv.tolist()):
        q = _f32(max(a, clamp) / MAX[fmt])  # the float32 quotient that is rounded up
        e = math.frexp(s)[1] - 1
        assert s == 2.0**e and i == 2.0**-e
        assert s >= q and s / 2 < q


def test_custom_clamp_min():
    sf, inv = ref.scale_factors_from_amax(torch.tensor([0.0, 1.0]), "e4m3", clamp_min=0.5)
    assert sf.tolist() == [_f32(0.5 / 448), _f32(1 / 448)]
    with pytest.raises(ValueError):
        ref.scale_factors_from_amax(torch.tensor([1.0]), "e4m3", clamp_min=0.0)


# ----------------------------------------------------------------------------
# Scale-factor layouts
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 37])
@pytest.mark.parametrize("groups", [1, 3, 4, 5, 18])
def test_layout_scale_factors(rows, groups):
    g = _gen(rows * 100 + groups)
    exps = torch.randint(-30, 10, (rows, groups), generator=g)
    sf = (2.0**exps).to(torch.float32)

    plain = ref.layout_scale_factors(sf)
    assert plain.dtype == torch.float32 and plain.shape == (rows, groups) and plain.is_contiguous()
    assert torch.equal(plain, sf)

    col = ref.layout_scale_factors(sf, use_tma_aligned_col_major_sf=True)
    padded_rows = _align(rows, 4)
    assert col.dtype == torch.float32 and col.shape == (rows, groups)
    assert col.stride() == (1, padded_rows)
    assert torch.equal(col, sf)
    storage = torch.as_strided(col, (groups, padded_rows), (padded_rows, 1))
    assert torch.equal(storage[:, rows:], torch.zeros_like(storage[:, rows:]))

    packed = ref.layout_scale_factors(sf, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    words = -(-groups // 4)
    assert packed.dtype == torch.int32 and packed.shape == (rows, words)
    assert packed.stride() == (1, padded_rows)
    for m in range(rows):
        for c in range(words):
            word = packed[m, c].item() & 0xFFFFFFFF
            for j in range(4):
                byte = (word >> (8 * j)) & 0xFF
                k = 4 * c + j
                assert byte == (exps[m, k].item() + 127 if k < groups else 0)

    with pytest.raises(ValueError):
        ref.layout_scale_factors(sf, use_packed_ue8m0=True)


# ----------------------------------------------------------------------------
# Operators against slow loops
# ----------------------------------------------------------------------------


def _decode_out(out, fmt):
    return out.to(torch.float32) if fmt == "e4m3" else ref.unpack_from_e2m1fn_x2(out)


def _slow_block_cast(x, fmt, block, round_sf):
    """Loop over blocks: amax, factors by float64 division rounded to float32,
    values by brute-force nearest representable (ties to even)."""
    table = (_e4m3_table() if fmt == "e4m3" else E2M1_MAGNITUDES).to(torch.float32)
    rows, cols = x.shape
    bm, bk = block
    xf = x.to(torch.float32)
    sfs = torch.zeros((-(-rows // bm), -(-cols // bk)), dtype=torch.float32)
    out = torch.zeros((rows, cols), dtype=torch.float32)
    for i in range(sfs.shape[0]):
        for j in range(sfs.shape[1]):
            tile = xf[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk]
            c = max(max(abs(v) for v in tile.flatten().tolist()), _f32(CLAMP[fmt]))
            sf, inv = _f32(c / MAX[fmt]), _f32(MAX[fmt] / c)
            if round_sf:
                e = math.ceil(math.log2(sf))
                sf, inv = 2.0**e, 2.0**-e
            sfs[i, j] = sf
            scaled = tile * inv  # one float32 multiply per element
            codes = _nearest_code(scaled, table.double())
            out[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = torch.where(
                torch.signbit(scaled), -table[codes], table[codes])
    return out, sfs


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("npc", [32, 128, 192])
@pytest.mark.parametrize("round_sf", [False, True])
def test_per_token_cast_matches_slow_loop(fmt, npc, round_sf):
    x = (torch.randn((5, 192), generator=_gen(npc)) * 3).to(torch.bfloat16)
    x[1] *= 1e-6  # a row below the clamp
    out, sf = ref.per_token_cast(x, fmt, npc, round_sf=round_sf)
    expected, expected_sf = _slow_block_cast(x, fmt, (1, npc), round_sf)
    assert out.dtype == ref.FORMAT_DTYPES[fmt] and out.is_contiguous()
    assert torch.equal(_decode_out(out, fmt), expected)
    assert torch.equal(sf, expected_sf)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("block", [(32, 32), (128, 32)])
def test_per_block_cast_matches_slow_loop(fmt, block):
    x = torch.randn((40, 128), generator=_gen(7), dtype=torch.float32)
    out, sf = ref.per_block_cast(x, fmt, block)
    expected, expected_sf = _slow_block_cast(x, fmt, block, False)
    assert torch.equal(_decode_out(out, fmt), expected)
    assert torch.equal(sf, expected_sf)


def test_cast_back_matches_slow_loop():
    x = torch.randn((37, 128), generator=_gen(8)).to(torch.bfloat16)
    for fmt in ("e4m3", "e2m1"):
        cases = []
        for round_sf in (False, True):
            out, sf = ref.per_token_cast(x, fmt, 32, round_sf=round_sf)
            cases.append(((out, sf), (1, 32), sf))
        packed = ref.per_token_cast(x, fmt, 32, use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
        cases.append((packed, (1, 32), cases[1][2]))  # same factors as the round_sf case, packed
        out, sf = ref.per_block_cast(x, fmt, (32, 32))
        cases.append(((out, sf), (32, 32), sf))
        for xq, block, sf_plain in cases:
            values = _decode_out(xq[0], fmt)
            for out_fmt, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                back = ref.cast_back(xq, out_fmt, block)
                assert back.dtype == dtype and back.shape == x.shape and back.is_contiguous()
                for i in range(0, 37, 4):
                    for j in range(0, 128, 3):
                        s = sf_plain[i // block[0], j // block[1]].item()
                        want = torch.tensor(_f32(values[i, j].item() * s)).to(dtype).item()
                        assert back[i, j].item() == want


# ----------------------------------------------------------------------------
# Cross-operator identities
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("in_fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_prequantized_input_with_power_of_two_factors(in_fmt, fmt):
    """With power-of-two factors, re-quantizing (q, s) equals quantizing q * s."""
    x = torch.randn((70, 576), generator=_gen(9)).to(torch.bfloat16)
    for x_block_size in ((32, 32), (128, 128)):
        for tma in (False, True):
            xq = ref.per_block_cast(x, in_fmt, x_block_size, tma, True, tma)
            dequant = ref.cast_back(xq, "fp32", x_block_size)
            for npc in (32, 128):
                out, sf = ref.per_token_cast(xq, fmt, npc, x_block_size=x_block_size,
                                             use_tma_aligned_col_major_sf=tma, round_sf=True, use_packed_ue8m0=tma)
                out2, sf2 = ref.per_token_cast(dequant, fmt, npc, use_tma_aligned_col_major_sf=tma,
                                               round_sf=True, use_packed_ue8m0=tma)
                assert torch.equal(out.view(torch.uint8), out2.view(torch.uint8))
                assert torch.equal(sf, sf2) and sf.stride() == sf2.stride()


def test_prequantized_input_folds_the_factors():
    """Without round_sf the two factors are multiplied first: q * (s_in * inv)."""
    x = torch.randn((8, 256), generator=_gen(10)).to(torch.bfloat16)
    xq = ref.per_token_cast(x, "e4m3", 128)
    out, sf = ref.per_token_cast(xq, "e2m1", 32, x_block_size=(1, 128))
    q = xq[0].to(torch.float32)
    s_in = xq[1].repeat_interleave(128, 1)
    _, inv = ref.scale_factors_from_amax((q * s_in).abs().view(8, 8, 32).amax(-1), "e2m1")
    folded = q * (s_in * inv.repeat_interleave(32, 1))
    expected = ref.quantize_with_scales(folded, torch.ones((8, 1)), "e2m1", (1, 256))
    assert torch.equal(out, expected)


def test_per_channel_cast_and_transpose_is_a_transposed_per_token_cast():
    x = torch.randn((256, 192), generator=_gen(11)).to(torch.bfloat16)
    for npt in (32, 128):
        for round_sf in (False, True):
            out, sf = ref.per_channel_cast_and_transpose(x, "e4m3", npt, round_sf)
            out_t, sf_t = ref.per_token_cast(x.T.contiguous(), "e4m3", npt, round_sf=round_sf)
            assert out.shape == (192, 256) and out.is_contiguous()
            assert torch.equal(out.view(torch.uint8), out_t.view(torch.uint8))
            assert sf.shape == (256 // npt, 192) and sf.is_contiguous()
            assert torch.equal(sf, sf_t.T)
            if npt == 128:
                out_c, sf_c = ref.per_channel_cast(x, "e4m3", 128, round_sf)
                assert torch.equal(out_c.view(torch.uint8), out.T.contiguous().view(torch.uint8))
                assert torch.equal(sf_c, sf)


def test_per_channel_cast_fused_gathers_rows():
    g = _gen(12)
    x = torch.randn((100, 64), generator=g).to(torch.bfloat16)
    pos = torch.randint(-1, 100, (272,), generator=g, dtype=torch.int32)  # 272 = 2 * 128 + 16
    pos[:5] = -1
    valid = (pos >= 0).unsqueeze(1)
    rows = pos.clamp(min=0).long()
    gathered = torch.where(valid, x[rows].float(), torch.zeros(()))
    for round_sf in (False, True):
        out, sf = ref.per_channel_cast_fused(x, "e4m3", 128, round_sf, None, pos)
        assert out.shape == (272, 64) and out.dtype == torch.float8_e4m3fn and sf.shape == (3, 64)
        assert torch.equal(out[:5].view(torch.uint8), torch.zeros((5, 64), dtype=torch.uint8))  # +0
        slow, slow_sf = _slow_block_cast(gathered, "e4m3", (128, 1), round_sf)
        assert torch.equal(out.float(), slow) and torch.equal(sf, slow_sf)
        without_pos = ref.per_channel_cast_fused(x[:0].new_zeros((0, 64)), "e4m3", 128, round_sf)
        assert without_pos[0].shape == (0, 64) and without_pos[1].shape == (0, 64)


def test_per_channel_cast_fused_dequantizes_a_prequantized_input():
    """(q, s) is cast as the float32 products q * s, one rounding each."""
    g = _gen(16)
    x = torch.randn((128, 256), generator=g).to(torch.bfloat16)
    pos = torch.randint(-1, 128, (144,), generator=g, dtype=torch.int32)
    for round_sf in (False, True):
        xq = ref.per_token_cast(x, "e4m3", 128, round_sf=round_sf)
        dequant = xq[0].float() * xq[1].repeat_interleave(128, 1)
        for p in (None, pos):
            out, sf = ref.per_channel_cast_fused(xq, "e4m3", 128, round_sf, 128, p)
            if p is None:
                rows = dequant
            else:
                rows = torch.where((p >= 0).unsqueeze(1), dequant[p.clamp(min=0).long()], torch.zeros(()))
                # pad to whole 128-row blocks: zero rows cannot change a block's amax
                rows = torch.cat([rows, torch.zeros((256 - rows.shape[0], 256))])
            expected, expected_sf = ref.per_channel_cast(rows, "e4m3", 128, round_sf)
            assert torch.equal(out.view(torch.uint8), expected[: out.shape[0]].view(torch.uint8))
            assert torch.equal(sf, expected_sf)


@pytest.mark.parametrize("out_block", [(1, 128), (32, 32), (128, 128)])
@pytest.mark.parametrize("tma", [False, True])
def test_per_block_cast_lossless_preserves_values(out_block, tma):
    g = _gen(13)
    x = torch.randn((70, 576), generator=g) * 2.0 ** torch.randint(-8, 3, (70, 1), generator=g)
    for in_tma in (False, True):
        x_fp4 = ref.per_token_cast(x, "e2m1", 32, use_tma_aligned_col_major_sf=in_tma, round_sf=True, use_packed_ue8m0=in_tma)
        out, sf = ref.per_block_cast_lossless(x_fp4, "e4m3", (1, 32), out_block, tma, True, tma)
        assert out.dtype == torch.float8_e4m3fn and out.shape == (70, 576)
        assert torch.equal(ref.cast_back((out, sf), "fp32", out_block), ref.cast_back(x_fp4, "fp32", (1, 32)))
        sf_values = ref._decode_sf(sf, (-(-70 // out_block[0]), -(-576 // out_block[1])), "test")
        mantissa = sf_values.view(torch.int32) & 0x7FFFFF
        assert torch.equal(mantissa, torch.zeros_like(mantissa))  # powers of two


def test_per_block_cast_lossless_rejects_a_lossy_cast():
    data = torch.full((4, 64), 0x22, dtype=torch.int8)  # FP4 value 1.0 everywhere
    sf = torch.ones((4, 4))
    sf[0, 0] = 2.0**20  # spans more than 2**11 within the first 128-channel block
    with pytest.raises(ValueError, match="lossless"):
        ref.per_block_cast_lossless((data, sf), "e4m3", (1, 32), (1, 128))
    sf[0, 0] = 2.0**11  # the widest span that is still exact
    out, out_sf = ref.per_block_cast_lossless((data, sf), "e4m3", (1, 32), (1, 128))
    assert torch.equal(ref.cast_back((out, out_sf), "fp32", (1, 128)), ref.cast_back((data, sf), "fp32", (1, 32)))


# ----------------------------------------------------------------------------
# Shapes, empty inputs, argument checks
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,width", [("e4m3", 256), ("e2m1", 128), ("e5m6", 384)])
def test_empty_input(fmt, width):
    x = torch.empty((0, 256), dtype=torch.bfloat16)
    npc = 256 if fmt == "e5m6" else 128
    for tma, round_sf, packed in [(False, False, False), (True, True, True)]:
        out, sf = ref.per_token_cast(x, fmt, npc, use_tma_aligned_col_major_sf=tma, round_sf=round_sf, use_packed_ue8m0=packed)
        assert out.shape == (0, width) and out.dtype == ref.FORMAT_DTYPES[fmt]
        assert sf.shape == (0, 1 if packed or fmt == "e5m6" else 2)
        assert sf.dtype == (torch.int32 if packed else torch.float32)


def test_sf_shapes_and_strides_for_a_partial_group():
    x = torch.randn((7, 576), generator=_gen(14)).to(torch.bfloat16)
    _, sf = ref.per_token_cast(x, "e4m3", 128)
    assert sf.shape == (7, 5) and sf.stride() == (5, 1)
    _, sf = ref.per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True)
    assert sf.shape == (7, 5) and sf.stride() == (1, 8)
    _, sf = ref.per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
    assert sf.shape == (7, 2) and sf.stride() == (1, 8) and sf.dtype == torch.int32
    _, sf = ref.per_block_cast(x, "e2m1", (32, 128), True, True, True)
    assert sf.shape == (1, 2) and sf.stride() == (1, 4)


def test_argument_checks():
    x = torch.randn((8, 256), generator=_gen(15)).to(torch.bfloat16)
    xq = ref.per_token_cast(x, "e4m3", 128)
    bad = [
        lambda: ref.per_token_cast(x, "e3m2", 128),
        lambda: ref.per_token_cast(x, "e4m3", 96),
        lambda: ref.per_token_cast(x, "e4m3", 128, use_packed_ue8m0=True, round_sf=True),
        lambda: ref.per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True),
        lambda: ref.per_token_cast(x, "e5m6", 128),
        lambda: ref.per_token_cast(xq, "e4m3", 128),  # x_block_size missing
        lambda: ref.per_token_cast(xq, "e4m3", 256, x_block_size=(1, 128)),  # one group per row
        lambda: ref.per_token_cast_with_sf_only(xq, "e4m3", 128, x_block_size=(1, 128)),
        lambda: ref.per_token_cast_with_sf_only(x, "e4m3", 256),
        lambda: ref.per_token_cast_with_precomputed_sf(x, "e4m3", 128, xq[1], use_tma_aligned_col_major_sf=True),
        lambda: ref.per_token_cast_with_precomputed_sf(x, "e4m3", 128, xq[1][:, :1].contiguous()),
        lambda: ref.per_token_cast(x.to(torch.float16), "e4m3", 128),
        lambda: ref.per_block_cast(x, "e4m3", (64, 64)),
        lambda: ref.per_block_cast(x[:, :192].contiguous()[:, :100], "e4m3", (32, 32)),
        lambda: ref.per_channel_cast(x, "e4m3", 128),  # 8 tokens, not a multiple of 128
        lambda: ref.per_channel_cast_fused(x, "e4m3", 128, num_per_channels=128),
        lambda: ref.per_channel_cast_and_transpose(x.float(), "e4m3", 32),
        lambda: ref.cast_back(xq, "fp16", (1, 128)),
        lambda: ref.cast_back((xq[0], xq[1][:, :1]), "fp32", (1, 128)),
        lambda: ref.per_block_cast_lossless(xq, "e4m3", (1, 128), (1, 128)),  # not e2m1
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"case {i} did not raise")
