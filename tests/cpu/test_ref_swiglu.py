"""Defining properties of the SwiGLU (+ FP8 cast) references (no TileKernels needed).

The bit-exact checks recompute every element independently with NumPy float32
arithmetic (IEEE, correctly rounded) in the order the references document.
Float32 ``exp`` is the one operation taken from ``torch.exp`` itself (it is not
correctly rounded and its last bit is device-dependent; the references state
this).  The single-rounding FMA of the backward pass is checked against exact
rational arithmetic, and the gradients against float64 autograd.
"""

import math
import zlib
from fractions import Fraction

import numpy as np
import pytest
import torch

from tile_kernels_aot.torch import swiglu as S
from tile_kernels_aot.torch.quant import per_token_cast

F32 = np.float32


def _gen(key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    bad = (_bits(a) != _bits(b)).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"


def make_routing(n, num_tokens, num_topk, gen, pad_frac=0.25):
    """Random layout of n rows: some padding rows (-1), the others distinct (token, k)."""
    is_pad = torch.rand(n, generator=gen) < pad_frac
    n_used = int((~is_pad).sum())
    assert n_used <= num_tokens * num_topk
    chosen = torch.randperm(num_tokens * num_topk, generator=gen)[:n_used].to(torch.int32)
    p2tt = torch.full((n,), -1, dtype=torch.int32)
    p2tt[~is_pad] = chosen
    t2p = torch.full((num_tokens * num_topk,), -1, dtype=torch.int32)
    t2p[chosen.long()] = (~is_pad).nonzero().flatten().to(torch.int32)
    pos_to_expert = torch.where(is_pad, -1, torch.randint(0, 8, (n,), generator=gen)).to(torch.int32)
    return pos_to_expert, p2tt, t2p.view(num_tokens, num_topk)


# ---------------------------------------------------------------------------
# independent float32 model (NumPy)
# ---------------------------------------------------------------------------

def np_f32(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy().astype(F32)


def torch_exp_f32(a: np.ndarray) -> np.ndarray:
    return torch.exp(torch.from_numpy(np.ascontiguousarray(a))).numpy()


def np_clamp_halves(l, r, clamp):
    if clamp is None:
        return l, r, np.zeros(3, dtype=np.int64)
    c = F32(clamp)
    counts = np.array([(l > c).sum(), (r > c).sum(), (r < -c).sum()], dtype=np.int64)
    return np.minimum(l, c), np.minimum(np.maximum(r, -c), c), counts


def np_silu_mul(l, r):
    e = torch_exp_f32(-l)
    with np.errstate(over="ignore", invalid="ignore"):
        q = (l / (F32(1) + e)).astype(F32)
    q = np.where(l <= F32(-87.5), F32(-0.0), q).astype(F32)  # the contract's flush
    return (q * r).astype(F32)


def np_sf(amax, round_sf, clamp_min=1e-4):
    a = np.maximum(amax.astype(F32), F32(clamp_min))
    sf = (a / F32(448)).astype(F32)
    if not round_sf:
        return sf, (F32(448) / a).astype(F32)
    exp = np.array([math.frexp(float(s))[1] - (1 if math.frexp(float(s))[0] == 0.5 else 0)
                    for s in sf.reshape(-1)]).reshape(sf.shape)  # ceil(log2 sf)
    return np.ldexp(F32(1), exp).astype(F32), np.ldexp(F32(1), -exp).astype(F32)


def to_e4m3(v: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.clip(v, -448, 448).astype(F32)).to(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------
# the single-rounding FMA
# ---------------------------------------------------------------------------

def exact_fma_f32(a: float, b: float, c: float) -> float:
    """round_to_nearest_even_f32(a * b + c), from exact rationals."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    approx = F32(float(exact))
    cands = [np.nextafter(approx, F32(-np.inf)), approx, np.nextafter(approx, F32(np.inf))]
    return float(min(cands, key=lambda v: (abs(Fraction(float(v)) - exact),
                                            int(np.array(v, dtype=F32).view(np.int32)) & 1)))


def test_fma_is_single_rounding():
    gen = _gen("fma")
    n = 3000
    a = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen).float())
    b = torch.rand(n, generator=gen) * torch.exp2(-torch.randint(0, 26, (n,), generator=gen).float())
    c = torch.where(torch.rand(n, generator=gen) < 0.5, 1.0, torch.randn(n, generator=gen))
    # hard cases: a*b lands just off a float32 midpoint, by far less than a double ulp
    hard_a = [1 + 2**-18, 1 + 2**-18, -(1 + 2**-18), 1 + 2**-12]
    hard_b = [2**-24 * (1 - 2**-18), 2**-24 * (1 - 2**-18), 2**-24 * (1 - 2**-18), 2**-24 * (1 - 2**-12)]
    hard_c = [1 + 2**-23, 1.0, -(1 + 2**-23), 3 + 2**-22]
    a = torch.cat([a, torch.tensor(hard_a)])
    b = torch.cat([b, torch.tensor(hard_b)])
    c = torch.cat([c, torch.tensor(hard_c)])
    assert torch.equal(torch.tensor(hard_a + hard_b + hard_c, dtype=torch.float64),
                       torch.tensor(hard_a + hard_b + hard_c).double())  # all exact in float32
    got = torch.cat([S._fma_f32(a[i:i + 1], b[i:i + 1], float(c[i])) for i in range(len(a))])
    want = torch.tensor([exact_fma_f32(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())])
    assert_bits_equal(got, want)
    # the same through the vectorized path (c = 1 as in the backward pass)
    got1 = S._fma_f32(a, b, 1.0)
    want1 = torch.tensor([exact_fma_f32(x, y, 1.0) for x, y in zip(a.tolist(), b.tolist())])
    assert_bits_equal(got1, want1)
    # the test has teeth: plain float64 evaluation double-rounds the hard cases,
    # and an unfused float32 evaluation differs often
    naive = (a.double() * b.double() + c.double()).float()
    assert not torch.equal(naive[-4:], want[-4:])
    assert (((a * b) + c) != want).sum() > 10


# ---------------------------------------------------------------------------
# swiglu_forward_and_per_token_cast
# ---------------------------------------------------------------------------

def np_forward_per_token(x, npc, weights_row, clamp, round_sf, clamp_min, kept):
    """Independent float32 model of the fused forward: (q fp8, sf fp32 row-major, counts)."""
    xf = np_f32(x)
    h = xf.shape[1] // 2
    l, r, _ = np_clamp_halves(xf[:, :h], xf[:, h:], clamp)
    _, _, counts = np_clamp_halves(xf[kept][:, :h], xf[kept][:, h:], clamp)
    v = np_silu_mul(l, r)
    if weights_row is not None:
        v = (v * weights_row[:, None]).astype(F32)
    n = v.shape[0]
    g = v.reshape(n, h // npc, npc)
    sf, inv = np_sf(np.abs(g).max(axis=2), round_sf, clamp_min)
    q = to_e4m3((g * inv[:, :, None]).astype(F32).reshape(n, h))
    q = q.view(torch.uint8).masked_fill(~torch.from_numpy(kept)[:, None], 0).view(torch.float8_e4m3fn)
    sf = torch.from_numpy(np.where(kept[:, None], sf, F32(0)))
    return q, sf, torch.from_numpy(counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_w", [False, True])
@pytest.mark.parametrize("with_pte", [False, True])
@pytest.mark.parametrize("clamp", [None, 0.5, 3.0])
@pytest.mark.parametrize("npc,round_sf,clamp_min", [(128, False, None), (128, True, None),
                                                    ("hidden", False, 0.05), ("hidden", True, None)])
def test_forward_per_token_matches_float32_model(dtype, with_w, with_pte, clamp, npc, round_sf, clamp_min):
    gen = _gen((str(dtype), with_w, with_pte, clamp, npc, round_sf, clamp_min))
    n, hidden, num_tokens, num_topk = 37, 384, 10, 6
    npc = hidden if npc == "hidden" else npc
    pte, p2tt, _ = make_routing(n, num_tokens, num_topk, gen)
    x = (torch.randn(n, 2 * hidden, generator=gen) * 2).to(dtype)
    x[3] *= 1e-4  # a row whose amax falls under the clamp
    weights = torch.randn(num_tokens, num_topk, generator=gen)
    count0 = torch.randint(0, 100, (3,), generator=gen)
    count = count0.clone() if clamp is not None else None
    out, sf = S.swiglu_forward_and_per_token_cast(
        x, "e4m3", npc, pos_to_token_topk=p2tt if with_w else None, topk_weights=weights if with_w else None,
        pos_to_expert=pte if with_pte else None, round_sf=round_sf, swiglu_clamp_value=clamp,
        clamped_count=count, sf_clamp_min=clamp_min)

    w_row = None
    if with_w:
        w_row = np.where(p2tt.numpy() >= 0, weights.numpy().reshape(-1)[p2tt.clamp(min=0).numpy()], 0).astype(F32)
    kept = (pte >= 0).numpy() if with_pte else np.ones(n, dtype=bool)
    q_m, sf_m, counts_m = np_forward_per_token(x, npc, w_row, clamp, round_sf,
                                               1e-4 if clamp_min is None else clamp_min, kept)
    assert out.dtype == torch.float8_e4m3fn and out.shape == (n, hidden)
    assert sf.dtype == torch.float32 and sf.shape == (n, hidden // npc) and sf.is_contiguous()
    assert_bits_equal(out, q_m)
    assert_bits_equal(sf, sf_m)
    if clamp is not None:
        assert torch.equal(count, count0 + counts_m)
    # sanity of the quantization itself: dequantized values are close to the activation
    if not with_pte:
        act = S.swiglu_forward(x, p2tt if with_w else None, weights if with_w else None, clamp)
        deq = out.float().view(n, -1, npc) * sf.unsqueeze(-1)
        err = (deq.view(n, hidden) - act).abs()
        # e4m3 keeps 3 mantissa bits (relative error <= 2^-4), subnormal steps are 2^-9
        tol = act.abs() * (2**-4 + 2**-20) + sf.repeat_interleave(npc, dim=1) * 2**-10 * 1.01
        assert (err <= tol).all()


def test_forward_per_token_layouts():
    gen = _gen("layouts")
    n, hidden = 23, 640  # k = 5 groups: two packed words, 3 unused bytes; n not a multiple of 4
    x = torch.randn(n, 2 * hidden, generator=gen).bfloat16() * torch.exp2(
        torch.randint(-8, 8, (n, 1), generator=gen).float()).bfloat16()
    pte = torch.where(torch.rand(n, generator=gen) < 0.3, -1, 1).to(torch.int32)
    for round_sf in (False, True):
        q_row, sf_row = S.swiglu_forward_and_per_token_cast(x, "e4m3", 128, pos_to_expert=pte, round_sf=round_sf)
        q_col, sf_col = S.swiglu_forward_and_per_token_cast(x, "e4m3", 128, pos_to_expert=pte, round_sf=round_sf,
                                                            use_tma_aligned_col_major_sf=True)
        assert_bits_equal(q_row, q_col)
        assert sf_col.shape == (n, 5) and sf_col.stride() == (1, 24) and sf_col.dtype == torch.float32
        assert torch.equal(sf_col, sf_row)
    q_pk, sf_pk = S.swiglu_forward_and_per_token_cast(x, "e4m3", 128, pos_to_expert=pte, round_sf=True,
                                                      use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)
    assert_bits_equal(q_pk, q_row)
    assert sf_pk.shape == (n, 2) and sf_pk.stride() == (1, 24) and sf_pk.dtype == torch.int32
    bytes_ = sf_pk.contiguous().view(torch.uint8).view(n, 8)
    expected = torch.zeros(n, 8, dtype=torch.uint8)
    expected[:, :5] = (sf_row.view(torch.int32) >> 23).to(torch.uint8)  # exponent byte (0 on skipped rows)
    assert torch.equal(bytes_, expected)
    assert (expected[pte >= 0, :5] > 0).all()
    # power-of-two factors bound the group amax: amax / 448 <= sf < 2 * amax / 448
    act = S.swiglu_forward(x).view(n, 5, 128).abs().amax(-1).clamp(min=1e-4)
    kept = pte >= 0
    assert (sf_row[kept] * 448 >= act[kept]).all() and (sf_row[kept] * 224 < act[kept]).all()


def test_forward_per_token_weights_and_skips():
    gen = _gen("weights")
    n, hidden = 16, 256
    x = torch.randn(n, 2 * hidden, generator=gen).bfloat16()
    plain = S.swiglu_forward_and_per_token_cast(x, "e4m3", 128)
    # all weights 1: identical to no weights
    ones = S.swiglu_forward_and_per_token_cast(x, "e4m3", 128, torch.arange(n, dtype=torch.int32),
                                               torch.ones(4, 4))
    assert_bits_equal(plain[0], ones[0])
    assert_bits_equal(plain[1], ones[1])
    # power-of-two weights scale the sf exactly and leave the fp8 bytes alone
    p2tt = torch.randperm(n, generator=gen).to(torch.int32)
    w = torch.exp2(torch.randint(-3, 4, (n,), generator=gen).float())
    scaled = S.swiglu_forward_and_per_token_cast(x, "e4m3", 128, p2tt, w.view(2, 8))
    assert_bits_equal(scaled[0], plain[0])
    assert torch.equal(scaled[1], plain[1] * w[p2tt.long()].unsqueeze(1))
    # negative position: weight 0 -> zero values, the minimal scale factor
    p2tt[5] = -1
    z = S.swiglu_forward_and_per_token_cast(x, "e4m3", 128, p2tt, w.view(2, 8))
    assert (z[0][5].float() == 0).all()
    assert (z[1][5] == torch.tensor(1e-4) / torch.tensor(448.0)).all()


def test_forward_per_token_empty_and_errors():
    x = torch.empty(0, 512, dtype=torch.bfloat16)
    for col, rnd, pk, shape, dtype in ((False, False, False, (0, 2), torch.float32),
                                      (True, True, False, (0, 2), torch.float32),
                                      (True, True, True, (0, 1), torch.int32)):
        q, sf = S.swiglu_forward_and_per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=col,
                                                    round_sf=rnd, use_packed_ue8m0=pk)
        assert q.shape == (0, 256) and sf.shape == shape and sf.dtype == dtype
    x = torch.randn(4, 512).bfloat16()
    f = S.swiglu_forward_and_per_token_cast
    with pytest.raises(ValueError, match="fmt"):
        f(x, "e2m1", 128)
    with pytest.raises(ValueError, match="num_per_channels"):
        f(x, "e4m3", 64)
    with pytest.raises(ValueError, match="num_per_channels"):
        f(x, "e4m3", 256, use_tma_aligned_col_major_sf=True)
    with pytest.raises(ValueError, match="use_packed_ue8m0"):
        f(x, "e4m3", 128, use_packed_ue8m0=True, round_sf=True)
    with pytest.raises(ValueError, match="clamped_count"):
        f(x, "e4m3", 128, clamped_count=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="clamped_count"):
        f(x, "e4m3", 128, swiglu_clamp_value=1.0, clamped_count=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_weights"):
        f(x, "e4m3", 128, pos_to_token_topk=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="x"):
        f(torch.randn(4, 320).bfloat16(), "e4m3", 128)
    with pytest.raises(ValueError, match="contiguous"):
        f(torch.randn(512, 4).bfloat16().T, "e4m3", 128)
    with pytest.raises(TypeError, match="x"):
        f(x.half(), "e4m3", 128)
    with pytest.raises(ValueError, match="sf_clamp_min"):
        f(x, "e4m3", 128, sf_clamp_min=0.0)


# ---------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------

def _backward_inputs(key, n=40, hidden=256, npc=128, num_tokens=12, num_topk=4, round_sf=False):
    gen = _gen(key)
    _, p2tt, t2p = make_routing(n, num_tokens, num_topk, gen)
    x = (torch.randn(n, 2 * hidden, generator=gen) * 2).bfloat16()
    x_q = per_token_cast(x, "e4m3", npc, round_sf=round_sf)
    grad_out = torch.randn(n, hidden, generator=gen).bfloat16()
    weight = torch.rand(num_tokens, num_topk, generator=gen)
    return x_q, grad_out, weight, p2tt, t2p


@pytest.mark.parametrize("npc", [32, 128])
@pytest.mark.parametrize("clamp", [None, 0.5, 2.0])
def test_backward_matches_float64_autograd(npc, clamp):
    # power-of-two sf: dequantized values hit the clamp boundary exactly now and then
    x_q, grad_out, weight, p2tt, t2p = _backward_inputs(("autograd", npc, clamp), npc=npc, round_sf=True)
    out, x_grad, w_grad = S.swiglu_backward(x_q, grad_out, weight, p2tt, t2p, npc, clamp)
    n, hidden = grad_out.shape
    xf = (x_q[0].float().view(n, -1, npc) * x_q[1].unsqueeze(-1)).view(n, -1).double()
    l = xf[:, :hidden].clone().requires_grad_()
    r = xf[:, hidden:].clone().requires_grad_()
    w_flat = weight.double().reshape(-1).clone().requires_grad_()
    valid = p2tt >= 0
    w_row = torch.where(valid, w_flat[p2tt.long().clamp(min=0)], torch.zeros((), dtype=torch.float64))
    lc, rc = l, r
    if clamp is not None:  # clamped (zero gradient) only strictly beyond c, as the kernel decides
        lc = torch.where(l > clamp, clamp, l)
        rc = torch.where(r > clamp, clamp, torch.where(r < -clamp, -clamp, r))
        assert ((xf == clamp) | (xf == -clamp)).any()  # the boundary itself is exercised
    out64 = torch.nn.functional.silu(lc) * rc * w_row[:, None]
    (grad_out.double() * out64).sum().backward()
    torch.testing.assert_close(out.double(), out64.detach(), rtol=1e-5, atol=1e-6)
    grad64 = torch.cat([l.grad, r.grad], dim=1)
    torch.testing.assert_close(x_grad.double(), grad64, rtol=1e-5, atol=1e-5 * grad64.abs().max().item())
    # the routing-weight gradient: autograd's, except entries no row maps to are 0
    torch.testing.assert_close(w_grad.double().view(-1), w_flat.grad, rtol=1e-5, atol=1e-5)
    assert (w_grad[t2p < 0] == 0).all()
    assert (x_grad[~valid] == 0).all() and (out[~valid] == 0).all()
    if clamp is not None:
        assert (x_grad[:, :hidden][xf[:, :hidden] > clamp] == 0).all()
        assert (x_grad[:, hidden:][xf[:, hidden:].abs() > clamp] == 0).all()


def test_backward_float32_order_of_operations():
    x_q, grad_out, weight, p2tt, t2p = _backward_inputs("order", n=24, hidden=128)
    clamp = 1.5
    out, x_grad, _ = S.swiglu_backward(x_q, grad_out, weight, p2tt, t2p, 128, clamp)
    n, hidden = grad_out.shape
    xf = (np_f32(x_q[0]).reshape(n, -1, 128) * np_f32(x_q[1])[:, :, None]).astype(F32).reshape(n, -1)
    l0, r0 = xf[:, :hidden], xf[:, hidden:]
    l, r, _ = np_clamp_halves(l0, r0, clamp)
    w = np.where(p2tt.numpy() >= 0, weight.numpy().reshape(-1)[p2tt.clamp(min=0).numpy()], 0).astype(F32)
    d = (F32(1) + torch_exp_f32(-l)).astype(F32)
    act = ((l / d).astype(F32) * r).astype(F32)
    s = (F32(1) / d).astype(F32)
    g_ws = ((np_f32(grad_out) * w[:, None]).astype(F32) * s).astype(F32)
    gr = np.where(np.abs(r0) > F32(clamp), F32(0), (g_ws * l).astype(F32))
    assert_bits_equal(out, torch.from_numpy((act * w[:, None]).astype(F32)))
    assert_bits_equal(x_grad[:, hidden:], torch.from_numpy(gr))
    # left gradient: (g_ws * r) * fma(l, 1 - s, 1) with the exact FMA, on a sample
    gen = _gen("order-sample")
    rows = torch.randint(0, n, (400,), generator=gen).tolist()
    cols = torch.randint(0, hidden, (400,), generator=gen).tolist()
    for i, j in zip(rows, cols):
        if l0[i, j] > F32(clamp):
            want = 0.0
        else:
            f = F32(exact_fma_f32(float(l[i, j]), float(F32(1) - s[i, j]), 1.0))
            want = float(F32(F32(g_ws[i, j] * r[i, j]) * f))
        assert x_grad[i, j].item() == want, (i, j)


@pytest.mark.parametrize("npc", [32, 128])
@pytest.mark.parametrize("round_sf", [False, True])
def test_backward_and_per_token_cast_is_backward_then_cast(npc, round_sf):
    x_q, grad_out, weight, p2tt, t2p = _backward_inputs(("fused", npc, round_sf), npc=npc)
    out, (gq, gsf), x_grad, w_grad = S.swiglu_backward_and_per_token_cast(
        x_q, grad_out, weight, p2tt, t2p, npc, round_sf=round_sf, swiglu_clamp_value=1.0)
    out32, x_grad32, w_grad32 = S.swiglu_backward(x_q, grad_out, weight, p2tt, t2p, npc, 1.0)
    assert out.dtype == torch.bfloat16 and x_grad.dtype == torch.bfloat16
    assert_bits_equal(out, out32.bfloat16())
    assert_bits_equal(x_grad, x_grad32.bfloat16())
    assert_bits_equal(w_grad, w_grad32)
    gq_ref, gsf_ref = per_token_cast(x_grad32, "e4m3", npc, round_sf=round_sf)
    assert_bits_equal(gq, gq_ref)
    assert_bits_equal(gsf, gsf_ref)
    assert gsf.shape == (grad_out.shape[0], 2 * grad_out.shape[1] // npc) and gsf.is_contiguous()
    # a 3-D input is the same rows
    n = grad_out.shape[0]
    res3 = S.swiglu_backward_and_per_token_cast(
        (x_q[0].view(2, n // 2, -1), x_q[1]), grad_out.view(2, n // 2, -1), weight, p2tt, t2p, npc,
        round_sf=round_sf, swiglu_clamp_value=1.0)
    assert_bits_equal(res3[0], out)
    assert_bits_equal(res3[2], x_grad)


def test_backward_with_no_rows_gives_zero_weight_grad():
    """Every pair unrouted: x has 0 rows, weight_grad is all zeros (and every other output empty)."""
    k, hidden = 4, 256
    t2p = torch.full((64, k), -1, dtype=torch.int32)
    x_q = (torch.zeros(0, 2 * hidden, dtype=torch.float8_e4m3fn), torch.zeros(0, 2 * hidden // 128))
    out, (gq, gsf), x_grad, w_grad = S.swiglu_backward_and_per_token_cast(
        x_q, torch.zeros(0, hidden, dtype=torch.bfloat16), torch.rand(64, k), torch.zeros(0, dtype=torch.int32),
        t2p, 128)
    assert out.shape == (0, hidden) and gq.shape == (0, 2 * hidden) and gsf.shape == (0, 4)
    assert x_grad.shape == (0, 2 * hidden)
    assert_bits_equal(w_grad, torch.zeros(64, k))


def test_backward_errors():
    x_q, grad_out, weight, p2tt, t2p = _backward_inputs("errors")
    f = S.swiglu_backward_and_per_token_cast
    with pytest.raises(ValueError, match="num_per_channels"):
        f(x_q, grad_out, weight, p2tt, t2p, 64)
    with pytest.raises(TypeError, match="grad_out"):
        f(x_q, grad_out.float(), weight, p2tt, t2p, 128)
    with pytest.raises(TypeError, match="weight"):
        f(x_q, grad_out, weight.double(), p2tt, t2p, 128)
    with pytest.raises(ValueError, match=r"x\[1\]"):
        f((x_q[0], x_q[1][:, :1].contiguous()), grad_out, weight, p2tt, t2p, 128)
    with pytest.raises(TypeError, match="x"):
        f(x_q[0], grad_out, weight, p2tt, t2p, 128)


# ---------------------------------------------------------------------------
# swiglu_forward_and_per_channel_cast_and_transpose
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("npt", [32, 128])
@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("clamp", [None, 0.75])
def test_per_channel_matches_float32_model(npt, round_sf, clamp):
    gen = _gen(("chan", npt, round_sf, clamp))
    n, hidden = 256, 192
    x = (torch.randn(n, 2 * hidden, generator=gen) * 2).bfloat16()
    x[:, 7] = 0  # a channel that is zero everywhere in its half: amax under the clamp
    out_t, sf_t = S.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", npt, round_sf, False, clamp)
    out, sf = S.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", npt, round_sf, True, clamp)

    xf = np_f32(x)
    l, r, _ = np_clamp_halves(xf[:, :hidden], xf[:, hidden:], clamp)
    act = torch.from_numpy(np_silu_mul(l, r)).bfloat16().float().numpy()  # rounded to bf16
    blocks = act.reshape(n // npt, npt, hidden)
    sf_m, inv = np_sf(np.abs(blocks).max(axis=1), round_sf)
    q = to_e4m3((blocks * inv[:, None, :]).astype(F32).reshape(n, hidden))

    assert out.shape == (n, hidden) and out_t.shape == (hidden, n)
    assert out.is_contiguous() and out_t.is_contiguous()
    assert sf.shape == (n // npt, hidden) and sf.dtype == torch.float32 and sf.is_contiguous()
    assert_bits_equal(out, q)
    assert_bits_equal(out_t, q.T.contiguous())
    assert_bits_equal(sf, torch.from_numpy(sf_m))
    assert_bits_equal(sf_t, sf)


def test_per_channel_errors():
    f = S.swiglu_forward_and_per_channel_cast_and_transpose
    with pytest.raises(ValueError, match="x"):
        f(torch.randn(100, 256).bfloat16(), "e4m3", 32)
    with pytest.raises(ValueError, match="x"):
        f(torch.randn(128, 192).bfloat16(), "e4m3", 32)
    with pytest.raises(TypeError, match="x"):
        f(torch.randn(128, 256), "e4m3", 32)
    with pytest.raises(ValueError, match="num_per_tokens"):
        f(torch.randn(128, 256).bfloat16(), "e4m3", 64)
    with pytest.raises(ValueError, match="fmt"):
        f(torch.randn(128, 256).bfloat16(), "e5m6", 32)
    q, sf = f(torch.empty(0, 256, dtype=torch.bfloat16), "e4m3", 32)
    assert q.shape == (128, 0) and sf.shape == (0, 128)


def test_swiglu_forward_counts_accumulate():
    gen = _gen("counts")
    x = torch.randn(9, 512, generator=gen).bfloat16()
    count = torch.tensor([5, 6, 7])
    S.swiglu_forward(x, swiglu_clamp_value=0.25, clamped_count=count)
    xf = x.float()
    want = torch.tensor([(xf[:, :256] > 0.25).sum(), (xf[:, 256:] > 0.25).sum(), (xf[:, 256:] < -0.25).sum()])
    assert torch.equal(count, want + torch.tensor([5, 6, 7]))


def test_forward_silu_is_negative_zero_at_and_below_minus_87_5():
    """The forward SiLU's quotient is -0 for l <= -87.5 (the IEEE quotient there is
    below 2^-119 in magnitude, or -0 already); just above, it is the IEEE quotient."""
    l = torch.tensor([-87.5, -88.0, -88.5, -89.0, -1e30, -87.0, -86.5, -3.0, 0.0, 2.0])
    r = torch.tensor([1.0, -1.0, 2.0, -3.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0])
    got = S.swiglu_forward(torch.cat([l, r]).view(1, -1)).view(-1)
    want = np_silu_mul(l.numpy(), r.numpy())
    assert torch.equal(got.view(torch.int32), torch.from_numpy(want).view(torch.int32))
    # the flushed ones are signed zeros (-0 * r), the one at -87.0 is not flushed
    assert torch.equal(got[:5].view(torch.int32), (torch.tensor(-0.0) * r[:5]).view(torch.int32))
    assert got[5] != 0 and torch.signbit(got[5])


def test_backward_weight_grad_is_the_correctly_rounded_dot():
    """weight_grad: the exact sum of the exact float32 products, rounded once to float32
    (checked with rational arithmetic on a sample of rows, cancellation included)."""
    x_q, grad_out, weight, p2tt, t2p = _backward_inputs("dot", n=24, hidden=384)
    out, _, w_grad = S.swiglu_backward(x_q, grad_out, weight, p2tt, t2p, 128, 1.0)
    n, hidden = grad_out.shape
    g = grad_out.float()
    a = torch.randn(n, hidden, generator=_gen("dot-a"))
    a[0] = a[0] * 1e30  # a cancelling row: large terms
    a[0, hidden // 2:] = -a[0, :hidden // 2]
    got = S._dot_rows_f32(g, a)
    for i in range(n):
        exact = sum((Fraction(float(x)) * Fraction(float(y)) for x, y in zip(g[i].tolist(), a[i].tolist())), Fraction(0))
        want = np.float32(exact_round_f32(exact))
        assert got[i].item() == float(want), (i, got[i].item(), float(want))
    assert (w_grad[t2p < 0] == 0).all()


def exact_round_f32(q: Fraction) -> float:
    """A rational rounded to the nearest float32 (ties to even), exactly."""
    if q == 0:
        return 0.0
    f = float(np.float32(float(q)))  # a float32 within one ulp; then fix by comparison
    cand = [np.float32(f), np.nextafter(np.float32(f), np.float32(np.inf)), np.nextafter(np.float32(f), np.float32(-np.inf))]
    best = min(cand, key=lambda c: (abs(Fraction(float(c)) - q), int(np.float32(c).view(np.uint32)) & 1))
    return float(best)
