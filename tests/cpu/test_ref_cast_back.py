"""cast_back against the casts (the references only, on the CPU): with power-of-two factors
(``round_sf=True``) a cast, a cast back and a second cast give the same bits, for every format,
factor layout, block shape and output dtype, except in one stated case (docs/ops.md, quant:
"Round trip"): a group whose largest code is exactly MAX / 2 is re-cast with half the factor
and doubled codes, the same values.  Also: cast_back decodes every code exactly, and empty
inputs in every factor form."""

import pytest
import torch

from tile_kernels_aot.torch import quant as ref

MAX = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}
# (tma, packed) factor forms of a cast with round_sf: fp32 row-major, fp32 TMA-aligned
# column-major, packed UE8M0
FORMS = [(False, False), (True, False), (True, True)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _input(rows, hidden, seed, dtype=torch.bfloat16):
    """Normal values with a per-row scale over many binades (factors far from 1)."""
    g = _gen(seed)
    scale = torch.pow(2.0, torch.randint(-40, 40, (rows, 1), generator=g).float())
    return (torch.randn(rows, hidden, generator=g) * scale).to(dtype)


def _values(data, fmt):
    """Decoded codes (float32) of a cast's output."""
    if fmt == "e5m6":
        return ref._decode_e5m6(data)
    return ref._decode_values(data)


def _factors(sf, grid):
    return ref._decode_sf(sf, grid, "test")


def _cast(x, fmt, block, tma, packed):
    """``(data, sf)`` of the cast TileKernels offers for ``block``."""
    if block[0] == 1:
        return ref.per_token_cast(x, fmt, block[1], use_tma_aligned_col_major_sf=tma, round_sf=True,
                                  use_packed_ue8m0=packed)
    if block[1] == 1:
        return ref.per_channel_cast(x, fmt, block[0], round_sf=True)
    return ref.per_block_cast(x, fmt, block, tma, True, packed)


def _check_round_trip(x, fmt, block, tma, packed):
    rows, hidden = x.shape
    grid = (-(-rows // block[0]), -(-hidden // block[1]))
    data, sf = _cast(x, fmt, block, tma, packed)
    special = "e5m6" if fmt == "e5m6" else None
    q = _values(data, fmt)
    s = _factors(sf, grid)
    for out_fmt in ("bf16", "fp32"):
        back = ref.cast_back((data, sf), out_fmt, block, x_special_fmt=special)
        # the dequantized values are exact in both output dtypes (codes have at most 7
        # significant bits, factors are powers of two)
        assert torch.equal(back.to(torch.float32), ref._per_block(q, s, block, torch.mul))
        data2, sf2 = _cast(back, fmt, block, tma, packed)
        q2, s2 = _values(data2, fmt), _factors(sf2, grid)
        # the factor of the second cast: the same, or half where a group's largest |code| is
        # exactly MAX / 2 (and the clamp does not decide it); codes scale to the same values
        group_max = ref._block_amax(q, block)
        halved = s2 != s
        assert torch.equal(s2[halved], s[halved] / 2), (fmt, block, tma, packed, out_fmt)
        assert bool((group_max[halved] == MAX[fmt] / 2).all())
        assert torch.equal(q2, q * ref._per_block(torch.ones_like(q), s / s2, block, torch.mul))
        if not bool(halved.any()):
            assert torch.equal(data2.view(torch.uint8), data.view(torch.uint8))
            assert torch.equal(sf2.contiguous().view(torch.int32), sf.contiguous().view(torch.int32))
            assert sf2.stride() == sf.stride()
        # the same values once more
        assert torch.equal(ref.cast_back((data2, sf2), out_fmt, block, x_special_fmt=special), back)


BLOCKS = [(1, 16), (1, 32), (1, 64), (1, 128), (1, 0), (128, 128), (32, 32), (32, 128), (128, 32)]


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("tma,packed", FORMS)
def test_round_trip_gives_the_same_bits(fmt, block, tma, packed):
    rows, hidden = 72, 576
    block = (block[0], block[1] or hidden)
    x = _input(rows, hidden, seed=block[0] * 1000 + block[1])
    _check_round_trip(x, fmt, block, tma, packed)


@pytest.mark.parametrize("tma,packed", FORMS)
def test_round_trip_e5m6(tma, packed):
    for hidden in (64, 1024):
        _check_round_trip(_input(40, hidden, seed=hidden), "e5m6", (1, hidden), tma, packed)


@pytest.mark.parametrize("npt", [128])
def test_round_trip_per_channel(npt):
    x = _input(256, 128, seed=npt)
    _check_round_trip(x, "e4m3", (npt, 1), False, False)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e5m6"])
def test_round_trip_is_bit_exact_when_every_group_reaches_max(fmt):
    """Groups whose largest value is MAX * 2**k (so no code is MAX / 2 at the top): the
    second cast reproduces data and factors bit for bit."""
    rows, hidden = 33, 256
    x = _input(rows, hidden, seed=7, dtype=torch.float32)
    g = 32 if fmt != "e5m6" else hidden
    grouped = x.view(rows, hidden // g, g)
    exponents = torch.floor(torch.log2(grouped.abs().amax(-1))).clamp(-100, 100)
    grouped[..., 0] = MAX[fmt] * torch.pow(2.0, exponents)  # the group maximum, a power of two times MAX
    for tma, packed in FORMS:
        data, sf = ref.per_token_cast(x, fmt, g, use_tma_aligned_col_major_sf=tma, round_sf=True, use_packed_ue8m0=packed)
        back = ref.cast_back((data, sf), "bf16", (1, g), x_special_fmt="e5m6" if fmt == "e5m6" else None)
        data2, sf2 = ref.per_token_cast(back, fmt, g, use_tma_aligned_col_major_sf=tma, round_sf=True,
                                        use_packed_ue8m0=packed)
        assert torch.equal(data2.view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(sf2.contiguous().view(torch.int32), sf.contiguous().view(torch.int32))


def test_cast_back_decodes_every_code():
    """Every e4m3 byte, every e2m1 nibble and every e5m6 code, times a factor of one."""
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    e4m3 = every_byte.view(torch.float8_e4m3fn).reshape(4, 64)
    out = ref.cast_back((e4m3, torch.ones(4, 1)), "fp32", (1, 64))
    assert torch.equal(out.view(torch.int32), e4m3.to(torch.float32).view(torch.int32))  # torch's NaN bits too
    e2m1 = every_byte.view(torch.int8).reshape(4, 64)
    out = ref.cast_back((e2m1, torch.ones(4, 2)), "fp32", (1, 64))
    assert torch.equal(out, ref.unpack_from_e2m1fn_x2(e2m1))
    codes = torch.arange(4096, dtype=torch.int64).reshape(8, 512)
    packed = ref._pack_e5m6(codes)
    out = ref.cast_back((packed, torch.ones(8, 1)), "fp32", (1, 512), x_special_fmt="e5m6")
    halves = (codes << 4).to(torch.int32)
    halves = torch.where(halves >= 0x8000, halves - 0x10000, halves).to(torch.int16).view(torch.float16)
    expected = halves.to(torch.float32)
    nan = expected.isnan()  # exponent 31, nonzero mantissa (a signalling NaN may be quieted by the multiply)
    assert int(nan.sum()) == 2 * 63
    assert torch.equal(out.isnan(), nan) and torch.equal(out[~nan].view(torch.int32), expected[~nan].view(torch.int32))


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_cast_back_of_an_empty_input(block):
    for sf in (torch.empty(0, 56), torch.empty(0, 14, dtype=torch.int32)):
        out = ref.cast_back((torch.empty(0, 7168, dtype=torch.float8_e4m3fn), sf), "bf16", block)
        assert out.shape == (0, 7168) and out.dtype == torch.bfloat16
