"""Reference implementations of the ``transpose`` family.

Both operators swap the last two dimensions of a tensor and return the result
in a fresh, contiguous (row-major) buffer.  A transpose only moves elements,
so the result is a bitwise permutation of the input: no value is rounded,
canonicalised or converted (NaN payloads and signed zeros survive as they
are).  That makes the references dtype-agnostic; the kernels cover bfloat16,
float32 and float8_e4m3fn.

Kernel-side layout contract (what the TileKernels kernel accepts; the
references below accept more and are exact for anything the kernel accepts):

* the last dimension is unit-stride (``x.stride(-1) == 1``); rows may be
  padded, i.e. ``x.stride(-2) >= x.shape[-1]`` (a multiple of 4 elements);
* for the batched form, consecutive matrices are ``M * x.stride(-2)``
  elements apart (a row-strided view of a ``[B, M, N_padded]`` buffer);
* ``M`` and ``N`` are multiples of 64.
"""

import torch

__all__ = ["transpose", "batched_transpose"]


def batched_transpose(x: torch.Tensor) -> torch.Tensor:
    """Transpose every matrix of a batch: ``out[b, j, i] = x[b, i, j]``.

    Args:
        x: ``[B, M, N]`` tensor of any dtype (the kernels cover bfloat16,
            float32 and float8_e4m3fn); rows may be strided.

    Returns:
        ``[B, N, M]`` tensor of ``x.dtype`` on ``x.device``, contiguous
        (strides ``(N * M, M, 1)``), holding the same bits as ``x``.
        Empty inputs give an empty output of that shape.
    """
    if x.dim() != 3:
        raise ValueError(
            f"batched_transpose: x must be 3-D [B, M, N], got shape {tuple(x.shape)}"
        )
    num_batches, rows, cols = x.shape
    out = torch.empty((num_batches, cols, rows), dtype=x.dtype, device=x.device)
    # copy_ moves raw elements between same-dtype tensors, so every bit
    # pattern (including float8 NaNs) is preserved.
    out.copy_(x.permute(0, 2, 1))
    return out


def transpose(x: torch.Tensor) -> torch.Tensor:
    """Transpose one matrix: ``out[j, i] = x[i, j]``.

    Args:
        x: ``[M, N]`` tensor of any dtype (the kernels cover bfloat16, float32
            and float8_e4m3fn); rows may be strided (``x.stride(-1) == 1``,
            ``x.stride(0) >= N``).

    Returns:
        ``[N, M]`` tensor of ``x.dtype`` on ``x.device``, contiguous (strides
        ``(M, 1)``), holding the same bits as ``x``.
    """
    if x.dim() != 2:
        raise ValueError(f"transpose: x must be 2-D [M, N], got shape {tuple(x.shape)}")
    return batched_transpose(x.unsqueeze(0)).squeeze(0)
