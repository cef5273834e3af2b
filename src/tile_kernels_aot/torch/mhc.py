"""Reference implementations of the manifold hyper-connection (mHC) operators.

mHC keeps ``M`` (``mhc_mult``, 4 in practice) parallel residual streams per
token instead of one.  Around every sublayer (attention or FFN):

* ``mhc_pre_norm_fn``: an RMS-normalised projection of the flattened streams,
  ``mixes = (x @ fn.T) * rsqrt(mean(x**2) + eps)``, with ``M * (M + 2)``
  outputs per token;
* ``mhc_pre_split_mixes``: splits ``mixes`` into a pre mix (``M`` weights that
  collapse the streams into the sublayer input), a post mix (``M`` weights that
  spread the sublayer output back over the streams) and an ``M x M`` stream
  mixing matrix;
* ``sinkhorn_normalize``: makes that matrix (nearly) doubly stochastic;
* ``mhc_pre_apply_mix``: the sublayer input ``sum_m pre[m] * x[m]``;
* ``mhc_post``: the new streams ``post[n] * y + sum_m comb[m, n] * x[m]``.

``expand_to_mhc`` copies an embedding into ``M`` streams, ``mhc_head_compute_mix``
computes the weights in front of the LM head, ``mhc_pre_big_fuse`` is the
inference-time fusion of the whole pre path, and ``mhc_multilayer_recompute``
recomputes the sublayer inputs and streams of several layers from the saved
mixes (activation recomputation in training).

Every forward function keeps the signature of the TileKernels 1.0.0 operator of
the same name (``tile_kernels.modeling.mhc.ops``).  The ``*_bwd`` functions are
references for the backward kernels; they take the gradients of the outputs and
the forward inputs and return the gradients of the inputs.

Precision contract (what the kernels do):  bf16 activations (streams, sublayer
input/output) and float32 mixes, scales and weights; all arithmetic in float32;
bf16 outputs are rounded once at the end.  Every function is also dtype-generic
so that it can be checked with ``torch.autograd.gradcheck``: when any floating
input is float64 the arithmetic runs in float64, and outputs keep the dtype of
the input they correspond to.  Arguments that only steer how a kernel schedules
its work or hands gradients around (``n_splits``, ``fuse_grad_acc`` of
``mhc_pre_norm_fn``) are accepted and do not change the result.
"""

from __future__ import annotations

import torch

__all__ = [
    "expand_to_mhc",
    "expand_to_mhc_bwd",
    "sinkhorn_normalize",
    "sinkhorn_normalize_bwd",
    "mhc_pre_split_mixes",
    "mhc_pre_split_mixes_bwd",
    "mhc_head_compute_mix",
    "mhc_head_compute_mix_bwd",
    "mhc_pre_apply_mix",
    "mhc_pre_apply_mix_bwd",
    "mhc_post",
    "mhc_post_fwd",
    "mhc_post_bwd",
    "mhc_fn_normw_merge",
    "mhc_fn_normw_merge_bwd",
    "mhc_pre_norm_fn",
    "mhc_pre_norm_fn_bwd",
    "mhc_pre_norm_fn_bwd_mul",
    "mhc_pre_big_fuse",
    "mhc_multilayer_recompute",
]


# ----------------------------------------------------------------------------
# private helpers
# ----------------------------------------------------------------------------


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, float32 otherwise."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _store(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Return ``result``, or write it into ``out`` and return ``out``."""
    if out is None:
        return result
    if out.shape != result.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(result.shape)}")
    out.copy_(result)
    return out


def _split_sizes(mhc_mult: int) -> tuple[int, int, int]:
    """Sizes of the pre, post and comb groups of a mixes vector."""
    return mhc_mult, mhc_mult, mhc_mult * mhc_mult


def _seq_sum(y: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` (kept, size 1) left to right: ``((y0 + y1) + y2) + ...``.

    The order the kernels follow; on the CPU it equals ``y.sum(dim, keepdim=True)`` for
    the small ``n`` of a Sinkhorn matrix.
    """
    parts = y.unbind(dim)
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    return acc.unsqueeze(dim)


# Lanes of the cross-token sums of the backward passes (the shared ``mhc_scale`` and
# ``mhc_base`` gradients): the kernels run one thread per lane.
TOKEN_SUM_LANES = 2048


def _token_sum(v: torch.Tensor) -> torch.Tensor:
    """``sum_t v[t, :]`` over the rows of ``v`` ``(N, C)``, in the kernels' fixed order.

    Lane ``l`` (of ``TOKEN_SUM_LANES``) adds rows ``l, l + L, l + 2L, ...`` in that order,
    starting from zero; then the lanes combine pairwise, neighbours first
    (``s = s[0::2] + s[1::2]`` until one is left).  Every add is one float32 rounding.
    """
    lanes = TOKEN_SUM_LANES
    rows = -(-v.shape[0] // lanes)
    acc = torch.zeros(lanes, v.shape[1], dtype=v.dtype, device=v.device)
    for r in range(rows):
        chunk = v[r * lanes:(r + 1) * lanes]
        acc[: chunk.shape[0]] = acc[: chunk.shape[0]] + chunk
    while acc.shape[0] > 1:
        acc = acc[0::2] + acc[1::2]
    return acc[0]


def _seq_total(v: torch.Tensor) -> torch.Tensor:
    """Sum of a 1-D tensor left to right, as a 0-d tensor."""
    acc = v[0]
    for x in v[1:]:
        acc = acc + x
    return acc


def _group_scale(mhc_scale: torch.Tensor, mhc_mult: int, dtype: torch.dtype) -> torch.Tensor:
    """The 3 group scales repeated over the ``M * (M + 2)`` mixes."""
    sizes = torch.tensor(_split_sizes(mhc_mult), device=mhc_scale.device)
    return mhc_scale.to(dtype).repeat_interleave(sizes)


# ----------------------------------------------------------------------------
# expand
# ----------------------------------------------------------------------------


def expand_to_mhc(
    hidden: torch.Tensor,
    mhc_mult: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy every token's hidden vector into ``mhc_mult`` residual streams.

    Args:
        hidden: ``(..., H)``, bf16 for the kernel (any dtype here).
        mhc_mult: number of streams ``M``.
        out: optional ``(..., M, H)`` tensor to write into.

    Returns:
        ``(..., M, H)`` contiguous, dtype of ``hidden``:
        ``out[..., m, :] = hidden[..., :]`` for every ``m``.
    """
    streams = hidden.unsqueeze(-2).expand(*hidden.shape[:-1], mhc_mult, hidden.shape[-1])
    return _store(streams.contiguous(), out)


def expand_to_mhc_bwd(out_grad: torch.Tensor) -> torch.Tensor:
    """Gradient of ``expand_to_mhc``: the sum of the stream gradients.

    Args:
        out_grad: ``(..., M, H)``, bf16 for the kernel.

    Returns:
        ``(..., H)``, dtype of ``out_grad``: ``sum_m out_grad[..., m, :]``,
        accumulated in float32 (float64 for float64 input) in stream order
        ``m = 0, 1, ...`` and rounded once.
    """
    dtype = _compute_dtype(out_grad)
    acc = torch.zeros(out_grad.shape[:-2] + out_grad.shape[-1:], dtype=dtype, device=out_grad.device)
    for m in range(out_grad.shape[-2]):
        acc = acc + out_grad[..., m, :].to(dtype)
    return acc.to(out_grad.dtype)


# ----------------------------------------------------------------------------
# Sinkhorn
# ----------------------------------------------------------------------------


def sinkhorn_normalize(x: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn-Knopp normalisation of every trailing ``n x n`` matrix.

    Starting from a row softmax, alternately divide by column and row sums so
    that the result approaches a doubly stochastic matrix::

        y = softmax(x, dim=-1) + eps
        y = y / (y.sum(-2) + eps)                 # columns
        repeat - 1 times:
            y = y / (y.sum(-1) + eps)             # rows
            y = y / (y.sum(-2) + eps)             # columns

    Args:
        x: ``(..., n, n)``, float32 for the kernel.
        repeat: number of column normalisations (>= 1).
        eps: added after the softmax and to every row/column sum.

    Arithmetic (what the kernels follow bit for bit): every row and column sum
    adds left to right, ``((y[0] + y[1]) + y[2]) + ...`` (``_seq_sum``; on the CPU
    the same as ``torch.sum`` for these sizes); every step is a true division.  The
    softmax is ``torch.softmax``; on CUDA (for ``n <= 32``) torch computes it as
    ``e = exp(x - rowmax)``, the row's ``e`` summed as an XOR butterfly over
    ``next_pow2(n)`` lanes (``n = 4``: ``(e0 + e2) + (e1 + e3)``), then ``e / sum``.

    Args:
        x: ``(..., n, n)``, float32 for the kernel.
        repeat: number of column normalisations (>= 1).
        eps: added after the softmax and to every row/column sum.

    Returns:
        ``(..., n, n)`` contiguous, dtype of ``x``.  Columns sum to ``1`` up to
        ``eps`` and rounding (within ``1e-5`` in float32); rows sum to ``1`` up to
        the convergence left after ``repeat`` rounds (docs/ops.md states it).
    """
    y = x.softmax(-1) + eps
    y = y / (_seq_sum(y, -2) + eps)
    for _ in range(repeat - 1):
        y = y / (_seq_sum(y, -1) + eps)
        y = y / (_seq_sum(y, -2) + eps)
    return y


def sinkhorn_normalize_bwd(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    repeat: int = 10,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Gradient of ``sinkhorn_normalize`` with respect to its input.

    The forward pass is recomputed, keeping the input ``u`` of every
    normalisation step ``v = u / (S + eps)`` with ``S = u.sum(axis)``.  Walking
    the steps backwards::

        g <- (g - sum_axis(g * u) / (S + eps)) / (S + eps)

    and finally, through the softmax ``p`` (the ``+ eps`` passes ``g`` through)::

        grad_input = (g - sum_-1(g * p)) * p

    in that order of operations, each product, difference and true division rounded
    on its own, every sum left to right as in the forward pass.

    Args:
        grad_output: ``(..., n, n)`` gradient of the output, float32.
        x: ``(..., n, n)`` the forward input, float32.
        repeat, eps: as in the forward pass.

    Returns:
        ``(..., n, n)`` gradient of ``x``, dtype of ``x``.
    """
    dtype = _compute_dtype(grad_output, x)
    p = x.to(dtype).softmax(-1)
    u = p + eps
    steps: list[tuple[torch.Tensor, int]] = []
    for step in range(2 * repeat - 1):
        axis = -2 if step % 2 == 0 else -1
        steps.append((u, axis))
        u = u / (_seq_sum(u, axis) + eps)

    g = grad_output.to(dtype)
    for u, axis in reversed(steps):
        denom = _seq_sum(u, axis) + eps
        g = (g - _seq_sum(g * u, axis) / denom) / denom
    g = (g - _seq_sum(g * p, -1)) * p
    return g.to(x.dtype)


# ----------------------------------------------------------------------------
# pre split mixes
# ----------------------------------------------------------------------------


def mhc_pre_split_mixes(
    input_mixes: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_mult: int,
    mhc_post_mult_value: float,
    mhc_pre_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the projected mixes into pre, post and stream-mixing weights.

    With ``M = mhc_mult`` and ``z = input_mixes * s + mhc_base``, where ``s``
    repeats ``mhc_scale[0]`` over the first ``M`` mixes, ``mhc_scale[1]`` over
    the next ``M`` and ``mhc_scale[2]`` over the last ``M * M``::

        pre  = sigmoid(z[..., :M]) + mhc_pre_eps
        post = sigmoid(z[..., M:2M]) * mhc_post_mult_value
        comb = z[..., 2M:] viewed as M x M (row-major)

    Args:
        input_mixes: ``(..., M * (M + 2))`` float32 (upstream: 3-D
            ``(n0, n1, M * (M + 2))``).
        mhc_scale: ``(3,)`` float32.
        mhc_base: ``(M * (M + 2),)`` float32.
        mhc_mult: ``M``.
        mhc_post_mult_value, mhc_pre_eps: scalars.

    Returns:
        ``pre (..., M, 1)``, ``post (..., M, 1)``, ``comb (..., M, M)``, all
        contiguous, dtype of ``input_mixes``.
    """
    m_pre, m_post, m_comb = _split_sizes(mhc_mult)
    if input_mixes.shape[-1] != m_pre + m_post + m_comb:
        raise ValueError(
            f"mhc_pre_split_mixes: input_mixes has {input_mixes.shape[-1]} mixes, "
            f"expected mhc_mult * (mhc_mult + 2) = {m_pre + m_post + m_comb}"
        )
    z = input_mixes * _group_scale(mhc_scale, mhc_mult, input_mixes.dtype) + mhc_base
    z_pre, z_post, z_comb = z.split([m_pre, m_post, m_comb], dim=-1)
    pre = z_pre.sigmoid().unsqueeze(-1) + mhc_pre_eps
    post = (z_post.sigmoid() * mhc_post_mult_value).unsqueeze(-1)
    comb = z_comb.reshape(*z.shape[:-1], mhc_mult, mhc_mult).contiguous()
    return pre, post, comb


def mhc_pre_split_mixes_bwd(
    pre_layer_mix_grad: torch.Tensor,
    post_layer_mix_grad: torch.Tensor,
    comb_res_mix_grad: torch.Tensor,
    input_mixes: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_mult: int,
    mhc_post_mult_value: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient of ``mhc_pre_split_mixes``.

    With ``z`` as in the forward pass and ``sg = sigmoid(z)``, the gradient of
    ``z`` is ``g_pre * (1 - sg) * sg`` on the pre group,
    ``g_post * mhc_post_mult_value * (1 - sg) * sg`` on the post group and
    ``g_comb`` on the comb group.  Then ``input_mixes_grad = g_z * s`` (``s`` the
    repeated group scale), ``mhc_base_grad = sum_tokens g_z`` and
    ``mhc_scale_grad[k] = sum over tokens and group k of g_z * input_mixes``.

    Order of operations (the kernel's): ``z = input_mixes * s + mhc_base`` and
    ``sigmoid`` as in the forward pass; ``(g_pre * (1 - sg)) * sg`` and
    ``((g_post * mhc_post_mult_value) * (1 - sg)) * sg``, each product rounded.
    The sums over tokens run in ``_token_sum``'s fixed order (per mix, for the
    base gradient and for ``g_z * input_mixes``); ``mhc_scale_grad[k]`` then adds
    its group's per-mix sums left to right.

    Args:
        pre_layer_mix_grad, post_layer_mix_grad: ``(..., M, 1)``.
        comb_res_mix_grad: ``(..., M, M)``.
        input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value: the
            forward inputs.

    Returns:
        ``input_mixes_grad (..., M * (M + 2))``, ``mhc_scale_grad (3,)``,
        ``mhc_base_grad (M * (M + 2),)``, in the dtypes of the inputs.
    """
    dtype = _compute_dtype(input_mixes, mhc_scale, mhc_base, pre_layer_mix_grad)
    lead = input_mixes.shape[:-1]
    m_pre, m_post, m_comb = _split_sizes(mhc_mult)
    scale = _group_scale(mhc_scale, mhc_mult, dtype)
    mixes = input_mixes.to(dtype)
    z = mixes * scale + mhc_base.to(dtype)
    # sigmoid per group, as in the forward pass (same values bit for bit)
    sg_pre, sg_post = (part.sigmoid() for part in z.split([m_pre, m_post, m_comb], dim=-1)[:2])
    g_pre = pre_layer_mix_grad.reshape(*lead, m_pre).to(dtype) * (1 - sg_pre) * sg_pre
    g_post = post_layer_mix_grad.reshape(*lead, m_post).to(dtype) * mhc_post_mult_value * (1 - sg_post) * sg_post
    g_comb = comb_res_mix_grad.reshape(*lead, m_comb).to(dtype)
    g_z = torch.cat([g_pre, g_post, g_comb], dim=-1)

    g_flat = g_z.reshape(-1, g_z.shape[-1])
    base_grad = _token_sum(g_flat)
    per_mix = _token_sum(g_flat * mixes.reshape(g_flat.shape))
    scale_grad = torch.stack([_seq_total(part) for part in per_mix.split([m_pre, m_post, m_comb])])
    input_grad = g_z * scale
    return input_grad.to(input_mixes.dtype), scale_grad.to(mhc_scale.dtype), base_grad.to(mhc_base.dtype)


# ----------------------------------------------------------------------------
# head compute mix
# ----------------------------------------------------------------------------


def mhc_head_compute_mix(
    input_mix: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_pre_eps: float,
) -> torch.Tensor:
    """Stream weights in front of the LM head.

    ``out = sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps``.

    Args:
        input_mix: ``(..., M)`` float32 (upstream: 3-D ``(n0, n1, M)``).
        mhc_scale: ``(1,)`` float32.
        mhc_base: ``(M,)`` float32.
        mhc_pre_eps: scalar.

    Returns:
        ``(..., M)``, dtype of ``input_mix``.
    """
    return torch.sigmoid(input_mix * mhc_scale + mhc_base) + mhc_pre_eps


def mhc_head_compute_mix_bwd(
    output_mix_grad: torch.Tensor,
    input_mix: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient of ``mhc_head_compute_mix``.

    With ``sg = sigmoid(input_mix * mhc_scale + mhc_base)`` and
    ``g_z = output_mix_grad * (1 - sg) * sg``:
    ``input_mix_grad = g_z * mhc_scale``,
    ``mhc_scale_grad = sum(g_z * input_mix)`` (shape ``(1,)``),
    ``mhc_base_grad = sum_tokens g_z`` (shape ``(M,)``).

    Order of operations (the kernel's): ``(g * (1 - sg)) * sg``; the sums over
    tokens per mix in ``_token_sum``'s fixed order; the scale gradient adds the
    ``M`` per-mix sums of ``g_z * input_mix`` left to right.

    Returns:
        ``input_mix_grad (..., M)``, ``mhc_scale_grad (1,)``,
        ``mhc_base_grad (M,)``, in the dtypes of the inputs.
    """
    dtype = _compute_dtype(output_mix_grad, input_mix, mhc_scale, mhc_base)
    mix = input_mix.to(dtype)
    scale = mhc_scale.to(dtype)
    sg = torch.sigmoid(mix * scale + mhc_base.to(dtype))
    g_z = output_mix_grad.to(dtype) * (1 - sg) * sg
    g_flat = g_z.reshape(-1, g_z.shape[-1])
    scale_grad = _seq_total(_token_sum(g_flat * mix.reshape(g_flat.shape))).reshape(mhc_scale.shape)
    base_grad = _token_sum(g_flat)
    return (
        (g_z * scale).to(input_mix.dtype),
        scale_grad.to(mhc_scale.dtype),
        base_grad.to(mhc_base.dtype),
    )


# ----------------------------------------------------------------------------
# pre apply mix
# ----------------------------------------------------------------------------


def _check_mix(name: str, mix: torch.Tensor, x: torch.Tensor) -> None:
    if mix.shape[-1] != 1 or mix.shape[-2] != x.shape[-2]:
        raise ValueError(
            f"{name}: mix must have shape (..., {x.shape[-2]}, 1) to match x {tuple(x.shape)}, "
            f"got {tuple(mix.shape)}"
        )


def mhc_pre_apply_mix(
    x: torch.Tensor,
    mix: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Collapse the streams into the sublayer input with the pre mix.

    ``out[..., h] = sum_m mix[..., m, 0] * x[..., m, h]``, products and sum in
    float32 (streams summed in order ``m = 0, 1, ...``), rounded once.

    Args:
        x: ``(..., M, H)`` bf16 streams.
        mix: ``(..., M, 1)`` float32 weights.
        out: optional ``(..., H)`` tensor to write into.

    Returns:
        ``(..., H)``, dtype of ``x`` (bf16).
    """
    _check_mix("mhc_pre_apply_mix", mix, x)
    dtype = _compute_dtype(x, mix)
    result = (x.to(dtype) * mix.to(dtype)).sum(-2).to(x.dtype)
    return _store(result, out)


def mhc_pre_apply_mix_bwd(
    o_grad: torch.Tensor,
    x: torch.Tensor,
    mix: torch.Tensor,
    x_grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of ``mhc_pre_apply_mix``.

    ``x_grad[..., m, h] = mix[..., m, 0] * o_grad[..., h]`` and
    ``mix_grad[..., m, 0] = sum_h o_grad[..., h] * x[..., m, h]`` (float32).

    Args:
        o_grad: ``(..., H)`` bf16 gradient of the output.
        x, mix: the forward inputs.
        x_grad: optional ``(..., M, H)`` gradient already accumulated for
            ``x`` (the kernel adds into it in place, the path upstream's
            ``fuse_grad_acc`` uses); when given, the returned ``x_grad`` is
            ``x_grad + mix * o_grad`` computed in float32 and rounded once.  The
            argument itself is not modified.

    Returns:
        ``x_grad (..., M, H)`` in the dtype of ``x``, ``mix_grad (..., M, 1)``
        in the dtype of ``mix``.
    """
    _check_mix("mhc_pre_apply_mix_bwd", mix, x)
    dtype = _compute_dtype(o_grad, x, mix)
    g = o_grad.to(dtype).unsqueeze(-2)
    contribution = mix.to(dtype) * g
    if x_grad is not None:
        contribution = x_grad.to(dtype) + contribution
    mix_grad = (g * x.to(dtype)).sum(-1, keepdim=True)
    return contribution.to(x.dtype), mix_grad.to(mix.dtype)


# ----------------------------------------------------------------------------
# post
# ----------------------------------------------------------------------------


def _post_forward(x, residual, post_layer_mix, comb_res_mix):
    dtype = _compute_dtype(x, residual, post_layer_mix, comb_res_mix)
    mhc, hidden = residual.shape[-2:]
    # new[n, h] = sum_m comb[m, n] * residual[m, h], one batched product per token
    mixed = torch.einsum(
        "tmn,tmh->tnh",
        comb_res_mix.to(dtype).reshape(-1, mhc, mhc),
        residual.to(dtype).reshape(-1, mhc, hidden),
    ).reshape(residual.shape)
    result = x.to(dtype).unsqueeze(-2) * post_layer_mix.to(dtype) + mixed
    return result.to(residual.dtype)


def _check_post(name, x, residual, post_layer_mix, comb_res_mix):
    lead = residual.shape[:-2]
    mhc, hidden = residual.shape[-2:]
    expected = {
        "x": (x, lead + (hidden,)),
        "post_layer_mix": (post_layer_mix, lead + (mhc, 1)),
        "comb_res_mix": (comb_res_mix, lead + (mhc, mhc)),
    }
    for arg, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: {arg} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")


def mhc_post(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """New residual streams after a sublayer.

    ``out[..., n, h] = post_layer_mix[..., n, 0] * x[..., h]
    + sum_m comb_res_mix[..., m, n] * residual[..., m, h]``, in float32 and
    rounded once (note the ``comb`` index order: column ``n`` feeds stream ``n``).

    Args:
        x: ``(..., H)`` bf16 sublayer output.
        residual: ``(..., M, H)`` bf16 streams (upstream: 4-D ``(n0, n1, M, H)``).
        post_layer_mix: ``(..., M, 1)`` float32.
        comb_res_mix: ``(..., M, M)`` float32.
        out: optional ``(..., M, H)`` tensor to write into.

    Returns:
        ``(..., M, H)`` contiguous, dtype of ``residual`` (bf16).
    """
    _check_post("mhc_post", x, residual, post_layer_mix, comb_res_mix)
    return _store(_post_forward(x, residual, post_layer_mix, comb_res_mix), out)


def mhc_post_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward of ``mhc_post`` without autograd (same math as ``mhc_post``)."""
    _check_post("mhc_post_fwd", x, residual, post_layer_mix, comb_res_mix)
    return _store(_post_forward(x, residual, post_layer_mix, comb_res_mix), out)


def mhc_post_bwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    d_o: torch.Tensor,
    fuse_grad_acc: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient of ``mhc_post``.

    With ``g = d_o`` (``(..., M, H)``), in float32::

        d_x[h]          = sum_n post[n] * g[n, h]          -> dtype of x
        d_residual[m, h] = sum_n comb[m, n] * g[n, h]      -> dtype of residual
        d_post[n]       = sum_h x[h] * g[n, h]             -> (..., M, 1)
        d_comb[m, n]    = sum_h residual[m, h] * g[n, h]   -> (..., M, M)

    Args:
        x, residual, post_layer_mix, comb_res_mix: the forward inputs.
        d_o: ``(..., M, H)`` bf16 gradient of the output.
        fuse_grad_acc: as upstream: when true, ``d_residual`` is also attached
            to ``residual.untyped_storage()`` as ``grad_from_mhc_post`` so that
            the pre-path backward kernels can accumulate into it in place.

    Returns:
        ``(d_x, d_residual, d_post_layer_mix, d_comb_res_mix)``, each shaped and
        typed like the corresponding input.
    """
    _check_post("mhc_post_bwd", x, residual, post_layer_mix, comb_res_mix)
    dtype = _compute_dtype(x, residual, post_layer_mix, comb_res_mix, d_o)
    mhc, hidden = residual.shape[-2:]
    g = d_o.to(dtype)
    g3 = g.reshape(-1, mhc, hidden)
    d_x = (g * post_layer_mix.to(dtype)).sum(-2)
    d_post = (g * x.to(dtype).unsqueeze(-2)).sum(-1, keepdim=True)
    d_residual = torch.einsum("tmn,tnh->tmh", comb_res_mix.to(dtype).reshape(-1, mhc, mhc), g3)
    d_comb = torch.einsum("tmh,tnh->tmn", residual.to(dtype).reshape(-1, mhc, hidden), g3)
    d_residual = d_residual.reshape(residual.shape).to(residual.dtype)
    if fuse_grad_acc:
        residual.untyped_storage().grad_from_mhc_post = d_residual
    return (
        d_x.to(x.dtype),
        d_residual,
        d_post.to(post_layer_mix.dtype),
        d_comb.reshape(comb_res_mix.shape).to(comb_res_mix.dtype),
    )


# ----------------------------------------------------------------------------
# pre norm fn
# ----------------------------------------------------------------------------


def mhc_fn_normw_merge(fn: torch.Tensor, normw: torch.Tensor) -> torch.Tensor:
    """Fold an RMSNorm weight into the projection: ``fn[j, k] * normw[k]``.

    Args:
        fn: ``(M * (M + 2), M * H)`` float32.
        normw: ``(M * H,)`` float32.

    Returns:
        ``(M * (M + 2), M * H)``, dtype of ``fn``.
    """
    return fn * normw


def mhc_fn_normw_merge_bwd(
    fn: torch.Tensor,
    normw: torch.Tensor,
    out_fn_grad: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of ``mhc_fn_normw_merge``.

    ``fn_grad = out_fn_grad * normw`` and ``normw_grad[k] = sum_j out_fn_grad[j, k] * fn[j, k]``
    (the kernel accumulates both into existing gradient buffers; here they are
    returned).
    """
    return out_fn_grad * normw, (out_fn_grad * fn).sum(0)


# The kernels' order of the norm-fn sums over K (float32): element ``k`` belongs to lane ``l``
# of 256 as ``k = (i * 256 + l) * 4 + e``; each lane adds its terms in ``(i, e)`` order into a
# sum that starts at +0, the 32 lanes of a warp combine by a butterfly (xor 16, 8, 4, 2, 1) and
# the 8 warp sums as ((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7)).
_NORM_FN_LANES = 256
_NORM_FN_PIECE = 4


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32 as TileKernels does: ``0x1000`` added to the bits and the low 13
    bits cleared (round half away from zero to 10 mantissa bits; infinities stay)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    bits = (bits + 0x1000) & 0xFFFFE000
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32).reshape(x.shape)


def _lane_tree(acc: torch.Tensor) -> torch.Tensor:
    """``[..., 256]`` lane sums -> ``[...]``: warp butterflies, then the 8 warp sums."""
    acc = acc.reshape(*acc.shape[:-1], _NORM_FN_LANES // 32, 32)
    for half in (16, 8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half:2 * half]
    w = acc[..., 0]
    return ((w[..., 0] + w[..., 1]) + (w[..., 2] + w[..., 3])) + ((w[..., 4] + w[..., 5]) + (w[..., 6] + w[..., 7]))


def _lane_order_dot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ w[N, K].T`` summed in the kernels' lane order (float32; every product
    ``x * w`` is exact when x is bf16 and w TF32, so each step rounds once, at the add)."""
    t, k = x.shape
    span = _NORM_FN_LANES * _NORM_FN_PIECE
    padded = -(-k // span) * span
    if padded != k:  # +0 terms leave a sum that starts at +0 unchanged
        x = torch.nn.functional.pad(x, (0, padded - k))
        w = torch.nn.functional.pad(w, (0, padded - k))
    xs = x.reshape(t, padded // span, _NORM_FN_LANES, _NORM_FN_PIECE)
    ws = w.reshape(w.shape[0], padded // span, _NORM_FN_LANES, _NORM_FN_PIECE)
    acc = x.new_zeros(t, w.shape[0], _NORM_FN_LANES)
    for i in range(padded // span):
        for e in range(_NORM_FN_PIECE):
            acc = acc + xs[:, None, i, :, e] * ws[None, :, i, :, e]
    return _lane_tree(acc)


def _norm_fn_parts(residual, fn, eps, kernel_order=False):
    """Shared forward pieces: flattened x, sum of squares, rsqrt factor, x @ fn.T.

    With ``kernel_order`` (float32 only) ``fn`` is rounded to TF32 and both sums over K follow
    the kernels' lane order, so the forward kernel's result is reproduced bit for bit."""
    dtype = _compute_dtype(residual, fn)
    x = residual.flatten(-2).to(dtype)
    fn = fn.to(dtype)
    k = fn.shape[-1]
    if x.shape[-1] != k:
        raise ValueError(
            f"mhc_pre_norm_fn: residual has M * H = {x.shape[-1]} features per token, "
            f"mhc_fn has {k} columns"
        )
    if kernel_order and dtype == torch.float32:
        flat = x.reshape(-1, k)
        sqrsum = _lane_order_dot(flat.square(), torch.ones(1, k, dtype=dtype, device=x.device))
        sqrsum = sqrsum.reshape(*x.shape[:-1], 1)
        out_mul = _lane_order_dot(flat, round_to_tf32(fn)).reshape(*x.shape[:-1], fn.shape[0])
    else:
        sqrsum = x.square().sum(-1, keepdim=True)
        out_mul = x @ fn.t()
    rms = (sqrsum / k + eps).rsqrt()
    return x, fn, sqrsum, rms, out_mul


def mhc_pre_norm_fn(
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    fuse_grad_acc: bool = True,
    n_splits: int = 16,
) -> torch.Tensor:
    """RMS-normalised projection of the flattened streams.

    With ``x = residual`` flattened to ``(..., K)``, ``K = M * H``, and
    ``W = mhc_fn * mhc_norm_weight`` (or ``mhc_fn`` when no weight)::

        out = (x @ W.T) * rsqrt(sum(x**2) / K + mhc_norm_eps)

    in float32, with ``W`` rounded to TF32 (:func:`round_to_tf32`, as TileKernels
    rounds it before its TF32 GEMM) and both sums over ``K`` in the kernel's fixed
    lane order (``_lane_order_dot``), so the kernel matches bit for bit.  A float64
    input runs the plain float64 product (no TF32 rounding), for ``gradcheck``.

    Args:
        residual: ``(..., M, H)`` bf16.
        mhc_fn: ``(N, M * H)`` float32, ``N = M * (M + 2)``.
        mhc_norm_weight: ``(M * H,)`` float32 or ``None``.
        mhc_norm_eps: RMS epsilon.
        fuse_grad_acc, n_splits: kernel plumbing, no effect on the result.

    Returns:
        ``(..., N)`` float32.
    """
    del fuse_grad_acc, n_splits
    fn = mhc_fn if mhc_norm_weight is None else mhc_fn_normw_merge(mhc_fn, mhc_norm_weight)
    _, _, _, rms, out_mul = _norm_fn_parts(residual, fn, mhc_norm_eps, kernel_order=True)
    return out_mul * rms


def _norm_fn_bwd_norm(
    out_grad: torch.Tensor, out: torch.Tensor, sqrsum: torch.Tensor, k: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token part of the norm-fn backward from the forward's output ``out = u * r`` and
    ``S = sum(x**2)`` (``(...)``): ``u_grad = out_grad * r`` and
    ``S_grad = -0.5 * sum_j(out_grad[j] * out[j]) / (S + eps * K)`` (equal to
    ``-0.5 * sum_j(out_grad[j] * u[j]) * r / (S + eps * K)``), in the dtype of ``out``."""
    g = out_grad.to(out.dtype)
    sqrsum = sqrsum.to(out.dtype)
    rms = (sqrsum / k + eps).rsqrt()
    out_mul_grad = g * rms[..., None]
    sqrsum_grad = -0.5 * (g * out).sum(-1) / (sqrsum + eps * k)
    return out_mul_grad, sqrsum_grad


def mhc_pre_norm_fn_bwd_mul(
    out_mul_grad: torch.Tensor,
    sqrsum_grad: torch.Tensor,
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    x_grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-wide part of the norm-fn backward (upstream's ``bwd_mul`` kernel).

    With ``x = residual`` flattened to ``(..., K)``::

        x_grad_out = out_mul_grad @ mhc_fn + 2 * x * sqrsum_grad (+ x_grad)
        fn_grad    = sum_tokens out_mul_grad^T x

    in float32 (float64 for float64 inputs), ``x_grad_out`` rounded once to the dtype of
    ``residual``.  The products are matmuls whose order is not fixed: the kernel sums in its
    own fixed order and is compared within a tolerance (docs/ops.md).

    Args:
        out_mul_grad: ``(..., N)`` float32, ``N = M * (M + 2)``.
        sqrsum_grad: ``(...)`` float32.
        residual: ``(..., M, H)`` bf16.  mhc_fn: ``(N, M * H)`` float32.
        x_grad: optional ``(..., M, H)`` gradient to add to (read, not modified).

    Returns:
        ``x_grad_out (..., M, H)`` in the dtype of ``residual``, ``fn_grad (N, M * H)`` in the
        compute dtype.
    """
    dtype = _compute_dtype(out_mul_grad, sqrsum_grad, residual, mhc_fn)
    x = residual.flatten(-2).to(dtype)
    k = x.shape[-1]
    if mhc_fn.shape[-1] != k:
        raise ValueError(
            f"mhc_pre_norm_fn_bwd_mul: residual has M * H = {k} features per token, mhc_fn has {mhc_fn.shape[-1]} columns"
        )
    ug = out_mul_grad.to(dtype)
    res_grad = ug @ mhc_fn.to(dtype) + 2 * x * sqrsum_grad.to(dtype)[..., None]
    if x_grad is not None:
        res_grad = x_grad.to(dtype).flatten(-2) + res_grad
    fn_grad = ug.reshape(-1, ug.shape[-1]).t() @ x.reshape(-1, k)
    return res_grad.reshape(residual.shape).to(residual.dtype), fn_grad


def mhc_pre_norm_fn_bwd(
    out_grad: torch.Tensor,
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    x_grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradient of ``mhc_pre_norm_fn``.

    With ``W`` the merged projection, ``S = sum(x**2)``,
    ``r = rsqrt(S / K + eps)`` and ``u = x @ W.T`` (so ``out = u * r``)::

        u_grad = out_grad * r
        S_grad = -0.5 * sum_j(out_grad[j] * u[j]) * r / (S + eps * K)
        x_grad = u_grad @ W + 2 * x * S_grad
        W_grad = sum_tokens u_grad^T x
        mhc_fn_grad = W_grad * normw,  normw_grad = sum_j W_grad[j] * mhc_fn[j]

    Computed as the forward's parts, the per-token part (``_norm_fn_bwd_norm``, from ``out``
    and ``S``) and :func:`mhc_pre_norm_fn_bwd_mul` (the K-wide part, a kernel where built).

    Args:
        out_grad: ``(..., N)`` float32.
        residual, mhc_fn, mhc_norm_weight, mhc_norm_eps: the forward inputs.
        x_grad: optional ``(..., M, H)`` gradient already accumulated for
            ``residual`` (the kernel adds into it in place); when given, the
            returned gradient is ``x_grad + contribution`` rounded once.

    Returns:
        ``residual_grad (..., M, H)`` in the dtype of ``residual``,
        ``mhc_fn_grad (N, M * H)`` and ``mhc_norm_weight_grad (M * H,)`` (or
        ``None``) in their inputs' dtypes.
    """
    fn = mhc_fn if mhc_norm_weight is None else mhc_fn_normw_merge(mhc_fn, mhc_norm_weight)
    x, fn_c, sqrsum, rms, out_mul = _norm_fn_parts(residual, fn, mhc_norm_eps)
    k = fn_c.shape[-1]
    out_mul_grad, sqrsum_grad = _norm_fn_bwd_norm(out_grad, out_mul * rms, sqrsum[..., 0], k, mhc_norm_eps)
    res_grad, merged_grad = mhc_pre_norm_fn_bwd_mul(out_mul_grad, sqrsum_grad, residual, fn_c, x_grad)
    if mhc_norm_weight is None:
        fn_grad, normw_grad = merged_grad, None
    else:
        fn_grad, normw_grad = mhc_fn_normw_merge_bwd(
            mhc_fn.to(x.dtype), mhc_norm_weight.to(x.dtype), merged_grad
        )
        normw_grad = normw_grad.to(mhc_norm_weight.dtype)
    return res_grad, fn_grad.to(mhc_fn.dtype), normw_grad


# ----------------------------------------------------------------------------
# fused inference path and multilayer recompute
# ----------------------------------------------------------------------------


def mhc_pre_big_fuse(
    residual: torch.Tensor,
    fn: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    rms_eps: float,
    mhc_pre_eps: float,
    mhc_sinkhorn_eps: float,
    mhc_post_mult_value: float,
    sinkhorn_repeat: int,
    n_splits: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole mHC pre path in one call (inference): exactly::

        mixes = mhc_pre_norm_fn(residual, fn, None, rms_eps)
        pre, post, comb = mhc_pre_split_mixes(mixes, mhc_scale, mhc_base, M,
                                              mhc_post_mult_value, mhc_pre_eps)
        comb = sinkhorn_normalize(comb, sinkhorn_repeat, mhc_sinkhorn_eps)
        layer_input = mhc_pre_apply_mix(residual, pre)

    Args:
        residual: ``(..., M, H)`` bf16.
        fn: ``(M * (M + 2), M * H)`` float32 (any RMSNorm weight already
            folded in; this op takes none).
        mhc_scale: ``(3,)`` float32.  mhc_base: ``(M * (M + 2),)`` float32.
        rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value,
        sinkhorn_repeat: as in the individual ops.
        n_splits: kernel plumbing, no effect on the result.

    Returns:
        ``post_mix (..., M, 1)`` float32, ``comb_mix (..., M, M)`` float32,
        ``layer_input (..., H)`` bf16.
    """
    del n_splits
    mhc_mult = residual.shape[-2]
    mhc_mult3 = mhc_mult * (mhc_mult + 2)
    if tuple(fn.shape) != (mhc_mult3, mhc_mult * residual.shape[-1]):
        raise ValueError(
            f"mhc_pre_big_fuse: fn has shape {tuple(fn.shape)}, expected "
            f"{(mhc_mult3, mhc_mult * residual.shape[-1])}"
        )
    if tuple(mhc_scale.shape) != (3,) or tuple(mhc_base.shape) != (mhc_mult3,):
        raise ValueError(
            f"mhc_pre_big_fuse: mhc_scale must be (3,) and mhc_base ({mhc_mult3},), "
            f"got {tuple(mhc_scale.shape)} and {tuple(mhc_base.shape)}"
        )
    mixes = mhc_pre_norm_fn(residual, fn, None, rms_eps)
    pre_mix, post_mix, comb_mix = mhc_pre_split_mixes(
        mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps
    )
    comb_mix = sinkhorn_normalize(comb_mix, repeat=sinkhorn_repeat, eps=mhc_sinkhorn_eps)
    layer_input = mhc_pre_apply_mix(residual, pre_mix)
    return post_mix, comb_mix, layer_input


def mhc_multilayer_recompute(
    initial_residual: torch.Tensor,
    pre_mix_list: list[torch.Tensor],
    layer_output_list: list[torch.Tensor],
    post_mix_list: list[torch.Tensor],
    comb_mix_list: list[torch.Tensor],
    layer_input_list: list[torch.Tensor],
    residual_list: list[torch.Tensor],
) -> None:
    """Recompute the sublayer inputs and residual streams of ``L`` layers.

    Starting from ``r = initial_residual``, for layer ``i = 0 .. L-1``::

        layer_input_list[i][...] = mhc_pre_apply_mix(r, pre_mix_list[i])
        if i < P:
            r = mhc_post(layer_output_list[i], r, post_mix_list[i], comb_mix_list[i])
            residual_list[i][...] = r

    where ``P = len(layer_output_list)`` is ``L`` or ``L - 1``.  ``r`` is
    rounded to the stream dtype (bf16) after every layer, exactly as when the
    single-layer operators are chained.

    Args:
        initial_residual: ``(..., M, H)`` bf16.
        pre_mix_list: ``L`` tensors ``(..., M, 1)`` (or ``(..., M)``) float32.
        layer_output_list: ``P`` tensors ``(..., H)`` bf16.
        post_mix_list: ``P`` tensors ``(..., M, 1)`` (or ``(..., M)``) float32.
        comb_mix_list: ``P`` tensors ``(..., M, M)`` float32.
        layer_input_list: ``L`` output tensors ``(..., H)`` bf16, written.
        residual_list: ``P`` output tensors ``(..., M, H)`` bf16, written.

    Returns:
        ``None``; the results are written into ``layer_input_list`` and
        ``residual_list``.
    """
    num_layers = len(pre_mix_list)
    num_post = len(layer_output_list)
    if num_layers == 0:
        raise ValueError("mhc_multilayer_recompute: pre_mix_list is empty")
    if len(layer_input_list) != num_layers:
        raise ValueError(
            f"mhc_multilayer_recompute: {num_layers} pre mixes but {len(layer_input_list)} layer inputs"
        )
    if not (len(post_mix_list) == len(comb_mix_list) == len(residual_list) == num_post):
        raise ValueError(
            "mhc_multilayer_recompute: layer_output_list, post_mix_list, comb_mix_list and "
            f"residual_list must have equal lengths, got {num_post}, {len(post_mix_list)}, "
            f"{len(comb_mix_list)}, {len(residual_list)}"
        )
    if num_post not in (num_layers, num_layers - 1):
        raise ValueError(
            f"mhc_multilayer_recompute: post count ({num_post}) must be num_layers ({num_layers}) "
            "or num_layers - 1"
        )
    mix_shape = initial_residual.shape[:-1] + (1,)
    residual = initial_residual
    for i in range(num_layers):
        layer_input_list[i].copy_(mhc_pre_apply_mix(residual, pre_mix_list[i].reshape(mix_shape)))
        if i < num_post:
            residual = mhc_post(
                layer_output_list[i],
                residual,
                post_mix_list[i].reshape(mix_shape),
                comb_mix_list[i],
            )
            residual_list[i].copy_(residual)
