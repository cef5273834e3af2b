"""Quant references against TileKernels 1.0.0.

Upstream's torch references (``tile_kernels.torch.cast``/``cast_back``,
``cast_to_e5m6``/``cast_back_from_e5m6``, ``per_channel_cast_fused``) are the
oracle; upstream's own kernel tests compare its kernels with them bit for bit,
so every comparison here is bit-exact (dtype, shape, every byte) unless a test
says otherwise.  One known difference: for a pre-quantized input without
``round_sf``, our reference follows upstream's *kernel*, which multiplies the
two factors first (``q * (s_in * sf_inv)``), while upstream's torch reference
computes ``(q * s_in) * sf_inv``; the test for it checks that outputs differ
only where those two float32 products differ, by one code step at most.

Shapes: upstream's hidden sizes (576 ... 7168) with small, odd token counts
(so TMA padding and partial token blocks are exercised), plus one case at
upstream's token count (4001); ``0`` tokens for the empty path.
"""

import inspect
import random

import pytest

tile_kernels = pytest.importorskip("tile_kernels")

import torch  # noqa: E402
import tile_kernels.quant as tk_quant  # noqa: E402
from tile_kernels.torch import cast, cast_back, cast_back_from_e5m6, cast_to_e5m6  # noqa: E402
from tile_kernels.torch.per_channel_cast_fused import per_channel_cast_fused as tk_per_channel_cast_fused  # noqa: E402

from tile_kernels_aot.torch import quant as ref  # noqa: E402

HIDDEN_SIZES = [576, 2048, 2560, 3072, 4096, 6144, 7168]
# For the operators other than per_token_cast: a partial last 128-group (576),
# a group count that is not a multiple of 4 or 8 (2560 / 128 = 20, 2560 / 32 = 80),
# and the largest size.
SOME_HIDDEN_SIZES = [576, 2560, 7168]
# (use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0); upstream's tests use the
# first and the last; the middle ones are the other forms its references accept.
SF_FORMS = [(False, False, False), (False, True, False), (True, False, False), (True, True, True)]
PUBLIC = [
    "per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf",
    "per_block_cast", "per_block_cast_with_sf_only", "per_block_cast_with_precomputed_sf",
    "per_channel_cast", "per_channel_cast_fused", "per_channel_cast_and_transpose",
    "cast_back", "per_token_cast_back", "per_block_cast_lossless", "unpack_from_e2m1fn_x2",
]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, seed):
    return torch.randn(shape, generator=_gen(seed)).to(dtype)


def _align(a, b):
    return -(-a // b) * b


def assert_bits_equal(ours, theirs, check_stride=True):
    """dtype, shape, (strides) and every byte equal."""
    assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    if check_stride and ours.numel() > 0:
        assert ours.stride() == theirs.stride(), (ours.stride(), theirs.stride())
    a = ours.contiguous().flatten().view(torch.uint8)
    b = theirs.contiguous().flatten().view(torch.uint8)
    mismatch = (a != b).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.numel()} bytes differ, first at {mismatch[:5].flatten().tolist()}"


def assert_sf_equal(ours, theirs, tma):
    """Scale factors: values bit-exact.  Strides: upstream's kernels give a
    column-major sf strides ``(1, align(rows, 4))``; upstream's torch reference
    agrees except when a dim is 1 (a ``.T.contiguous().T`` round trip then
    normalizes the strides), so compare strides with the oracle only there."""
    assert_bits_equal(ours, theirs, check_stride=False)
    rows = ours.shape[0]
    if tma:
        if rows > 0:
            assert ours.stride() == (1, _align(rows, 4))
    else:
        assert ours.is_contiguous()
    if ours.numel() > 0 and min(ours.shape) > 1:
        assert ours.stride() == theirs.stride()


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", PUBLIC)
def test_signature_matches_upstream(name):
    assert _params(getattr(ref, name)) == _params(getattr(tk_quant, name))


# ----------------------------------------------------------------------------
# per_token_cast and its variants (plain input)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast(hidden, fmt):
    num_tokens = 13  # TMA pads the token dim to 16
    for in_dtype in (torch.bfloat16, torch.float32):
        x = _randn((num_tokens, hidden), in_dtype, seed=hidden)
        for npc in (32, 64, 128, hidden):
            for tma, round_sf, packed in SF_FORMS:
                out, sf = ref.per_token_cast(x, fmt, npc, use_tma_aligned_col_major_sf=tma,
                                             round_sf=round_sf, use_packed_ue8m0=packed)
                out_ref, sf_ref = cast(x, fmt, (1, npc), use_tma_aligned_col_major_sf=tma,
                                       round_sf=round_sf, use_packed_ue8m0=packed)
                assert_bits_equal(out, out_ref)
                assert_sf_equal(sf, sf_ref, tma)
                if npc == hidden:
                    continue
                sf_only = ref.per_token_cast_with_sf_only(x, fmt, npc, use_tma_aligned_col_major_sf=tma,
                                                          round_sf=round_sf, use_packed_ue8m0=packed)
                assert_bits_equal(sf_only, sf)
                if not tma:
                    # a factor grid that per_token_cast would not have produced
                    given = sf * torch.empty_like(sf).uniform_(0.5, 2.0, generator=_gen(npc))
                    out = ref.per_token_cast_with_precomputed_sf(x, fmt, npc, given, round_sf=round_sf)
                    assert_bits_equal(out, cast(x, fmt, (1, npc), sf=given))


def test_per_token_cast_group16_and_strided_rows():
    x_full = _randn((29, 2 * 2048), torch.bfloat16, seed=5)
    x = x_full[:, :2048]  # rows strided, as upstream's non-contiguous test
    for fmt in ("e4m3", "e2m1"):
        for tma, round_sf, packed in SF_FORMS:
            out, sf = ref.per_token_cast(x, fmt, 16, use_tma_aligned_col_major_sf=tma,
                                         round_sf=round_sf, use_packed_ue8m0=packed)
            out_ref, sf_ref = cast(x.contiguous(), fmt, (1, 16), use_tma_aligned_col_major_sf=tma,
                                   round_sf=round_sf, use_packed_ue8m0=packed)
            assert_bits_equal(out, out_ref)
            assert_sf_equal(sf, sf_ref, tma)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_per_token_cast_upstream_token_count(fmt):
    x = _randn((4001, 2048), torch.bfloat16, seed=4001)
    out, sf = ref.per_token_cast(x, fmt, 128, use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
    out_ref, sf_ref = cast(x, fmt, (1, 128), use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
    assert_bits_equal(out, out_ref)
    assert_sf_equal(sf, sf_ref, True)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("tma,round_sf,packed", SF_FORMS)
def test_per_token_cast_empty(fmt, tma, round_sf, packed):
    x = torch.empty((0, 2048), dtype=torch.bfloat16)
    out, sf = ref.per_token_cast(x, fmt, 128, use_tma_aligned_col_major_sf=tma, round_sf=round_sf, use_packed_ue8m0=packed)
    out_ref, sf_ref = cast(x, fmt, (1, 128), use_tma_aligned_col_major_sf=tma, round_sf=round_sf, use_packed_ue8m0=packed)
    assert_bits_equal(out, out_ref)
    assert_bits_equal(sf, sf_ref, check_stride=False)


# ----------------------------------------------------------------------------
# per_token_cast of a pre-quantized input
# ----------------------------------------------------------------------------


def _prequantized(hidden, in_fmt, x_block_size, tma, round_sf, packed, seed, num_tokens=20):
    x = _randn((num_tokens, hidden), torch.bfloat16, seed)
    return cast(x, in_fmt, x_block_size, use_tma_aligned_col_major_sf=tma, round_sf=round_sf, use_packed_ue8m0=packed)


@pytest.mark.parametrize("hidden", SOME_HIDDEN_SIZES)
@pytest.mark.parametrize("in_fmt", ["e4m3", "e2m1"])
def test_per_token_cast_prequantized_power_of_two(hidden, in_fmt):
    """Upstream's own configurations (round_sf=True): bit-exact."""
    for x_block_size in ((128, 128), (32, 32)):
        for tma, round_sf, packed in [(False, True, False), (True, True, True)]:
            xq = _prequantized(hidden, in_fmt, x_block_size, tma, round_sf, packed, seed=hidden + 1)
            for npc in (32, 128):
                for fmt in ("e4m3", "e2m1"):
                    out, sf = ref.per_token_cast(xq, fmt, npc, x_block_size=x_block_size, use_tma_aligned_col_major_sf=tma,
                                                 round_sf=round_sf, use_packed_ue8m0=packed)
                    out_ref, sf_ref = cast(xq, fmt, (1, npc), x_block_size=x_block_size, use_tma_aligned_col_major_sf=tma,
                                           round_sf=round_sf, use_packed_ue8m0=packed)
                    assert_bits_equal(out, out_ref)
                    assert_sf_equal(sf, sf_ref, tma)


def _code_step(out, fmt):
    """Integer code whose neighbours are adjacent representable magnitudes."""
    if fmt == "e4m3":
        b = out.view(torch.uint8).to(torch.int32)
        return torch.where(b >= 128, -(b - 128), b)
    b = out.view(torch.uint8).to(torch.int32)
    nib = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(out.shape[0], -1)
    return torch.where(nib >= 8, -(nib - 8), nib)


@pytest.mark.parametrize("hidden", [576, 2048])
@pytest.mark.parametrize("in_fmt", ["e4m3", "e2m1"])
def test_per_token_cast_prequantized_fp32_factors(hidden, in_fmt):
    """round_sf=False: scale factors bit-exact; values differ from upstream's torch
    reference exactly where float32 ``q * (s_in * inv)`` (upstream's kernel, which
    we follow) differs from ``(q * s_in) * inv`` (its torch reference), and then by
    one code step at most (a tie rounded the other way)."""
    for x_block_size in ((128, 128), (32, 32)):
        for tma in (False, True):
            xq = _prequantized(hidden, in_fmt, x_block_size, tma, False, False, seed=hidden + 2)
            data, x_sf = xq
            q = ref._decode_values(data)
            s_in = x_sf.repeat_interleave(x_block_size[0], 0).repeat_interleave(x_block_size[1], 1)[: q.shape[0], : q.shape[1]]
            for npc in (32, 128):
                for fmt in ("e4m3", "e2m1"):
                    out, sf = ref.per_token_cast(xq, fmt, npc, x_block_size=x_block_size, use_tma_aligned_col_major_sf=tma)
                    out_ref, sf_ref = cast(xq, fmt, (1, npc), x_block_size=x_block_size, use_tma_aligned_col_major_sf=tma)
                    assert_sf_equal(sf, sf_ref, tma)
                    _, inv = ref.scale_factors_from_amax(ref._block_amax(q * s_in, (1, npc)), fmt)
                    inv_e = inv.repeat_interleave(npc, 1)[:, : q.shape[1]]
                    folded = q * (s_in * inv_e)
                    unfolded = (q * s_in) * inv_e
                    assert_bits_equal(out, ref._encode(folded, fmt))
                    assert_bits_equal(out_ref, ref._encode(unfolded, fmt))
                    c, c_ref = _code_step(out, fmt), _code_step(out_ref, fmt)
                    assert (c - c_ref).abs().max() <= 1
                    differs = c != c_ref
                    assert not (differs & (folded == unfolded)).any()


# ----------------------------------------------------------------------------
# e5m6
# ----------------------------------------------------------------------------


def _e5m6_inputs(num_tokens, hidden, dtype, seed):
    """Upstream's e5m6 test inputs: random, then constant rows of the format's
    edge values (smallest subnormal, largest subnormal, smallest normal) with a
    65024 in the last column."""
    yield _randn((num_tokens, hidden), dtype, seed)
    for value in (2.0**-20, 2.0**-14 * 63 / 64, 2.0**-14):
        x = torch.full((num_tokens, hidden), value, dtype=dtype)
        x[:, -1] = 65024.0
        yield x


@pytest.mark.parametrize("hidden", SOME_HIDDEN_SIZES)
def test_per_token_cast_e5m6_and_cast_back(hidden):
    for dtype in (torch.bfloat16, torch.float32):
        for x in _e5m6_inputs(5, hidden, dtype, seed=hidden + 3):
            for tma, round_sf, packed in SF_FORMS:
                out, sf = ref.per_token_cast(x, "e5m6", hidden, use_tma_aligned_col_major_sf=tma,
                                             round_sf=round_sf, use_packed_ue8m0=packed)
                out_ref, sf_ref = cast_to_e5m6(x, hidden, use_tma_aligned_col_major_sf=tma,
                                               round_sf=round_sf, use_packed_ue8m0=packed)
                assert_bits_equal(out, out_ref)
                assert_sf_equal(sf, sf_ref, tma)
                for fmt in ("bf16", "fp32"):
                    back = ref.cast_back((out, sf), fmt, (1, hidden), x_special_fmt="e5m6")
                    assert_bits_equal(back, cast_back_from_e5m6((out, sf), fmt, (1, hidden)))
                    assert_bits_equal(back, ref.per_token_cast_back((out, sf), fmt, hidden, x_special_fmt="e5m6"))


# ----------------------------------------------------------------------------
# per_block_cast
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", SOME_HIDDEN_SIZES)
def test_per_block_cast(hidden):
    num_tokens = 72  # two 32-row blocks and a partial one; one partial 128-row block
    for in_dtype in (torch.bfloat16, torch.float32) if hidden == 576 else (torch.bfloat16,):
        x = _randn((num_tokens, hidden), in_dtype, seed=hidden + 4)
        for fmt in ("e4m3", "e2m1"):
            for block_size in ((128, 128), (32, 32), (32, 128), (128, 32)):
                for tma, round_sf, packed in SF_FORMS:
                    out, sf = ref.per_block_cast(x, fmt, block_size, tma, round_sf, packed)
                    out_ref, sf_ref = cast(x, fmt, block_size, use_tma_aligned_col_major_sf=tma,
                                           round_sf=round_sf, use_packed_ue8m0=packed)
                    assert_bits_equal(out, out_ref)
                    assert_sf_equal(sf, sf_ref, tma)
                    assert_bits_equal(ref.per_block_cast_with_sf_only(x, fmt, block_size, tma, round_sf, packed), sf)
                    if not tma:
                        given = sf * torch.empty_like(sf).uniform_(0.5, 2.0, generator=_gen(hidden))
                        out = ref.per_block_cast_with_precomputed_sf(x, fmt, block_size, given, round_sf=round_sf)
                        assert_bits_equal(out, cast(x, fmt, block_size, sf=given))


# ----------------------------------------------------------------------------
# per-channel casts
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", SOME_HIDDEN_SIZES)
def test_per_channel_cast_and_transpose(hidden):
    num_tokens = 256
    x = _randn((num_tokens, hidden), torch.bfloat16, seed=hidden + 5)
    for round_sf in (False, True):
        out, sf = ref.per_channel_cast(x, "e4m3", 128, round_sf)
        out_ref, sf_ref = cast(x, "e4m3", block_size=(128, 1), round_sf=round_sf)
        assert_bits_equal(out, out_ref)
        assert_bits_equal(sf, sf_ref)
        for npt in (32, 128):
            out, sf = ref.per_channel_cast_and_transpose(x, "e4m3", npt, round_sf)
            out_ref, sf_ref = cast(x, "e4m3", block_size=(npt, 1), round_sf=round_sf)
            assert_bits_equal(out, out_ref.T.contiguous())
            assert_bits_equal(sf, sf_ref)
    x32 = _randn((128, hidden), torch.float32, seed=hidden + 6)
    out, sf = ref.per_channel_cast(x32, "e4m3", 128)
    out_ref, sf_ref = cast(x32, "e4m3", block_size=(128, 1))
    assert_bits_equal(out, out_ref)
    assert_bits_equal(sf, sf_ref)


def _pos_to_token(num_tokens, num_out, seed):
    g = _gen(seed)
    pos = torch.randint(0, num_tokens, (num_out,), generator=g, dtype=torch.int32)
    pos[torch.rand(num_out, generator=g) < 0.2] = -1
    return pos


@pytest.mark.parametrize("hidden", [2560, 7168])
def test_per_channel_cast_fused(hidden):
    num_tokens = 256
    x = _randn((num_tokens, hidden), torch.bfloat16, seed=hidden + 7)
    for round_sf in (False, True):
        xq = ref.per_token_cast(x, "e4m3", 128, round_sf=round_sf)
        for pos in (None, _pos_to_token(num_tokens, 144, seed=hidden), _pos_to_token(num_tokens, 384, seed=hidden + 1)):
            for inp, npc in ((x, None), (xq, 128)):
                out, sf = ref.per_channel_cast_fused(inp, "e4m3", 128, round_sf, npc, pos)
                out_ref, sf_ref = tk_per_channel_cast_fused(inp, 128, npc, round_sf, pos)
                assert_bits_equal(out, out_ref)
                assert_bits_equal(sf, sf_ref)


# ----------------------------------------------------------------------------
# cast_back
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", SOME_HIDDEN_SIZES)
def test_cast_back(hidden):
    num_tokens = 136
    x = _randn((num_tokens, hidden), torch.bfloat16, seed=hidden + 8)
    for fmt in ("e4m3", "e2m1"):
        for block in ((1, 32), (1, 128), (1, hidden), (128, 1), (128, 128), (32, 32)):
            if fmt == "e2m1" and block[1] == 1:
                continue  # not a layout any op produces (and e2m1 packs along channels)
            forms = SF_FORMS if block[1] != 1 else [(False, False, False), (False, True, False)]
            for tma, round_sf, packed in forms:
                xq = cast(x, fmt, block, use_tma_aligned_col_major_sf=tma, round_sf=round_sf, use_packed_ue8m0=packed)
                for out_fmt in ("bf16", "fp32"):
                    back = ref.cast_back(xq, out_fmt, block)
                    assert_bits_equal(back, cast_back(xq, out_fmt, block))
                    if block[0] == 1:
                        assert_bits_equal(back, ref.per_token_cast_back(xq, out_fmt, block[1]))


# ----------------------------------------------------------------------------
# per_block_cast_lossless: upstream's test checks cast_back(out) == cast_back(in)
# ----------------------------------------------------------------------------


def _lossless_input(num_tokens, hidden, seed):
    """Upstream's input: randn scaled by a random power of two, magnitudes kept
    within 2**9 of the tensor's max (so the FP4 factors span few binades)."""
    rng = random.Random(seed)
    x = torch.randn((num_tokens, hidden), generator=_gen(seed)) * 2.0 ** rng.randint(-110, 126)
    x = torch.where(torch.isfinite(x), x, torch.ones_like(x))
    floor = x.abs().max() / 2**9
    return torch.sign(x) * torch.maximum(x.abs(), floor)


@pytest.mark.parametrize("hidden", SOME_HIDDEN_SIZES)
def test_per_block_cast_lossless(hidden):
    num_tokens = 136
    x = _lossless_input(num_tokens, hidden, seed=hidden)
    for in_tma, in_round, in_packed in [(False, True, False), (True, True, True)]:
        x_fp4 = cast(x, "e2m1", (1, 32), use_tma_aligned_col_major_sf=in_tma, round_sf=in_round, use_packed_ue8m0=in_packed)
        expected = cast_back(x_fp4, "fp32", (1, 32))
        for tma, round_sf, packed in [(False, True, False), (True, True, True), (False, False, False), (True, False, False)]:
            for out_block in ((1, 128), (32, 32), (128, 128)):
                out, sf = ref.per_block_cast_lossless(x_fp4, "e4m3", (1, 32), out_block, tma, round_sf, packed)
                assert out.dtype == torch.float8_e4m3fn and out.shape == (num_tokens, hidden)
                rows = -(-num_tokens // out_block[0])
                groups = -(-hidden // out_block[1])
                if packed:
                    assert sf.dtype == torch.int32 and sf.shape == (rows, -(-groups // 4))
                else:
                    assert sf.dtype == torch.float32 and sf.shape == (rows, groups)
                if tma:
                    assert sf.stride() == (1, _align(rows, 4))
                assert_bits_equal(cast_back((out, sf), "fp32", out_block), expected)


# ----------------------------------------------------------------------------
# unpack_from_e2m1fn_x2
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_unpack_from_e2m1fn_x2(dtype, out_dtype):
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    shuffled = every_byte[torch.randperm(256, generator=_gen(9))].reshape(4, 2, 32)
    for x in (every_byte, shuffled):
        assert_bits_equal(ref.unpack_from_e2m1fn_x2(x, out_dtype), tk_quant.unpack_from_e2m1fn_x2(x, out_dtype))
