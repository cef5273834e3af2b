"""Reference implementations of the ``engram`` family.

Engram gating mixes a looked-up n-gram embedding into the hidden state of each
of the ``hc_mult`` hyper-connection streams of a token.  With ``H`` the hidden
size, ``s = H ** -0.5`` and, per token ``t`` and stream ``h``,

    rstd_x = 1 / sqrt(mean_d(x[t, h, d] ** 2) + eps)
    rstd_k = 1 / sqrt(mean_d(k[t, h, d] ** 2) + eps)
    dot    = sum_d x[t, h, d] * w[h, d] * k[t, h, d]        (w = weight_hidden * weight_embed)
    z      = dot * rstd_x * rstd_k * s                       (= <RMSNorm(x)*wh, RMSNorm(k)*we> / sqrt(H))
    gate   = sigmoid(copysign(sqrt(max(|z|, clamp_value)), z))
    out[t, h, :] = x[t, h, :] + gate * v[t, :]

The functions below keep TileKernels' public signatures (``tile_kernels.engram``)
and return structure.  Arithmetic runs in float32 (float64 when an input is
float64, which is what gradient checks use); bf16 results are rounded once at
the end.  ``dot`` (the saved intermediate) is the *unnormalised* sum above.

Every operation is written out so that its result does not depend on the
device or on torch's reduction kernels, and the kernels reproduce it bit for
bit: products and sums are single float32 roundings (no fused multiply-add),
``/ H`` is an IEEE division, ``rsqrt(m)`` is ``1 / sqrt(m)`` (both correctly
rounded), ``sigmoid(s)`` is ``1 / (1 + exp(-s))`` (``exp`` is the device's:
CUDA ``expf`` on the GPU), and each sum has a fixed order (``_lane_sum``,
``_stream_sum``, the token-chunk sums below).

``engram_hash`` computes embedding-table indices from n-gram token ids.
"""

import torch
import torch.nn.functional as F

__all__ = [
    "engram_gate_fwd",
    "engram_gate_bwd",
    "grad_w_reduce",
    "fused_weight",
    "engram_hash",
    "make_offsets",
]

# Number of partial weight-gradient rows engram_gate_bwd returns for tensors that
# are not on a CUDA device.  On CUDA the kernel uses one row per SM of the device
# (132 on an H200), and so does the reference.  Only grad_w_partial.sum(0) is
# meaningful; the split is a layout detail of the kernel.
DEFAULT_NUM_PERSISTENT_BLOCKS = 132

# Summation orders over the hidden dim (the kernels' layouts).  Element ``d`` of a row
# belongs to lane ``l`` as ``d = (j * lanes + l) * VEC + i``; each lane adds its
# elements in order of ``(j, i)`` into a float32 zero, then the lanes combine as a
# butterfly (``a[l] + a[l ^ s]`` for s = 16, 8, 4, 2, 1 inside 32-lane warps, then
# s = 32, 64, ... across warps).  engram_gate_fwd sums with one warp per
# (token, stream) row (``FWD_LANES``); engram_gate_bwd's ``dL/dgate`` with four
# warps per row (``BWD_LANES``).
VEC = 8
FWD_LANES = 32
BWD_LANES = 128


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (the kernels' accumulation type)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _lane_sum(terms: torch.Tensor, lanes: int) -> torch.Tensor:
    """Sum over the last dim in the kernels' order (see ``VEC``): ``[..., H] -> [...]``."""
    hidden = terms.shape[-1]
    span = lanes * VEC
    padded = -(-hidden // span) * span
    if padded != hidden:  # +0 terms leave a sum that starts at +0 unchanged
        terms = F.pad(terms, (0, padded - hidden))
    split = terms.reshape(*terms.shape[:-1], padded // span, lanes, VEC)
    acc = terms.new_zeros((*terms.shape[:-1], lanes))
    for j in range(padded // span):
        for i in range(VEC):
            acc = acc + split[..., j, :, i]
    offsets = [16, 8, 4, 2, 1] + [32 << b for b in range(max(lanes // 32, 1).bit_length() - 1)]
    lane = torch.arange(lanes, device=terms.device)
    for s in offsets:
        if s < lanes:
            acc = acc + acc[..., lane ^ s]
    return acc[..., 0].contiguous()


def _div(a: torch.Tensor, divisor: float) -> torch.Tensor:
    """``a / divisor`` as an IEEE division on every device (torch turns a division by a
    Python number on CUDA into a multiplication by its float32 reciprocal)."""
    return a / torch.full((), divisor, dtype=a.dtype, device=a.device)


def _rsqrt(m: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(m)``, two correctly rounded operations (the same on every device)."""
    return 1.0 / torch.sqrt(m)


def _sigmoid(s: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-s))``: the device's ``exp``, an IEEE add and an IEEE division."""
    return 1.0 / (torch.exp(-s) + 1.0)


def _stream_sum(terms: torch.Tensor) -> torch.Tensor:
    """Sum over the stream dim (-2), left to right: ``((t0 + t1) + t2) + ...``."""
    acc = terms[..., 0, :]
    for h in range(1, terms.shape[-2]):
        acc = acc + terms[..., h, :]
    return acc


def _num_persistent_blocks(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_PERSISTENT_BLOCKS


def fused_weight(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    """Elementwise product of the two RMSNorm weights, widened to float32.

    Args:
        weight_hidden: ``[hc_mult, H]``, bfloat16.
        weight_embed: ``[hc_mult, H]``, bfloat16.

    Returns:
        ``[hc_mult, H]`` float32 (float64 for float64 inputs), contiguous:
        ``float(weight_hidden) * float(weight_embed)``.  For bf16 inputs the
        product has at most 16 significant bits, so it is exact in float32.
    """
    dtype = _compute_dtype(weight_hidden, weight_embed)
    return weight_hidden.to(dtype) * weight_embed.to(dtype)


def engram_gate_fwd(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Engram gate forward (see the module docstring for the math).

    Args:
        hidden_states: ``[T, hc_mult, H]`` bfloat16 (``x``).
        k: ``[T, hc_mult, H]`` bfloat16 key embeddings; may be strided
            (``k.stride(-1) == 1``).
        v: ``[T, H]`` bfloat16 value embeddings, shared by the ``hc_mult``
            streams; may be row-strided.
        weight_fused: ``[hc_mult, H]`` float32, ``fused_weight(wh, we)``.
        eps: RMSNorm epsilon, added to the mean square.
        clamp_value: lower clamp of ``|z|`` inside the signed square root.
        save_for_backward: when False, the four intermediates are ``None``.

    Returns:
        ``(output, dot, gate_score, rstd_x, rstd_k)``: ``output`` is
        ``[T, hc_mult, H]`` of ``hidden_states.dtype``, contiguous, computed
        as ``x + gate * v`` in float32 and rounded once; ``dot`` (the raw
        ``sum_d x * w * k``), ``gate_score``, ``rstd_x`` and ``rstd_k`` are
        ``[T, hc_mult]`` float32 (float64 for float64 inputs), contiguous.
    """
    hidden_size = hidden_states.shape[-1]
    scalar = hidden_size**-0.5
    dtype = _compute_dtype(hidden_states, k, v, weight_fused)
    x = hidden_states.to(dtype)
    kf = k.to(dtype)
    w = weight_fused.to(dtype)

    # (x * w) * k, one rounding per product; sums in the kernel's order (_lane_sum).
    dot = _lane_sum(x * w * kf, FWD_LANES)
    rstd_x = _rsqrt(_div(_lane_sum(x * x, FWD_LANES), hidden_size) + eps)
    rstd_k = _rsqrt(_div(_lane_sum(kf * kf, FWD_LANES), hidden_size) + eps)

    z = dot * rstd_x * rstd_k * scalar
    # copysign (not sign(z) * ...): z == +0 gives +sqrt(clamp_value), as the kernel does.
    gate_score = _sigmoid(torch.copysign(z.abs().clamp_min(clamp_value).sqrt(), z))

    output = (x + gate_score.unsqueeze(-1) * v.to(dtype).unsqueeze(-2)).to(hidden_states.dtype)
    if not save_for_backward:
        return output, None, None, None, None
    return output, dot, gate_score, rstd_x, rstd_k


def engram_gate_bwd(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_fused: torch.Tensor,
    dot: torch.Tensor,
    gate_score: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    clamp_value: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Engram gate backward from the forward's saved intermediates.

    With ``g`` the upstream gradient ``grad_out`` and ``c = s * rstd_x * rstd_k``
    (``z = dot * c``), per token and stream:

        dL/dgate = sum_d g[d] * v[d]
        r        = 0                                              if |dot| * c < clamp_value
                   dL/dgate * gate * (1 - gate) * 0.5 * sqrt(c / |dot|)   otherwise
                 (= dL/d dot: the clamp makes the gate flat below the threshold)
        grad_x   = g + r * (w * k - x * dot * rstd_x**2 / H)
        grad_k   =     r * (w * x - k * dot * rstd_k**2 / H)
        grad_v   = sum_h g[h] * gate[h]
        dL/dw    = sum_t r * x * k                      (w = weight_hidden * weight_embed)

    Args:
        grad_out: ``[T, hc_mult, H]`` bfloat16.
        hidden_states, k, v, weight_fused: the forward's inputs.
        dot, gate_score, rstd_x, rstd_k: ``[T, hc_mult]`` float32 from
            ``engram_gate_fwd(..., save_for_backward=True)``.
        clamp_value: the forward's clamp value.

    Returns:
        ``(grad_hidden_states, grad_k, grad_v, grad_w_partial)``: the first
        three have the shapes and dtypes of ``hidden_states``, ``k`` and ``v``
        (contiguous); ``grad_w_partial`` is ``[P, hc_mult, H]`` float32, the
        ``dL/dw`` sum split over ``P`` contiguous token chunks of
        ``ceil(T / P)`` tokens (chunk ``p`` covers tokens
        ``[p * ceil(T/P), (p+1) * ceil(T/P))``; empty chunks are zero).  ``P``
        is the SM count of a CUDA device, else ``DEFAULT_NUM_PERSISTENT_BLOCKS``.
        Reduce it with ``grad_w_reduce``.
    """
    num_tokens, hc_mult, hidden_size = hidden_states.shape
    scalar = hidden_size**-0.5
    dtype = _compute_dtype(grad_out, hidden_states, k, v, weight_fused, dot, gate_score, rstd_x, rstd_k)
    g = grad_out.to(dtype)
    x = hidden_states.to(dtype)
    kf = k.to(dtype)
    vf = v.to(dtype)
    w = weight_fused.to(dtype)
    dot, gate, rx, rk = (t.to(dtype) for t in (dot, gate_score, rstd_x, rstd_k))

    dl_dgate = _lane_sum(g * vf.unsqueeze(1), BWD_LANES)
    abs_dot = dot.abs()
    clamped = abs_dot * scalar * rx * rk < clamp_value
    # The sqrt branch may be inf/nan where dot == 0; torch.where discards it there.
    r = torch.where(
        clamped,
        torch.zeros_like(dot),
        dl_dgate * gate * (1.0 - gate) * 0.5 * torch.sqrt(scalar * rx * rk / abs_dot),
    )
    r3 = r.unsqueeze(-1)

    dot_x = _div(dot * rx * rx, hidden_size).unsqueeze(-1)
    dot_k = _div(dot * rk * rk, hidden_size).unsqueeze(-1)
    grad_x = g + r3 * (kf * w - x * dot_x)
    grad_k = r3 * (x * w - kf * dot_k)
    grad_v = _stream_sum(g * gate.unsqueeze(-1))

    # Per-token weight-gradient terms (r * x) * k, summed over P contiguous chunks of
    # tokens, each in token order from a zero.
    num_blocks = _num_persistent_blocks(hidden_states.device)
    per_block = -(-num_tokens // num_blocks)
    terms = r3 * x * kf
    padded = terms.new_zeros((num_blocks * per_block, hc_mult, hidden_size))
    padded[:num_tokens] = terms
    chunks = padded.view(num_blocks, per_block, hc_mult, hidden_size)
    grad_w_partial = terms.new_zeros((num_blocks, hc_mult, hidden_size))
    for i in range(per_block):
        grad_w_partial = grad_w_partial + chunks[:, i]

    return (
        grad_x.to(hidden_states.dtype),
        grad_k.to(k.dtype).contiguous(),
        grad_v.to(v.dtype).contiguous(),
        grad_w_partial,
    )


def grad_w_reduce(
    grad_w_partial: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    grad_weight_hidden: torch.Tensor,
    grad_weight_embed: torch.Tensor,
) -> None:
    """Finish the weight gradients, accumulating in place.

    With ``G = grad_w_partial.sum(0)`` (``dL/dw`` for ``w = wh * we``):
    ``grad_weight_hidden += G * we`` and ``grad_weight_embed += G * wh``.

    Args:
        grad_w_partial: ``[P, hc_mult, H]`` float32 from ``engram_gate_bwd``.
        weight_hidden: ``[hc_mult, H]`` bfloat16.
        weight_embed: ``[hc_mult, H]`` bfloat16.
        grad_weight_hidden: ``[hc_mult, H]`` float32, updated in place.
        grad_weight_embed: ``[hc_mult, H]`` float32, updated in place.

    Returns:
        None.
    """
    # rows added in order into a zero (the kernel's order); products and sums rounded apart
    total = grad_w_partial.new_zeros(grad_w_partial.shape[1:])
    for p in range(grad_w_partial.shape[0]):
        total = total + grad_w_partial[p]
    grad_weight_hidden.add_(total * weight_embed.to(total.dtype))
    grad_weight_embed.add_(total * weight_hidden.to(total.dtype))


def make_offsets(vocab_sizes: torch.Tensor) -> torch.Tensor:
    """Start of each embedding table in a layer's concatenated tables.

    Args:
        vocab_sizes: ``[L, n - 1, E]`` int32 table sizes.

    Returns:
        ``[L, (n - 1) * E]`` int32: the exclusive prefix sum of each layer's
        flattened sizes (first entry 0).
    """
    flat = vocab_sizes.reshape(vocab_sizes.shape[0], -1).to(torch.int64)
    return (flat.cumsum(dim=1) - flat).to(torch.int32)


def engram_hash(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Embedding indices of each token's n-grams, per layer and table.

    For layer ``l``, token ``t`` and n-gram length ``i + 1`` (``i = 1 .. n-1``):

        h_i = XOR_{j <= i} (int64(ids[t, j]) * multipliers[l, j])     (int64, wrapping)
        out[l, t, (i-1) * E + e] = int32(h_i mod vocab_sizes[l, i-1, e] + offsets[l, (i-1) * E + e])

    where ``mod`` is the floor modulo (Python's ``%``: the result takes the
    sign of the table size, so a negative ``h_i`` still lands in
    ``[0, size)``), which is what the kernel computes (TileLang's ``%`` is a
    floor modulo), and the final cast to int32 wraps.

    Args:
        ngram_token_ids: ``[T, n]`` int32.
        multipliers: ``[L, n]`` int64.
        vocab_sizes: ``[L, n - 1, E]`` int32.
        offsets: ``[L, (n - 1) * E]`` int32 (see ``make_offsets``).

    Returns:
        ``[L, T, (n - 1) * E]`` int32, contiguous.
    """
    max_ngram_size = ngram_token_ids.shape[1]
    # [L, T, n] products; int64 multiplication wraps like the kernel's.
    products = ngram_token_ids.to(torch.int64).unsqueeze(0) * multipliers.to(torch.int64).unsqueeze(1)
    sizes = vocab_sizes.to(torch.int64).unsqueeze(1)  # [L, 1, n - 1, E]
    running = products[..., 0]
    columns = []
    for i in range(1, max_ngram_size):
        running = running ^ products[..., i]
        columns.append(torch.remainder(running.unsqueeze(-1), sizes[:, :, i - 1]))
    if columns:
        hashed = torch.cat(columns, dim=-1)
    else:
        hashed = products.new_empty((*products.shape[:2], 0))
    return (hashed + offsets.to(torch.int64).unsqueeze(1)).to(torch.int32)
