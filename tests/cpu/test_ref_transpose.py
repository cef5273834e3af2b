"""Defining properties of the transpose references.

TileKernels 1.0.0 has no torch reference for transpose (its own test compares
the kernel with ``x.T.contiguous()``), so these tests check the definition
directly: every output element is the bit pattern of the input element at the
swapped index, the output is a fresh contiguous buffer, strided rows are read
correctly.  Inputs are random *bit patterns* (NaNs, infinities, signed zeros
and subnormals included), and all comparisons are on the raw bits.
"""

import zlib

import pytest
import torch

from tile_kernels_aot.torch.transpose import batched_transpose, transpose

DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _seed(*key) -> int:
    """A deterministic per-case seed (Python's str hash is salted per process)."""
    return zlib.crc32(repr(key).encode())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns of ``t`` as an integer tensor of the same shape."""
    return t.view(_BITS[t.element_size()])


def _random_bits(shape, dtype, gen) -> torch.Tensor:
    """A tensor of ``dtype`` whose every element is a uniformly random bit pattern."""
    size = torch.Size(shape)
    nbytes = size.numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(size)


def _row_strided(x: torch.Tensor, pad: int) -> torch.Tensor:
    """The same values as ``x`` ([..., M, N]) in a view whose rows are ``N + pad`` apart."""
    buf = _random_bits((*x.shape[:-1], x.shape[-1] + pad), x.dtype, torch.Generator().manual_seed(99))
    view = buf[..., : x.shape[-1]]
    _bits(view).copy_(_bits(x))
    assert view.stride(-1) == 1 and view.stride(-2) == x.shape[-1] + pad
    return view


def _expected_batched(x: torch.Tensor) -> torch.Tensor:
    """out[b, j, i] = x[b, i, j], built by explicit gathering of raw bits."""
    b, m, n = x.shape
    src = _bits(x)
    bi = torch.arange(b).view(b, 1, 1).expand(b, n, m)
    ji = torch.arange(n).view(1, n, 1).expand(b, n, m)
    ii = torch.arange(m).view(1, 1, m).expand(b, n, m)
    return src[bi, ii, ji]


def _check_transposed(out: torch.Tensor, x: torch.Tensor, batched: bool) -> None:
    *lead, m, n = x.shape
    assert out.dtype == x.dtype and out.device == x.device
    assert out.shape == (*lead, n, m)
    assert out.is_contiguous()
    assert out.stride()[-2:] == (m, 1)
    if out.numel():
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    x3 = x if batched else x.unsqueeze(0)
    o3 = out if batched else out.unsqueeze(0)
    torch.testing.assert_close(_bits(o3), _expected_batched(x3), rtol=0, atol=0)


# (M, N) pairs: both dims mod 128 in {0, 64}, the hidden sizes upstream tests
# (576 .. 7168), and a token count aligned as upstream aligns it (4001 -> 4032).
SHAPES_2D = [(64, 64), (128, 64), (64, 192), (4032, 576), (256, 7168), (576, 2048), (1024, 3072)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES_2D, ids=str)
@pytest.mark.parametrize("pad", [0, 64], ids=lambda p: f"pad{p}")
def test_transpose_matches_definition(shape, dtype, pad):
    gen = torch.Generator().manual_seed(_seed(shape, dtype, pad))
    x = _random_bits(shape, dtype, gen)
    if pad:
        x = _row_strided(x, pad)
    before = _bits(x).clone()
    out = transpose(x)
    _check_transposed(out, x, batched=False)
    torch.testing.assert_close(_bits(x), before, rtol=0, atol=0)  # input untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8, 64, 576), (32, 128, 192), (3, 576, 64), (8, 256, 2048)], ids=str)
@pytest.mark.parametrize("pad", [0, 128], ids=lambda p: f"pad{p}")
def test_batched_transpose_matches_definition(shape, dtype, pad):
    gen = torch.Generator().manual_seed(_seed(shape, dtype, pad))
    x = _random_bits(shape, dtype, gen)
    if pad:
        x = _row_strided(x, pad)
    out = batched_transpose(x)
    _check_transposed(out, x, batched=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_against_loop(dtype):
    """A slow element-by-element loop on a small, odd-sized matrix."""
    gen = torch.Generator().manual_seed(7)
    x = _random_bits((2, 5, 7), dtype, gen)
    out = batched_transpose(x)
    xb, ob = _bits(x).tolist(), _bits(out).tolist()
    for b in range(2):
        for i in range(5):
            for j in range(7):
                assert ob[b][j][i] == xb[b][i][j]
    out2 = transpose(x[1])
    assert _bits(out2).tolist() == ob[1]


def test_every_fp8_bit_pattern_survives():
    """All 256 float8_e4m3fn encodings, NaNs and -0 included, come out unchanged."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).view(4, 64)
    out = transpose(x)
    assert sorted(_bits(out).flatten().tolist()) == list(range(256))
    torch.testing.assert_close(_bits(out), _bits(x).t(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty(dtype):
    for shape in [(0, 64), (64, 0)]:
        out = transpose(torch.empty(shape, dtype=dtype))
        assert out.shape == shape[::-1] and out.dtype == dtype and out.is_contiguous()
    out = batched_transpose(torch.empty((0, 64, 128), dtype=dtype))
    assert out.shape == (0, 128, 64)
    out = batched_transpose(torch.empty((4, 0, 128), dtype=dtype))
    assert out.shape == (4, 128, 0)


def test_rejects_wrong_rank():
    with pytest.raises(ValueError, match="transpose"):
        transpose(torch.zeros(2, 64, 64))
    with pytest.raises(ValueError, match="batched_transpose"):
        batched_transpose(torch.zeros(64, 64))
