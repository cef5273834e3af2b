"""Reference implementations of the fused SwiGLU + FP8 quantization family.

SwiGLU here acts on a row ``x = [l | r]`` of width ``2 * hidden`` (``l`` is the
left half, the gate; ``r`` the right half, the value) and yields
``silu(l) * r`` of width ``hidden``.

Arithmetic contract (shared by every function below, and what a kernel must do
to be bit-exact against these references):

* Everything is float32.  Inputs are widened to float32 first (bf16 exactly,
  FP8 as ``float(q) * sf``, one float32 multiply).
* Optional clamp with ``c = float32(swiglu_clamp_value)``:
  ``l <- min(l, c)`` and ``r <- min(max(r, -c), c)``.  The counters, when
  kept, count ``l > c``, ``r > c`` and ``r < -c`` on the unclamped values.
* ``silu(l) * r`` is evaluated as ``(l / (1 + exp(-l))) * r``: one float32
  ``exp`` (CUDA ``expf``, not ``__expf``), one IEEE add, one IEEE divide, one
  multiply, in that order.  A routing weight, when present, multiplies last:
  ``((l / (1 + exp(-l))) * r) * w``.  In the forward functions the quotient is
  -0 for ``l <= -87.5`` (there ``exp(-l) >= 2^126`` and its magnitude is below
  2^-119; the kernels' divide flushes it, and below about -88.72, where
  ``exp(-l)`` overflows to inf, the IEEE quotient is -0 anyway).
* Every division is an IEEE float32 division (never a multiplication by a
  reciprocal; PyTorch's scalar divisions are avoided for that reason).
* The backward pass has one fused multiply-add, ``fma(l, 1 - s, 1)`` (nvcc
  contracts ``1 + l * (1 - s)`` in TileKernels' kernel): computed here with a
  single rounding, exactly.
* Float32 ``exp`` is the only operation that is not correctly rounded: these
  references use ``torch.exp`` of the device they run on.  Run them on the GPU
  (CUDA ``expf``) when comparing with a kernel bit for bit; on the CPU the
  last bit of ``exp`` can differ.
* NaN and Inf inputs are outside the contract.

The FP8 (``e4m3``) casts follow TileKernels' rules: the scale factor of a
group is derived from the absolute maximum of the float32 values of the group
(for the per-token casts, the float32 *product*, weight included), clamped
from below (``1e-4`` unless told otherwise), ``sf = amax / 448`` and values are
quantized as ``fp8(clamp(v * (448 / amax), -448, 448))`` (round to nearest
even); with ``round_sf`` the scale is rounded up to a power of two first and
values are multiplied by its exact inverse.  The scale-factor arithmetic, the
encoding and the sf layouts are the quant family's primitives
(:mod:`tile_kernels_aot.torch.quant`).
"""

from typing import Optional, Tuple

import torch

from .quant import layout_scale_factors, quantize_with_scales, scale_factors_from_amax

__all__ = [
    "swiglu_forward",
    "swiglu_backward",
    "swiglu_forward_and_per_token_cast",
    "swiglu_backward_and_per_token_cast",
    "swiglu_forward_and_per_channel_cast_and_transpose",
]

QuantTensor = Tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------

def _fail(op: str, arg: str, expected: str, got, exc=ValueError):
    raise exc(f"{op}: `{arg}` must be {expected}, got {got}")


def _check_tensor(op, name, t, *, dim=None, dtypes=None, contiguous=False):
    if not isinstance(t, torch.Tensor):
        _fail(op, name, "a torch.Tensor", type(t).__name__, TypeError)
    if dtypes is not None and t.dtype not in dtypes:
        _fail(op, name, "of dtype " + " or ".join(str(d) for d in dtypes), t.dtype, TypeError)
    if dim is not None and t.dim() not in (dim if isinstance(dim, tuple) else (dim,)):
        _fail(op, name, f"{dim}-dimensional", f"shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        _fail(op, name, "contiguous", f"strides {t.stride()}")


def _check_fmt(op, fmt):
    if fmt != "e4m3":
        _fail(op, "fmt", "'e4m3'", repr(fmt))


def _check_routing(op, n, pos_to_token_topk, topk_weights, weights_name="topk_weights"):
    _check_tensor(op, "pos_to_token_topk", pos_to_token_topk, dim=1, dtypes=(torch.int32, torch.int64))
    if pos_to_token_topk.shape[0] != n:
        _fail(op, "pos_to_token_topk", f"of shape ({n},)", tuple(pos_to_token_topk.shape))
    if topk_weights is None:
        _fail(op, weights_name, "given together with pos_to_token_topk", None)
    _check_tensor(op, weights_name, topk_weights, dim=2, dtypes=(torch.float32,))


# ---------------------------------------------------------------------------
# float32 building blocks
# ---------------------------------------------------------------------------

def _f32(value: float) -> float:
    """``value`` rounded to float32 (returned as a Python float, exactly)."""
    return float(torch.tensor(value, dtype=torch.float32))


def _fma_f32(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """``a * b + c`` with a single rounding to float32, like a hardware FMA.

    ``a`` and ``b`` are float32, so ``a * b`` is exact in float64.  The sum with
    ``c`` is rounded to float64 *to odd* (nearest, then one ulp towards the exact
    value when inexact and the last bit is even; the error comes from TwoSum),
    and rounding that to float32 gives the correctly rounded fused result
    (double rounding through round-to-odd is innocuous with 53 >= 24 + 2 bits).
    """
    p = a.double() * b.double()
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)
    even = (s.view(torch.int64) & 1) == 0
    towards = torch.where(err > 0, float("inf"), float("-inf")).to(s.dtype)
    s = torch.where((err != 0) & even, torch.nextafter(s, towards), s)
    return s.float()


def _div(a, b) -> torch.Tensor:
    """Correctly rounded float32 ``a / b``, also when one side is a Python scalar.

    PyTorch divides by a scalar as a multiply by its reciprocal on CUDA, and
    computes ``scalar / tensor`` through a reciprocal on the CPU: neither is the
    IEEE quotient a kernel computes, so scalars become full tensors first.
    """
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(b, a)
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, b)
    return a / b


def _dot_rows_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 ``[n]``: ``sum_j a[:, j] * b[:, j]`` of float32 ``a``, ``b`` ``[n, m]``, the exact sum
    correctly rounded to float32 (up to about ``2^-100`` of the sum of magnitudes).

    The products are exact in float64 (each factor has at most 24 significant bits); they
    are summed pairwise in double-double (TwoSum: each addition's rounding error kept in a
    low part), and the pair ``hi + lo`` is rounded to float64 *to odd* and then to float32,
    which rounds the pair's exact value correctly.  Any summation order accurate to that
    level gives the same float32 (a kernel sums in double-double in its own order).
    """
    hi = a.double() * b.double()
    lo = torch.zeros_like(hi)
    while hi.shape[1] > 1:
        if hi.shape[1] % 2:
            hi = torch.cat([hi, torch.zeros_like(hi[:, :1])], dim=1)
            lo = torch.cat([lo, torch.zeros_like(lo[:, :1])], dim=1)
        x, y = hi[:, 0::2], hi[:, 1::2]
        s = x + y
        bb = s - x
        err = (x - (s - bb)) + (y - bb)
        lo = (lo[:, 0::2] + lo[:, 1::2]) + err
        hi = s
    hi, lo = hi[:, 0], lo[:, 0]
    s = hi + lo
    bb = s - hi
    err = (hi - (s - bb)) + (lo - bb)
    # round to odd: an inexact even s moves one ulp towards the exact value
    bits = s.view(torch.int64)
    step = torch.where((err > 0) == (s > 0), 1, -1)
    bits = torch.where((err != 0) & ((bits & 1) == 0), bits + step, bits)
    return bits.view(torch.float64).float()


def _row_weights(pos_to_token_topk: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """float32 ``[n]``: ``topk_weights.view(-1)[pos]`` where ``pos >= 0``, else 0."""
    pos = pos_to_token_topk.long()
    valid = pos >= 0
    w = torch.zeros(pos.shape[0], dtype=torch.float32, device=topk_weights.device)
    w[valid] = topk_weights.reshape(-1)[pos[valid]]
    return w


def _clamp_halves(left, right, clamp: Optional[float], clamped_count=None, counted_rows=None):
    """Clamp both halves (float32) and add the clamp counts of ``counted_rows``."""
    if clamp is None:
        return left, right
    c = _f32(clamp)
    if clamped_count is not None:
        hits = torch.stack([(left > c), (right > c), (right < -c)])  # [3, n, h]
        if counted_rows is not None:
            hits = hits & counted_rows.view(1, -1, 1)
        clamped_count += hits.sum(dim=(1, 2)).to(clamped_count.dtype)
    return left.clamp(max=c), right.clamp(min=-c, max=c)


SILU_ZERO_BELOW = -87.5  # the forward SiLU's quotient is -0 at or below this l


def _silu_mul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``(l / (1 + exp(-l))) * r`` in float32, in exactly this order (the quotient -0
    for ``l <= -87.5``)."""
    q = _div(left, 1.0 + torch.exp(-left))
    q = torch.where(left <= SILU_ZERO_BELOW, torch.full_like(q, -0.0), q)
    return q * right


# ---------------------------------------------------------------------------
# the per-token FP8 cast of a float32 tensor (primitives from the quant family)
# ---------------------------------------------------------------------------

def _per_token_cast_f32(v, num_per_channels, round_sf, sf_min=None):
    """Per-token e4m3 cast of float32 ``v [n, w]``: fp8 ``[n, w]``, float32 sf ``[n, w / g]``."""
    n, width = v.shape
    amax = v.view(n, width // num_per_channels, num_per_channels).abs().amax(dim=2)
    sf, sf_inv = scale_factors_from_amax(amax, "e4m3", round_sf, clamp_min=sf_min)
    return quantize_with_scales(v, sf_inv, "e4m3", (1, num_per_channels)), sf


# ---------------------------------------------------------------------------
# plain SwiGLU (float32 outputs)
# ---------------------------------------------------------------------------

def swiglu_forward(
    x: torch.Tensor,
    pos_to_token_topk: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    swiglu_clamp_value: Optional[float] = None,
    clamped_count: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """SwiGLU forward in float32, optionally clamped and weighted.

    Args:
        x: ``[n, 2 * hidden]`` bfloat16 or float32, contiguous.
        pos_to_token_topk: optional ``[n]`` int32; row ``i`` is scaled by
            ``topk_weights.view(-1)[pos_to_token_topk[i]]`` (by 0 where < 0).
        topk_weights: ``[num_tokens, num_topk]`` float32, needed with the above.
        swiglu_clamp_value: optional clamp ``c`` (see the module docstring).
        clamped_count: optional ``[3]`` int64, incremented in place by the
            counts of ``l > c``, ``r > c``, ``r < -c`` (ignored without ``c``).

    Returns:
        float32 ``[n, hidden]``: ``((l / (1 + exp(-l))) * r) * w``.
    """
    op = "swiglu_forward"
    _check_tensor(op, "x", x, dim=2, dtypes=(torch.bfloat16, torch.float32), contiguous=True)
    n, width = x.shape
    if width % 2:
        _fail(op, "x", "of even width (2 * hidden)", width)
    hidden = width // 2
    if pos_to_token_topk is not None:
        _check_routing(op, n, pos_to_token_topk, topk_weights)
    if clamped_count is not None and swiglu_clamp_value is None:
        clamped_count = None

    xf = x.float()
    left, right = _clamp_halves(xf[:, :hidden], xf[:, hidden:], swiglu_clamp_value, clamped_count)
    out = _silu_mul(left, right)
    if pos_to_token_topk is not None:
        out = out * _row_weights(pos_to_token_topk, topk_weights).unsqueeze(1)
    return out


def _backward_core(op, x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels,
                   swiglu_clamp_value, out_dtype):
    """Shared by both backward references; returns float32 (act * w, x_grad, weight_grad)."""
    if num_per_channels not in (32, 128):
        _fail(op, "num_per_channels", "32 or 128", num_per_channels)
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        _fail(op, "x", "a (data, sf) pair", type(x).__name__, TypeError)
    x_data, x_sf = x
    _check_tensor(op, "x[0]", x_data, dim=(2, 3), dtypes=(torch.float8_e4m3fn,), contiguous=True)
    _check_tensor(op, "x[1]", x_sf, dim=2, dtypes=(torch.float32,), contiguous=True)
    _check_tensor(op, "grad_out", grad_out, dtypes=out_dtype)
    _check_tensor(op, "weight", weight, dim=2, dtypes=(torch.float32,), contiguous=True)
    _check_tensor(op, "token_topk_to_pos", token_topk_to_pos, dim=2, dtypes=(torch.int32, torch.int64),
                  contiguous=True)
    width = x_data.shape[-1]
    if width % (2 * num_per_channels):
        _fail(op, "x[0]", f"of width a multiple of 2 * num_per_channels = {2 * num_per_channels}", width)
    hidden = width // 2
    x_data = x_data.reshape(-1, width)
    n = x_data.shape[0]
    if grad_out.numel() != n * hidden:
        _fail(op, "grad_out", f"of {n} x {hidden} elements", tuple(grad_out.shape))
    grad_out = grad_out.reshape(n, hidden)
    if tuple(x_sf.shape) != (n, width // num_per_channels):
        _fail(op, "x[1]", f"of shape {(n, width // num_per_channels)}", tuple(x_sf.shape))
    if tuple(weight.shape) != tuple(token_topk_to_pos.shape):
        _fail(op, "weight", f"of shape {tuple(token_topk_to_pos.shape)}", tuple(weight.shape))
    _check_routing(op, n, pos_to_token_topk, weight, "weight")

    # dequantize: one float32 multiply per element
    xf = (x_data.float().view(n, width // num_per_channels, num_per_channels) * x_sf.unsqueeze(-1)).view(n, width)
    left, right = xf[:, :hidden], xf[:, hidden:]
    if swiglu_clamp_value is not None:
        c = _f32(swiglu_clamp_value)
        left_clamped = left > c
        right_clamped = (right > c) | (right < -c)
        left, right = left.clamp(max=c), right.clamp(min=-c, max=c)

    w = _row_weights(pos_to_token_topk, weight).unsqueeze(1)
    g = grad_out.float()
    denom = 1.0 + torch.exp(-left)
    act = _div(left, denom) * right
    sig = _div(1.0, denom)
    g_ws = g * w * sig
    grad_left = g_ws * right * _fma_f32(left, 1.0 - sig, 1.0)
    grad_right = g_ws * left
    if swiglu_clamp_value is not None:
        grad_left = grad_left.masked_fill(left_clamped, 0.0)
        grad_right = grad_right.masked_fill(right_clamped, 0.0)
    x_grad = torch.cat([grad_left, grad_right], dim=1)

    # d(out)/d(w) = sum_j grad_out * act: exact products, the sum correctly rounded
    dots = _dot_rows_f32(g, act)
    pos = pos_to_token_topk.long()
    valid = pos >= 0
    weight_grad = torch.zeros_like(weight)
    weight_grad.view(-1)[pos[valid]] = dots[valid]
    return act * w, x_grad, weight_grad


def swiglu_backward(
    x: QuantTensor,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    pos_to_token_topk: torch.Tensor,
    token_topk_to_pos: torch.Tensor,
    num_per_channels: int,
    swiglu_clamp_value: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SwiGLU backward from an FP8 input, in float32.

    Args:
        x: ``(data, sf)``: data ``[n, 2 * hidden]`` (or ``[b, m, 2 * hidden]``)
            float8_e4m3fn, sf ``[n, 2 * hidden / num_per_channels]`` float32
            (row-major); ``x = float(data) * sf`` per group of channels.
        grad_out: ``n * hidden`` elements (bfloat16 or float32), gradient of the
            weighted output.
        weight: ``[num_tokens, num_topk]`` float32 routing weights.
        pos_to_token_topk: ``[n]`` int32, flat (token, k) index of each row, < 0
            for padding rows (weight 0).
        token_topk_to_pos: ``[num_tokens, num_topk]`` int32 (only its shape is used).
        num_per_channels: 32 or 128.
        swiglu_clamp_value: optional clamp ``c``; clamped inputs get gradient 0.

    Returns:
        ``(out, x_grad, weight_grad)``, float32:
        ``out [n, hidden] = act * w`` with ``act = (l / d) * r``, ``d = 1 + exp(-l)``;
        ``x_grad [n, 2 * hidden] = [gl | gr]`` with ``s = 1 / d``,
        ``gws = (grad_out * w) * s``, ``gl = (gws * r) * fma(l, 1 - s, 1)``,
        ``gr = gws * l`` (zero where clamped);
        ``weight_grad [num_tokens, num_topk]``: at each row's (token, k), the
        dot product ``sum(grad_out * act)``, the exact sum of the exact products
        correctly rounded to float32 (see ``_dot_rows_f32``); 0 where no row maps.
    """
    out, x_grad, weight_grad = _backward_core(
        "swiglu_backward", x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels,
        swiglu_clamp_value, (torch.bfloat16, torch.float32))
    return out, x_grad, weight_grad


# ---------------------------------------------------------------------------
# fused ops (TileKernels' public kernel API)
# ---------------------------------------------------------------------------

def swiglu_forward_and_per_token_cast(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    pos_to_token_topk: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    pos_to_expert: Optional[torch.Tensor] = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    swiglu_clamp_value: Optional[float] = None,
    clamped_count: Optional[torch.Tensor] = None,
    sf_clamp_min: Optional[float] = None,
) -> QuantTensor:
    """SwiGLU forward fused with a per-token FP8 (e4m3) cast.

    Args:
        x: ``[n, 2 * hidden]`` bfloat16 or float32, contiguous; ``hidden % 128 == 0``.
        fmt: ``'e4m3'``.
        num_per_channels: channels per scale factor, 128 or ``hidden``.
        pos_to_token_topk: optional ``[n]`` int32: row ``i`` is weighted by
            ``w_i = topk_weights.view(-1)[pos_to_token_topk[i]]`` when that index
            is >= 0, and by ``w_i = 0`` when it is < 0 (TileKernels' kernel reads
            an uninitialised weight there: padding rows, undefined upstream).
        topk_weights: ``[num_tokens, num_topk]`` float32, with the above.
        pos_to_expert: optional ``[n]`` int32; rows with a value < 0 are skipped:
            not computed, not counted.  TileKernels leaves their output and sf
            unwritten (garbage); this reference returns them as zero bytes (fp8
            ``0x00`` and an sf entry of 0, i.e. 0.0 or a UE8M0 byte 0).
        use_tma_aligned_col_major_sf: sf column-major (needs num_per_channels == 128).
        round_sf: round sf up to a power of two.
        use_packed_ue8m0: sf as UE8M0 bytes packed four to an int32 (needs
            ``use_tma_aligned_col_major_sf`` and ``round_sf``).
        swiglu_clamp_value: optional clamp ``c``: ``l <- min(l, c)``, ``r <- clamp(r, -c, c)``.
        clamped_count: optional ``[3]`` int64 (needs ``c``), incremented in place
            by the counts over the computed rows of ``l > c``, ``r > c``, ``r < -c``.
        sf_clamp_min: lower clamp of amax (default ``1e-4``).

    Math (float32; bit-exact contract for kernels): per element
    ``v = ((l / (1 + exp(-l))) * r) * w`` (``* w`` only with routing);
    per row and group of ``g = num_per_channels`` channels
    ``a = max(max|v|, sf_clamp_min)``, then either ``sf = a / 448`` and
    ``out = e4m3(clamp(v * (448 / a), +-448))`` (two separate IEEE divides), or
    with ``round_sf`` ``sf = 2^ceil(log2(a / 448))`` and ``out = e4m3(v * (1 / sf))``.

    Returns:
        ``(out, out_sf)``: ``out`` ``[n, hidden]`` float8_e4m3fn; ``out_sf`` with
        ``k = hidden / g``: float32 ``[n, k]`` row-major; or, column-major,
        float32 ``[n, k]`` with strides ``(1, align(n, 4))``; or, packed,
        int32 ``[n, ceil(k / 4)]`` with strides ``(1, align(n, 4))`` whose byte
        ``j`` (little-endian) of word ``[i, q]`` is the biased exponent of the
        sf of group ``4 * q + j`` (0 for groups past ``k``).
    """
    op = "swiglu_forward_and_per_token_cast"
    _check_tensor(op, "x", x, dim=2, dtypes=(torch.bfloat16, torch.float32), contiguous=True)
    _check_fmt(op, fmt)
    n, width = x.shape
    hidden = width // 2
    if width % 2 or hidden % 128:
        _fail(op, "x", "of width 2 * hidden with hidden a multiple of 128", width)
    if num_per_channels not in (128, hidden):
        _fail(op, "num_per_channels", f"128 or hidden ({hidden})", num_per_channels)
    if use_tma_aligned_col_major_sf and num_per_channels != 128:
        _fail(op, "num_per_channels", "128 with use_tma_aligned_col_major_sf", num_per_channels)
    if use_packed_ue8m0 and not (use_tma_aligned_col_major_sf and round_sf):
        _fail(op, "use_packed_ue8m0", "combined with use_tma_aligned_col_major_sf=True and round_sf=True",
              f"use_tma_aligned_col_major_sf={use_tma_aligned_col_major_sf}, round_sf={round_sf}")
    if sf_clamp_min is not None and not sf_clamp_min > 0:
        _fail(op, "sf_clamp_min", "positive (or None for 1e-4)", sf_clamp_min)
    if pos_to_token_topk is not None:
        _check_routing(op, n, pos_to_token_topk, topk_weights)
    if pos_to_expert is not None:
        _check_tensor(op, "pos_to_expert", pos_to_expert, dim=1, dtypes=(torch.int32, torch.int64))
        if pos_to_expert.shape[0] != n:
            _fail(op, "pos_to_expert", f"of shape ({n},)", tuple(pos_to_expert.shape))
    if clamped_count is not None:
        if swiglu_clamp_value is None:
            _fail(op, "clamped_count", "None when swiglu_clamp_value is None", "a tensor")
        _check_tensor(op, "clamped_count", clamped_count, dim=1, dtypes=(torch.int64,))
        if clamped_count.shape[0] != 3:
            _fail(op, "clamped_count", "of shape (3,)", tuple(clamped_count.shape))

    kept = None if pos_to_expert is None else pos_to_expert >= 0
    xf = x.float()
    left, right = _clamp_halves(xf[:, :hidden], xf[:, hidden:], swiglu_clamp_value, clamped_count, kept)
    v = _silu_mul(left, right)
    if pos_to_token_topk is not None:
        v = v * _row_weights(pos_to_token_topk, topk_weights).unsqueeze(1)

    out, sf = _per_token_cast_f32(v, num_per_channels, round_sf, sf_clamp_min)
    if kept is not None:
        out = out.view(torch.uint8).masked_fill(~kept.unsqueeze(1), 0).view(torch.float8_e4m3fn)
        sf = sf.masked_fill(~kept.unsqueeze(1), 0.0)
    return out, layout_scale_factors(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def swiglu_backward_and_per_token_cast(
    x: QuantTensor,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    pos_to_token_topk: torch.Tensor,
    token_topk_to_pos: torch.Tensor,
    num_per_channels: int,
    round_sf: bool = False,
    swiglu_clamp_value: Optional[float] = None,
) -> Tuple[torch.Tensor, QuantTensor, torch.Tensor, torch.Tensor]:
    """SwiGLU backward fused with a per-token FP8 cast of the input gradient.

    Args:
        x: ``(data, sf)``: data ``[n, 2 * hidden]`` (or ``[b, m, 2 * hidden]``)
            float8_e4m3fn contiguous, sf ``[n, 2 * hidden / num_per_channels]``
            float32 row-major; ``hidden % num_per_channels == 0``.
        grad_out: bfloat16, ``n * hidden`` elements.
        weight: ``[num_tokens, num_topk]`` float32 contiguous.
        pos_to_token_topk: ``[n]`` int32 (< 0: padding row, weight 0).
        token_topk_to_pos: ``[num_tokens, num_topk]`` int32.
        num_per_channels: 32 or 128.
        round_sf: round the gradient's sf up to powers of two.
        swiglu_clamp_value: optional clamp ``c``.

    Math: see :func:`swiglu_backward` (float32, ``fma`` single-rounded).  The
    gradient ``x_grad`` (float32) is then cast per token in groups of
    ``num_per_channels`` (groups never straddle the two halves) with the rules
    of the module docstring (``amax`` clamped at ``1e-4``).

    Returns:
        ``(out, (x_grad_fp8, x_grad_sf), x_grad, weight_grad)``:
        ``out [n, hidden]`` bfloat16 (``act * w``), ``x_grad_fp8 [n, 2 * hidden]``
        float8_e4m3fn, ``x_grad_sf [n, 2 * hidden / num_per_channels]`` float32
        row-major, ``x_grad [n, 2 * hidden]`` bfloat16, ``weight_grad
        [num_tokens, num_topk]`` float32.  ``weight_grad`` is the only output
        with a summation (over ``hidden``): the correctly rounded sum, which a
        kernel reproduces bit for bit with a double-double accumulation.
    """
    op = "swiglu_backward_and_per_token_cast"
    out, x_grad, weight_grad = _backward_core(
        op, x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels,
        swiglu_clamp_value, (torch.bfloat16,))
    x_grad_fp8, x_grad_sf = _per_token_cast_f32(x_grad, num_per_channels, round_sf)
    return out.to(torch.bfloat16), (x_grad_fp8, x_grad_sf), x_grad.to(torch.bfloat16), weight_grad


def swiglu_forward_and_per_channel_cast_and_transpose(
    x: torch.Tensor,
    fmt: str,
    num_per_tokens: int,
    round_sf: bool = False,
    without_transpose: bool = False,
    swiglu_clamp_value: Optional[float] = None,
) -> QuantTensor:
    """SwiGLU forward, rounded to bfloat16, fused with a per-channel FP8 cast.

    Args:
        x: ``[n, 2 * hidden]`` bfloat16 contiguous; ``n % 128 == 0`` and
            ``(2 * hidden) % 128 == 0``.
        fmt: ``'e4m3'``.
        num_per_tokens: tokens per scale factor, 32 or 128.
        round_sf: round sf up to powers of two.
        without_transpose: keep the ``[n, hidden]`` layout instead of ``[hidden, n]``.
        swiglu_clamp_value: optional clamp ``c`` (a compile-time constant of the
            kernel: a static parameter).

    Math: ``act = bf16(((l / (1 + exp(-l))) * r))`` in float32 then rounded to
    bfloat16 (round to nearest even); for each channel ``j`` and block ``b`` of
    ``num_per_tokens`` consecutive tokens, ``a = max(max_t |act[t, j]|, 1e-4)``
    and ``sf``/``out`` as in the module docstring.

    Returns:
        ``(out, out_sf)``: ``out`` float8_e4m3fn ``[hidden, n]`` contiguous (the
        transpose), or ``[n, hidden]`` with ``without_transpose``; ``out_sf``
        float32 ``[n / num_per_tokens, hidden]`` row-major (never transposed).
    """
    op = "swiglu_forward_and_per_channel_cast_and_transpose"
    _check_fmt(op, fmt)
    _check_tensor(op, "x", x, dim=2, dtypes=(torch.bfloat16,), contiguous=True)
    n, width = x.shape
    if n % 128:
        _fail(op, "x", "of a row count that is a multiple of 128", n)
    if width % 128:
        _fail(op, "x", "of a width (2 * hidden) that is a multiple of 128", width)
    if num_per_tokens not in (32, 128):
        _fail(op, "num_per_tokens", "32 or 128", num_per_tokens)
    hidden = width // 2

    xf = x.float()
    left, right = _clamp_halves(xf[:, :hidden], xf[:, hidden:], swiglu_clamp_value)
    act = _silu_mul(left, right).to(torch.bfloat16).float()
    amax = act.view(n // num_per_tokens, num_per_tokens, hidden).abs().amax(dim=1)
    sf, sf_inv = scale_factors_from_amax(amax, "e4m3", round_sf)
    out = quantize_with_scales(act, sf_inv, "e4m3", (num_per_tokens, 1))
    if not without_transpose:
        out = out.T.contiguous()
    return out, sf
