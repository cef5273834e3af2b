"""Defining properties of the engram references and the reference-backed EngramGateRefFn autograd Function.

Runs without tile_kernels.  The gate is checked against an independent float64
statement of its definition (``F.rms_norm``, a plain dot product, signed square
root, sigmoid), its backward against autograd of that statement and against
``torch.autograd.gradcheck``; the hash against a pure-Python loop with explicit
64-bit wrap-around; the weight-gradient reduction against float64 sums.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tile_kernels_aot.modeling.engram import EngramGateRefFn as EngramGateFn
from tile_kernels_aot.modeling.engram import engram_gate_ref as engram_gate
from tile_kernels_aot.torch import engram as ref
from tile_kernels_aot.torch.engram import (
    engram_gate_bwd,
    engram_gate_fwd,
    engram_hash,
    fused_weight,
    grad_w_reduce,
    make_offsets,
)

EPS = 1e-20  # upstream's test values
CLAMP = 1e-6


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


def _inputs(seed, num_tokens, hc_mult, hidden, dtype=torch.bfloat16):
    gen = _gen(seed)
    x = _randn(gen, num_tokens, hc_mult, hidden, dtype=dtype)
    k = _randn(gen, num_tokens, hc_mult, hidden, dtype=dtype)
    v = _randn(gen, num_tokens, hidden, dtype=dtype)
    wh = _randn(gen, hc_mult, hidden, dtype=dtype)
    we = _randn(gen, hc_mult, hidden, dtype=dtype)
    grad_out = _randn(gen, num_tokens, hc_mult, hidden, dtype=dtype)
    return x, k, v, wh, we, grad_out


def _truth(x, k, v, wh, we, clamp_value, eps, w=None):
    """The gate's definition in float64 (differentiable): returns (out, z, gate)."""
    hidden = x.shape[-1]
    x, k, v, wh, we = (t.double() for t in (x, k, v, wh, we))
    if w is None:
        xn = F.rms_norm(x, (hidden,), None, eps) * wh
        kn = F.rms_norm(k, (hidden,), None, eps) * we
        z = (xn * kn).sum(-1) / math.sqrt(hidden)
    else:  # same value, with the fused weight (possibly per token) as the leaf
        z = (F.rms_norm(x, (hidden,), None, eps) * w * F.rms_norm(k, (hidden,), None, eps)).sum(-1) / math.sqrt(hidden)
    gate = torch.sigmoid(torch.sign(z) * z.abs().clamp_min(clamp_value).sqrt())
    return x + gate.unsqueeze(-1) * v.unsqueeze(-2), z, gate


def _bf16_ulp(t):
    """Spacing of bfloat16 numbers at |t| (float64)."""
    mag = t.double().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


# ---------------------------------------------------------------- fused_weight


@pytest.mark.parametrize("hidden", [256, 2048, 7168])
def test_fused_weight_is_exact_product(hidden):
    gen = _gen(hidden)
    wh, we = _randn(gen, 4, hidden), _randn(gen, 4, hidden)
    w = fused_weight(wh, we)
    assert w.dtype == torch.float32 and w.shape == (4, hidden) and w.is_contiguous()
    # bf16 x bf16 has <= 16 significant bits: exact in float32.
    torch.testing.assert_close(w.double(), wh.double() * we.double(), rtol=0, atol=0)


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("num_tokens,hc_mult,hidden", [(67, 4, 512), (33, 4, 2048), (9, 4, 7168), (20, 2, 768)])
def test_gate_fwd_matches_definition(num_tokens, hc_mult, hidden):
    x, k, v, wh, we, _ = _inputs(num_tokens * 7 + hidden, num_tokens, hc_mult, hidden)
    w = fused_weight(wh, we)
    out, dot, gate, rstd_x, rstd_k = engram_gate_fwd(x, k, v, w, EPS, CLAMP)

    assert out.shape == x.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    for t in (dot, gate, rstd_x, rstd_k):
        assert t.shape == (num_tokens, hc_mult) and t.dtype == torch.float32 and t.is_contiguous()

    out64, z64, gate64 = _truth(x, k, v, wh, we, CLAMP, EPS)
    x64, k64 = x.double(), k.double()
    terms = x64 * w.double() * k64
    # fp32 sums of H terms: error well below 1e-5 of the sum of magnitudes.
    assert ((dot.double() - terms.sum(-1)).abs() <= 1e-5 * terms.abs().sum(-1)).all()
    torch.testing.assert_close(rstd_x.double(), torch.rsqrt(x64.square().mean(-1) + EPS), rtol=1e-6, atol=0)
    torch.testing.assert_close(rstd_k.double(), torch.rsqrt(k64.square().mean(-1) + EPS), rtol=1e-6, atol=0)
    # gate: propagate the dot error through sigmoid(signed sqrt) (slope <= 0.25 * 0.5 / sqrt|z|).
    z_err = 1e-5 * terms.abs().sum(-1) * rstd_x.double() * rstd_k.double() / math.sqrt(hidden)
    slope = 0.125 / z64.abs().clamp_min(CLAMP).sqrt()
    assert ((gate.double() - gate64).abs() <= slope * z_err + 1e-6).all()
    # output: x + gate * v in fp32, rounded once to bf16 ...
    expect = (x.float() + gate.unsqueeze(-1) * v.float().unsqueeze(1)).bfloat16()
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    # ... which is within half a bf16 ulp of the float64 truth, plus the gate error and
    # the two fp32 roundings before it (double rounding can land just past the midpoint).
    gv = gate64.unsqueeze(-1) * v.double().unsqueeze(1)
    gate_err = (gate.double() - gate64).abs().unsqueeze(-1) * v.double().abs().unsqueeze(1)
    fp32_err = 2.0**-23 * (x.double().abs() + gv.abs())
    assert ((out.double() - out64).abs() <= _bf16_ulp(out64) / 2 + gate_err + fp32_err).all()


def test_gate_fwd_without_saving():
    x, k, v, wh, we, _ = _inputs(1, 17, 4, 1024)
    w = fused_weight(wh, we)
    saved = engram_gate_fwd(x, k, v, w, EPS, CLAMP, save_for_backward=True)
    plain = engram_gate_fwd(x, k, v, w, EPS, CLAMP, save_for_backward=False)
    assert plain[1:] == (None, None, None, None)
    torch.testing.assert_close(plain[0], saved[0], rtol=0, atol=0)


def test_gate_fwd_strided_k_v():
    """k as a view into a wider buffer, v with padded rows: same results as contiguous copies."""
    x, k, v, wh, we, _ = _inputs(2, 19, 4, 512)
    gen = _gen(3)
    k_buf = _randn(gen, 19, 6, 640)
    k_buf[:, 1:5, 64:576] = k
    k_view = k_buf[:, 1:5, 64:576]
    v_buf = _randn(gen, 19, 1024)
    v_buf[:, :512] = v
    v_view = v_buf[:, :512]
    assert not k_view.is_contiguous() and not v_view.is_contiguous()
    w = fused_weight(wh, we)
    a = engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    b = engram_gate_fwd(x, k_view, v_view, w, EPS, CLAMP)
    for s, t in zip(a, b):
        torch.testing.assert_close(s, t, rtol=0, atol=0)


def test_gate_zero_dot_uses_copysign():
    """dot == +0 (a zero x row) gives sigmoid(+sqrt(clamp)) as the kernel's copysign does, not 0.5."""
    x, k, v, wh, we, _ = _inputs(4, 5, 4, 256)
    x[2, 1] = 0
    clamp = 0.04
    out, dot, gate, _, _ = engram_gate_fwd(x, k, v, fused_weight(wh, we), EPS, clamp)
    assert dot[2, 1].item() == 0.0 and math.copysign(1.0, dot[2, 1].item()) == 1.0
    assert gate[2, 1].item() == torch.sigmoid(torch.tensor(clamp, dtype=torch.float32).sqrt()).item()


def test_gate_empty():
    x, k, v, wh, we, g = _inputs(5, 0, 4, 512)
    w = fused_weight(wh, we)
    out, dot, gate, rx, rk = engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    assert out.shape == (0, 4, 512) and dot.shape == (0, 4)
    gx, gk, gv, gp = engram_gate_bwd(g, x, k, v, w, dot, gate, rx, rk, CLAMP)
    assert gx.shape == (0, 4, 512) and gk.shape == (0, 4, 512) and gv.shape == (0, 512)
    assert gp.shape == (ref.DEFAULT_NUM_PERSISTENT_BLOCKS, 4, 512) and not gp.any()


# ---------------------------------------------------------------- backward


def _clamp_margin_ok(z, clamp, margin):
    """No |z| within ``margin`` of the clamp threshold, where the gradient jumps."""
    return bool(((z.abs() - clamp).abs() > margin).all())


@pytest.mark.parametrize("clamp", [CLAMP, 0.3], ids=["clamp1e-6", "clamp0.3"])
@pytest.mark.parametrize("num_tokens,hc_mult,hidden", [(21, 4, 256), (8, 3, 96)])
def test_gate_bwd_float64_equals_autograd(num_tokens, hc_mult, hidden, clamp, monkeypatch):
    """In float64, engram_gate_bwd equals autograd of the definition, including the per-chunk split."""
    monkeypatch.setattr(ref, "DEFAULT_NUM_PERSISTENT_BLOCKS", 8)
    x, k, v, wh, we, g = _inputs(11 + hidden, num_tokens, hc_mult, hidden, dtype=torch.float64)
    w = fused_weight(wh, we)
    assert w.dtype == torch.float64
    out, dot, gate, rx, rk = engram_gate_fwd(x, k, v, w, EPS, clamp)
    assert out.dtype == torch.float64

    leaves = [t.clone().requires_grad_() for t in (x, k, v)]
    w_tok = w.expand(num_tokens, hc_mult, hidden).clone().requires_grad_()  # per-token weight leaf
    out64, z, _ = _truth(*leaves, wh, we, clamp, EPS, w=w_tok)
    assert _clamp_margin_ok(z, clamp, 1e-9)  # analytic comparison: only rounding needs a margin
    if clamp > 0.1:
        assert (z.abs() < clamp).any() and (z.abs() > clamp).any()  # both branches exercised
    torch.testing.assert_close(out, out64.detach(), rtol=1e-12, atol=1e-12)
    out64.backward(g)

    gx, gk, gv, gp = engram_gate_bwd(g, x, k, v, w, dot, gate, rx, rk, clamp)
    torch.testing.assert_close(gx, leaves[0].grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gk, leaves[1].grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gv, leaves[2].grad, rtol=1e-10, atol=1e-12)

    # grad_w_partial[p] = sum of the per-token terms over chunk p of ceil(T / P) tokens.
    per_block = -(-num_tokens // 8)
    assert gp.shape == (8, hc_mult, hidden)
    for p in range(8):
        chunk = w_tok.grad[p * per_block : (p + 1) * per_block]
        expect = chunk.sum(0) if len(chunk) else torch.zeros_like(w)
        torch.testing.assert_close(gp[p], expect, rtol=1e-10, atol=1e-12)


def test_gate_bwd_bf16_close_to_truth():
    """bf16 inputs: gradients within bf16 rounding of the float64 gradients of the definition.

    Near z = 0 the gate's slope grows like 1/sqrt|z| and the fp32 dot loses relative
    accuracy to cancellation, so the gradient there is ill-conditioned; those tokens get
    a zero upstream gradient here (the float64 test above covers them exactly).
    """
    num_tokens, hc_mult, hidden = 40, 4, 1024
    x, k, v, wh, we, g = _inputs(21, num_tokens, hc_mult, hidden)
    w = fused_weight(wh, we)
    _, z64, _ = _truth(x, k, v, wh, we, CLAMP, EPS)
    ill = z64.abs() < 1e-2
    g[ill] = 0
    assert 0 < ill.sum() < ill.numel() // 4

    _, dot, gate, rx, rk = engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    gx, gk, gv, gp = engram_gate_bwd(g, x, k, v, w, dot, gate, rx, rk, CLAMP)
    assert (gx.dtype, gk.dtype, gv.dtype, gp.dtype) == (torch.bfloat16,) * 3 + (torch.float32,)
    assert gp.shape == (ref.DEFAULT_NUM_PERSISTENT_BLOCKS, hc_mult, hidden)

    leaves = [t.double().requires_grad_() for t in (x, k, v)]
    w_tok = w.double().expand(num_tokens, hc_mult, hidden).clone().requires_grad_()
    out64, _, _ = _truth(*leaves, wh, we, CLAMP, EPS, w=w_tok)
    out64.backward(g.double())
    for ours, truth in [(gx, leaves[0].grad), (gk, leaves[1].grad), (gv, leaves[2].grad)]:
        scale = truth.abs().amax()
        # one bf16 rounding of the fp32 result, plus fp32 error relative to the largest entry
        assert ((ours.double() - truth).abs() <= _bf16_ulp(truth) + 1e-5 * scale).all()
    gwh = torch.zeros(hc_mult, hidden)
    gwe = torch.zeros(hc_mult, hidden)
    grad_w_reduce(gp, wh, we, gwh, gwe)
    grad_w, grad_w_abs = w_tok.grad.sum(0), w_tok.grad.abs().sum(0)
    for ours, other in [(gwh, we), (gwe, wh)]:
        # fp32 per-token terms and sums: error relative to the sum of magnitudes
        bound = 1e-5 * grad_w_abs * other.double().abs() + 1e-30
        assert ((ours.double() - grad_w * other.double()).abs() <= bound).all()


# ---------------------------------------------------------------- grad_w_reduce


def test_grad_w_reduce_accumulates():
    gen = _gen(31)
    hc_mult, hidden, blocks = 4, 512, 132
    partial = torch.randn(blocks, hc_mult, hidden, generator=gen)
    wh, we = _randn(gen, hc_mult, hidden), _randn(gen, hc_mult, hidden)
    gwh0 = torch.randn(hc_mult, hidden, generator=gen)
    gwe0 = torch.randn(hc_mult, hidden, generator=gen)
    gwh, gwe = gwh0.clone(), gwe0.clone()
    wh_before, we_before = wh.clone(), we.clone()
    assert grad_w_reduce(partial, wh, we, gwh, gwe) is None
    total = partial.double().sum(0)
    torch.testing.assert_close(gwh.double(), gwh0.double() + total * we.double(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gwe.double(), gwe0.double() + total * wh.double(), rtol=1e-5, atol=1e-4)
    assert torch.equal(wh, wh_before) and torch.equal(we, we_before)


# ---------------------------------------------------------------- engram_hash


def _wrap64(n):
    return (n + 2**63) % 2**64 - 2**63


def _wrap32(n):
    return (n + 2**31) % 2**32 - 2**31


def _hash_loop(ids, mult, sizes, offsets):
    ids, mult, sizes, offsets = ids.tolist(), mult.tolist(), sizes.tolist(), offsets.tolist()
    n = len(mult[0])
    tables = len(sizes[0][0])
    out = []
    for layer in range(len(mult)):
        rows = []
        for tok in ids:
            h, row = 0, []
            for j in range(n):
                h ^= _wrap64(tok[j] * mult[layer][j])
                if j > 0:
                    for e in range(tables):
                        col = (j - 1) * tables + e
                        row.append(_wrap32(h % sizes[layer][j - 1][e] + offsets[layer][col]))
            rows.append(row)
        out.append(rows)
    return out


@pytest.mark.parametrize(
    "num_tokens,n,layers,tables,wide",
    [(45, 3, 2, 8, False), (45, 3, 2, 8, True), (13, 2, 1, 1, True), (17, 4, 3, 5, True), (0, 3, 2, 8, False)],
)
def test_engram_hash_matches_loop(num_tokens, n, layers, tables, wide):
    gen = _gen(num_tokens * 100 + n * 10 + layers)
    if wide:  # negative ids, huge multipliers: int64 products wrap, hashes go negative
        ids = torch.randint(-(2**31), 2**31 - 1, (num_tokens, n), dtype=torch.int32, generator=gen)
        mult = torch.randint(-(2**62), 2**62, (layers, n), dtype=torch.int64, generator=gen)
    else:  # upstream's test ranges
        ids = torch.randint(0, 100000, (num_tokens, n), dtype=torch.int32, generator=gen)
        mult = torch.randint(0, 100000, (layers, n), dtype=torch.int64, generator=gen)
    sizes = torch.randint(100000, 1000000, (layers, n - 1, tables), dtype=torch.int32, generator=gen)
    offsets = make_offsets(sizes)
    if wide:  # offsets large enough that the int32 addition wraps
        offsets = offsets + torch.randint(2**31 - 2**21, 2**31 - 1, (1, 1), dtype=torch.int32, generator=gen)
    out = engram_hash(ids, mult, sizes, offsets)
    assert out.dtype == torch.int32 and out.shape == (layers, num_tokens, (n - 1) * tables)
    assert out.is_contiguous()
    assert out.tolist() == _hash_loop(ids, mult, sizes, offsets)
    if not wide and num_tokens:
        local = out - offsets.unsqueeze(1)
        assert (local >= 0).all() and (local < sizes.reshape(layers, 1, -1)).all()


def test_make_offsets():
    gen = _gen(5)
    sizes = torch.randint(1, 1000, (3, 2, 4), dtype=torch.int32, generator=gen)
    offs = make_offsets(sizes)
    assert offs.dtype == torch.int32 and offs.shape == (3, 8)
    for layer in range(3):
        flat = sizes[layer].flatten().tolist()
        assert offs[layer].tolist() == [sum(flat[:i]) for i in range(8)]


# ---------------------------------------------------------------- EngramGateFn


@pytest.mark.parametrize("clamp", [CLAMP, 0.3], ids=["clamp1e-6", "clamp0.3"])
def test_engram_gate_fn_gradcheck(clamp):
    gen = _gen(41)
    shape = (2, 3, 4, 8)  # [batch, seq, hc_mult, hidden]: leading dims are flattened
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    wh = torch.randn(4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    we = torch.randn(4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    _, z, _ = _truth(x, k, v, wh, we, clamp, 1e-6)
    assert _clamp_margin_ok(z, clamp, 1e-3)  # gradcheck perturbs inputs by 1e-6
    if clamp > 0.1:
        assert (z.abs() < clamp).any() and (z.abs() > clamp).any()
    assert torch.autograd.gradcheck(lambda *a: engram_gate(*a, clamp, 1e-6), (x, k, v, wh, we))


def test_engram_gate_fn_matches_reference_bwd():
    """bf16: the Function's gradients are exactly engram_gate_bwd + grad_w_reduce's."""
    x, k, v, wh, we, g = _inputs(51, 24, 4, 512)
    x5, k5, g5 = (t.view(2, 12, 4, 512) for t in (x, k, g))
    v5 = v.view(2, 12, 512)
    leaves = [t.clone().requires_grad_() for t in (x5, k5, v5, wh, we)]
    out = EngramGateFn.apply(*leaves, CLAMP, EPS)
    w = fused_weight(wh, we)
    ref_out, dot, gate, rx, rk = engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    torch.testing.assert_close(out, ref_out.view(2, 12, 4, 512), rtol=0, atol=0)
    out.backward(g5)

    gx, gk, gv, gp = engram_gate_bwd(g, x, k, v, w, dot, gate, rx, rk, CLAMP)
    gwh = torch.zeros(4, 512)
    gwe = torch.zeros(4, 512)
    grad_w_reduce(gp, wh, we, gwh, gwe)
    for leaf, expect in zip(leaves, (gx.view_as(x5), gk.view_as(k5), gv.view_as(v5), gwh, gwe)):
        # autograd casts the fp32 weight gradients to the bf16 parameter dtype
        torch.testing.assert_close(leaf.grad, expect.to(leaf.dtype), rtol=0, atol=0)


def test_engram_gate_fn_main_grad():
    """Weights with main_grad: gradients accumulate there in fp32 and .grad stays None."""
    x, k, v, wh, we, g = _inputs(61, 16, 4, 256)
    wh_p, we_p = wh.clone().requires_grad_(), we.clone().requires_grad_()
    gen = _gen(62)
    start_h, start_e = torch.randn(4, 256, generator=gen), torch.randn(4, 256, generator=gen)
    wh_p.main_grad, we_p.main_grad = start_h.clone(), start_e.clone()
    xr = x.clone().requires_grad_()
    engram_gate(xr, k, v, wh_p, we_p, CLAMP, EPS).backward(g)
    assert wh_p.grad is None and we_p.grad is None and xr.grad is not None

    w = fused_weight(wh, we)
    _, dot, gate, rx, rk = engram_gate_fwd(x, k, v, w, EPS, CLAMP)
    gp = engram_gate_bwd(g, x, k, v, w, dot, gate, rx, rk, CLAMP)[3]
    exp_h, exp_e = start_h.clone(), start_e.clone()
    grad_w_reduce(gp, wh, we, exp_h, exp_e)
    torch.testing.assert_close(wh_p.main_grad, exp_h, rtol=0, atol=0)
    torch.testing.assert_close(we_p.main_grad, exp_e, rtol=0, atol=0)
    assert not torch.equal(exp_h, start_h)
