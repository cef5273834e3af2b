"""transpose.transpose / batched_transpose against the reference: every prebuilt dtype,
both 64- and 128-multiples, strided rows, batches."""

import pytest
import torch

from tile_kernels_aot import transpose as tp
from tile_kernels_aot.torch import transpose as ref

from checks import assert_bits_equal, poisoned, prebuilt_configs

DTYPES = sorted({c["dtype"] for c in prebuilt_configs("transpose.batched_transpose")})


def _random(shape, dtype, gen):
    x = torch.randn(shape, generator=gen, device="cuda")
    return (x * 64).to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", [(64, 64), (128, 64), (64, 192), (256, 384), (576, 7168), (4096, 2048)])
def test_transpose(dtype, m, n, gen):
    x = _random((m, n), dtype, gen)
    expected = ref.transpose(x.cpu())
    out = poisoned((n, m), x.dtype)
    assert tp.transpose(x, out=out) is out
    assert_bits_equal(out, expected, f"transpose {m}x{n} {dtype}")
    assert_bits_equal(tp.transpose(x), expected, "allocated")


@pytest.mark.parametrize("dtype", DTYPES)
# pad 4: rows 4-element aligned only (8 bytes for bf16, 4 for fp8): the kernel's narrow-load path
@pytest.mark.parametrize("b,m,n,pad", [(1, 64, 64, 0), (3, 128, 192, 64), (8, 448, 320, 16), (8, 448, 320, 4),
                                       (2, 1024, 7168, 128)])
def test_batched_strided(dtype, b, m, n, pad, gen):
    base = _random((b, m, n + pad), dtype, gen)
    x = base[:, :, :n]  # rows strided by n + pad
    expected = ref.batched_transpose(x.cpu())
    out = poisoned((b, n, m), x.dtype)
    assert tp.batched_transpose(x, out=out) is out
    assert_bits_equal(out, expected, f"batched {b}x{m}x{n}+{pad} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_offset_start(dtype, gen):
    base = _random((256, 64 * 5 + 4), dtype, gen)
    x = base[:, 4:]  # data pointer 4 elements past an aligned allocation
    assert_bits_equal(tp.transpose(x), ref.transpose(x.cpu()), f"offset start {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_back_to_back_reads_previous_output(dtype, gen):
    """Seven transposes queued back to back, each reading the output of the one before: the
    first blocks of a grid start while the previous grid still writes that output, and
    prefetch it into L2 before they wait for that grid."""
    x = _random((8192, 4096), dtype, gen)
    outs = [poisoned((4096, 8192), x.dtype), poisoned((8192, 4096), x.dtype)]
    y = x
    for i in range(7):
        y = tp.transpose(y, out=outs[i % 2])
    assert_bits_equal(y, ref.transpose(x.cpu()), f"seven back-to-back transposes {dtype}")
    assert_bits_equal(outs[1], x, f"six back-to-back transposes {dtype}")


def test_rejects_bad_shapes():
    x = torch.randn(96, 64, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="transpose"):
        tp.transpose(x)
    with pytest.raises(ValueError, match="batched_transpose"):
        tp.batched_transpose(torch.randn(64, 64, device="cuda").bfloat16())
