"""Transpose references against TileKernels 1.0.0.

TileKernels ships no torch reference for transpose: its own test defines the
result as ``x.T.contiguous()`` / ``torch.transpose(x, 1, 2).contiguous()``
on inputs drawn as bf16 ``randn`` (then cast to e4m3 for fp8), with a row
stride of twice the width for the 2-D case.  This file checks that our public
signatures match upstream's kernel API and that our references equal
upstream's test definition, bit for bit, on upstream's own kind of inputs.
The element-by-element definition on random bit patterns is checked in
tests/cpu/test_ref_transpose.py.
"""

import inspect

import pytest

tile_kernels = pytest.importorskip("tile_kernels")

import torch  # noqa: E402
import tile_kernels.transpose as tk_transpose  # noqa: E402

from tile_kernels_aot.torch import transpose as ref  # noqa: E402

DTYPES = [torch.float8_e4m3fn, torch.bfloat16, torch.float32]


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", ["transpose", "batched_transpose"])
def test_signature_matches_upstream(name):
    assert _params(getattr(ref, name)) == _params(getattr(tk_transpose, name))


def _upstream_input(shape, dtype, gen, twice_stride):
    x = torch.randn(shape, dtype=torch.bfloat16, generator=gen)
    x = x.to(dtype)
    if twice_stride:
        buf = x.new_empty((*shape[:-1], shape[-1] * 2))
        x_view = buf[..., : shape[-1]]
        x_view.copy_(x)
        x = x_view
        assert not x.is_contiguous()
    return x


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    torch.testing.assert_close(a.view(view), b.view(view), rtol=0, atol=0)


# Upstream: tokens 4001/8001 aligned to 64, hidden in 576..7168.  We keep one
# full-size token count and a few hidden sizes so the CPU run stays short.
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
@pytest.mark.parametrize("shape", [(4032, 576), (4032, 2560), (1024, 7168)], ids=str)
def test_transpose_equals_upstream_definition(shape, dtype):
    gen = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    x = _upstream_input(shape, dtype, gen, twice_stride=True)
    _same_bits(ref.transpose(x), x.T.contiguous())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8, 576, 2048), (32, 128, 576)], ids=str)
def test_batched_transpose_equals_upstream_definition(shape, dtype):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[2])
    x = _upstream_input(shape, dtype, gen, twice_stride=False)
    _same_bits(ref.batched_transpose(x), torch.transpose(x, 1, 2).contiguous())
