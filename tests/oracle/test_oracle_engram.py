"""Engram references against TileKernels 1.0.0.

Oracles: ``tile_kernels.torch.engram`` (``engram_gate_ref``, ``engram_hash_ref``,
``make_offsets``) and, for ``fused_weight`` / ``grad_w_reduce``, the definitions
upstream's own tests use.  Inputs follow upstream's tests (bf16 ``randn``,
``eps = 1e-20``, ``clamp_value = 1e-6``, ``hc_mult = 4``, hidden sizes that are
multiples of 128 from 2048 to 7168, hash ids / multipliers below 1e5 and table
sizes in [1e5, 1e6)); token counts are cut down where the float32 work on two
CPU cores would be slow.

Exactness:
* ``engram_hash``, ``make_offsets``, ``fused_weight``, ``grad_w_reduce``,
  ``rstd_x``, ``rstd_k``: bit-exact.
* ``dot`` (and through it ``gate_score`` and ``output``): the oracle sums with
  ``einsum``, we with ``sum``; both are fp32 sums of the same fp32 products in
  a different order, so they agree within ``1e-5 * sum|terms|``; the gate
  within that error propagated through sigmoid(signed sqrt); the bf16 output
  bit-exactly wherever the gates agree, else within one bf16 ulp plus
  ``|gate diff| * |v|`` plus fp32 rounding of ``x + gate * v`` (which matters
  only where that sum cancels).  Ours is the more accurate of the two (mean
  distance to the float64 dot ~10x smaller), which the test also asserts.
  The fp32 outputs pass upstream's kernel threshold ``calc_diff < 2e-10``;
  the bf16 output does not at H = 7168, because the oracle's own output is
  ~2.3e-10 from the correctly rounded one there.
* backward (oracle: autograd through ``engram_gate_ref``, as upstream's test
  does, with the oracle's saved intermediates): ``grad_v`` bit-exact;
  ``grad_x`` / ``grad_k`` within one bf16 ulp (+1e-5 of the largest entry);
  weight gradients within ``1e-5`` of the sum of the magnitudes of their
  terms; all within upstream's threshold ``calc_diff < 1e-8``.

Known disagreement: when ``dot == 0`` exactly (e.g. an all-zero row of
``hidden_states``), upstream's torch reference uses ``sign(z) * sqrt(...)``
and gives gate 0.5, while upstream's kernel uses ``copysign`` and gives
``sigmoid(+sqrt(clamp_value))``.  We follow the kernel (what TileKernels
computes on the GPU); ``test_zero_dot_follows_kernel`` pins this down.
"""

import inspect
import math

import pytest

tile_kernels = pytest.importorskip("tile_kernels")

import torch  # noqa: E402
import tile_kernels.engram as tk_engram  # noqa: E402
import tile_kernels.modeling.engram as tk_modeling  # noqa: E402
import tile_kernels.torch.engram as tk_ref  # noqa: E402
from tile_kernels.testing.numeric import calc_diff  # noqa: E402

from tile_kernels_aot.modeling import engram as our_modeling  # noqa: E402
from tile_kernels_aot.torch import engram as ours  # noqa: E402

EPS = 1e-20
CLAMP = 1e-6
HC = 4
HIDDEN_SIZES = [2048, 2560, 3072, 4096, 6144, 7168]  # upstream's generate_hidden_sizes(128)


def _tokens(hidden):
    # upstream: 4001 and 8001; the math is per token, so fewer keep the CPU run short
    # (1001 still gives every one of the 132 weight-gradient chunks 8 tokens).
    return 1001 if hidden == 2048 else 201


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", ["engram_gate_fwd", "engram_gate_bwd", "grad_w_reduce", "fused_weight", "engram_hash"])
def test_signature_matches_upstream(name):
    assert _params(getattr(ours, name)) == _params(getattr(tk_engram, name))


def test_modeling_interface_matches_upstream():
    assert _params(our_modeling.EngramGateFn.forward) == _params(tk_modeling.EngramGateFn.forward)
    assert _params(our_modeling.EngramGateFn.backward) == _params(tk_modeling.EngramGateFn.backward)
    assert our_modeling.engram_gate == our_modeling.EngramGateFn.apply
    assert _params(ours.make_offsets) == _params(tk_ref.make_offsets)


def _gate_inputs(seed, num_tokens, hidden):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).bfloat16()

    x, k = randn(num_tokens, HC, hidden), randn(num_tokens, HC, hidden)
    v = randn(num_tokens, hidden)
    wh, we = randn(HC, hidden), randn(HC, hidden)
    grad_out = randn(num_tokens, HC, hidden)
    return x, k, v, wh, we, grad_out


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _bf16_ulp(t):
    mag = t.double().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


# ---------------------------------------------------------------- hash


def _hash_inputs(seed, num_tokens, n, layers, tables, wide=False):
    gen = torch.Generator().manual_seed(seed)
    if wide:  # beyond upstream's ranges: negative ids, int64-overflowing products
        ids = torch.randint(-(2**31), 2**31 - 1, (num_tokens, n), dtype=torch.int32, generator=gen)
        mult = torch.randint(-(2**62), 2**62, (layers, n), dtype=torch.int64, generator=gen)
    else:
        ids = torch.randint(0, 100000, (num_tokens, n), dtype=torch.int32, generator=gen)
        mult = torch.randint(0, 100000, (layers, n), dtype=torch.int64, generator=gen)
    sizes = torch.randint(100000, 1000000, (layers, n - 1, tables), dtype=torch.int32, generator=gen)
    return ids, mult, sizes


@pytest.mark.parametrize(
    "num_tokens,n,layers,tables,wide",
    [(4001, 3, 2, 8, False), (8001, 3, 2, 8, False), (4001, 3, 2, 8, True),
     (777, 2, 1, 4, False), (777, 4, 3, 8, True), (0, 3, 2, 8, False)],
)
def test_engram_hash_bit_exact(num_tokens, n, layers, tables, wide):
    ids, mult, sizes = _hash_inputs(num_tokens + n + layers, num_tokens, n, layers, tables, wide)
    offsets = tk_ref.make_offsets(sizes)
    _same(ours.make_offsets(sizes), offsets)
    _same(ours.engram_hash(ids, mult, sizes, offsets), tk_ref.engram_hash_ref(ids, mult, sizes, offsets))


# ---------------------------------------------------------------- fused_weight / grad_w_reduce


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_fused_weight_bit_exact(hidden):
    _, _, _, wh, we, _ = _gate_inputs(hidden, 0, hidden)
    _same(ours.fused_weight(wh, we), wh.float() * we.float())  # upstream test's definition


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_grad_w_reduce_within_the_summation_order_bound(hidden):
    """Our rows add in order (the kernel's order), upstream's definition with ``sum(0)``: the two
    differ by at most the float32 bound of reordering a sum of P terms, plus the last add."""
    gen = torch.Generator().manual_seed(hidden + 1)
    partial = torch.randn(132, HC, hidden, generator=gen)  # 132 = SMs of an H200
    wh = torch.randn(HC, hidden, generator=gen).bfloat16()
    we = torch.randn(HC, hidden, generator=gen).bfloat16()
    gwh, gwe = torch.randn(HC, hidden, generator=gen), torch.randn(HC, hidden, generator=gen)
    exp_h, exp_e = gwh.clone(), gwe.clone()
    # upstream test's definition
    total = partial.sum(0)
    exp_h += total * we.float()
    exp_e += total * wh.float()
    before_h, before_e = gwh.clone(), gwe.clone()
    assert ours.grad_w_reduce(partial, wh, we, gwh, gwe) is None
    eps = 2.0 ** -24
    reorder = 2 * partial.shape[0] * eps * partial.abs().sum(0)
    for got, want, before, w in ((gwh, exp_h, before_h, we), (gwe, exp_e, before_e, wh)):
        bound = reorder * w.float().abs() + 4 * eps * (before.abs() + (want - before).abs())
        assert got.dtype == want.dtype and got.shape == want.shape
        assert bool(((got - want).abs() <= bound).all())


# ---------------------------------------------------------------- gate forward


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_engram_gate_fwd(hidden):
    num_tokens = _tokens(hidden)
    x, k, v, wh, we, _ = _gate_inputs(hidden * 3, num_tokens, hidden)
    expect = tk_ref.engram_gate_ref(x, k, v, wh, we, CLAMP, EPS, save_for_backward=True)
    got = ours.engram_gate_fwd(x, k, v, ours.fused_weight(wh, we), EPS, CLAMP, save_for_backward=True)
    for a, b in zip(got, expect):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    out, dot, gate, rstd_x, rstd_k = got
    out_o, dot_o, gate_o, rstd_x_o, rstd_k_o = expect

    # sums of squares in the kernel's lane order and 1 / sqrt (not rsqrt): a few float32 ulps
    for a, b in ((rstd_x, rstd_x_o), (rstd_k, rstd_k_o)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=5e-7, atol=0)

    terms_abs = (x.double() * wh.double() * k.double() * we.double()).abs().sum(-1)
    dot_err = 1e-5 * terms_abs
    assert ((dot.double() - dot_o.double()).abs() <= dot_err).all()

    z = dot_o.double() * rstd_x.double() * rstd_k.double() / math.sqrt(hidden)
    z_err = dot_err * rstd_x.double() * rstd_k.double() / math.sqrt(hidden)
    slope = 0.125 / z.abs().clamp_min(CLAMP).sqrt()  # |d sigmoid(sqrt|z|) / dz| bound
    gate_diff = (gate.double() - gate_o.double()).abs()
    assert (gate_diff <= slope * z_err + 1e-7).all()

    same_gate = (gate == gate_o).unsqueeze(-1).expand_as(out)
    assert torch.equal(out[same_gate], out_o[same_gate])
    # elsewhere: the fp32 values differ by |gate diff| * |v| (plus fp32 rounding of
    # x + g * v, which matters where it cancels), then each rounds to bf16
    gv_abs = gate_o.double().unsqueeze(-1) * v.double().abs().unsqueeze(1)
    out_bound = _bf16_ulp(torch.maximum(out.double().abs(), out_o.double().abs()))
    out_bound += gate_diff.unsqueeze(-1) * v.double().abs().unsqueeze(1)
    out_bound += 2.0**-22 * (x.double().abs() + gv_abs)
    assert ((out.double() - out_o.double()).abs() <= out_bound).all()

    # upstream's acceptance threshold for its kernel, on the fp32 outputs.  (Not on the
    # bf16 output: the oracle's einsum accumulates less accurately than our sum, and at
    # H = 7168 the oracle is itself ~2.3e-10 from the correctly rounded output.)
    for a, b in zip(got[1:], expect[1:]):
        assert calc_diff(a, b) < 2e-10
    # ... and we are at least as close to the float64 definition as the oracle is.
    dot64 = (x.double() * wh.double() * k.double() * we.double()).sum(-1)
    assert (dot.double() - dot64).abs().mean() <= (dot_o.double() - dot64).abs().mean()
    z64 = dot64 * rstd_x.double() * rstd_k.double() / math.sqrt(hidden)
    gate64 = torch.sigmoid(torch.sign(z64) * z64.abs().clamp_min(CLAMP).sqrt())
    assert (gate.double() - gate64).abs().mean() <= (gate_o.double() - gate64).abs().mean()

    plain = ours.engram_gate_fwd(x, k, v, ours.fused_weight(wh, we), EPS, CLAMP, save_for_backward=False)
    assert plain[1:] == (None, None, None, None)
    _same(plain[0], out)


def test_zero_dot_follows_kernel():
    """The one known disagreement with the oracle: dot == 0 (see module docstring)."""
    x, k, v, wh, we, _ = _gate_inputs(5, 8, 2048)
    x[3, 2] = 0
    clamp = 0.01
    _, dot_o, gate_o, _, _ = tk_ref.engram_gate_ref(x, k, v, wh, we, clamp, EPS, save_for_backward=True)
    _, dot, gate, _, _ = ours.engram_gate_fwd(x, k, v, ours.fused_weight(wh, we), EPS, clamp)
    assert dot_o[3, 2].item() == 0.0 and dot[3, 2].item() == 0.0
    assert gate_o[3, 2].item() == 0.5
    assert gate[3, 2].item() == torch.sigmoid(torch.tensor(clamp).sqrt()).item()
    mask = torch.ones_like(gate, dtype=torch.bool)
    mask[3, 2] = False
    assert ((gate - gate_o).abs()[mask] < 1e-5).all()


# ---------------------------------------------------------------- gate backward


def _oracle_backward(x, k, v, wh, we, grad_out):
    """Upstream's test recipe: autograd through engram_gate_ref, fp32 weight leaves."""
    leaves = [x.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_(),
              wh.float().requires_grad_(), we.float().requires_grad_()]
    out, dot, gate, rstd_x, rstd_k = tk_ref.engram_gate_ref(*leaves, CLAMP, EPS, save_for_backward=True)
    out.backward(grad_out)
    saved = tuple(t.detach() for t in (dot, gate, rstd_x, rstd_k))
    return out.detach(), saved, [t.grad for t in leaves]


def _check_grads(got, expect, x, k, wh, we, r_x_k_abs, same_gate):
    gx, gk, gv, gwh, gwe = got
    ex, ek, ev, ewh, ewe = expect
    for a, b in [(gx, ex), (gk, ek)]:
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        bound = _bf16_ulp(b) + 1e-5 * b.double().abs().amax()
        assert ((a.double() - b.double()).abs() <= bound).all()
    if same_gate:  # grad_v = sum_h grad_out * gate: bit-exact given the same gate
        _same(gv, ev)
    else:
        assert gv.dtype == ev.dtype == torch.bfloat16 and gv.shape == ev.shape
        assert ((gv.double() - ev.double()).abs() <= _bf16_ulp(ev) + 1e-5 * ev.double().abs().amax()).all()
    for a, b, other in [(gwh, ewh, we), (gwe, ewe, wh)]:
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        bound = 1e-5 * r_x_k_abs * other.double().abs() + 1e-30
        assert ((a.double() - b.double()).abs() <= bound).all()
    for a, b in zip(got, expect):  # upstream's acceptance threshold for its kernel
        assert calc_diff(a, b) < 1e-8


def _r_x_k_abs(x, k, v, grad_out, dot, gate, rstd_x, rstd_k, hidden):
    """sum_t |dL/d dot * x * k| in float64: the scale of the weight gradients' terms."""
    c = rstd_x.double() * rstd_k.double() / math.sqrt(hidden)
    dl_dgate = (grad_out.double() * v.double().unsqueeze(1)).sum(-1)
    gate = gate.double()
    r = dl_dgate * gate * (1 - gate) * 0.5 * (c / dot.double().abs()).sqrt()
    return (r.abs().unsqueeze(-1) * (x.double() * k.double()).abs()).sum(0)


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_engram_gate_bwd(hidden):
    num_tokens = _tokens(hidden)
    x, k, v, wh, we, grad_out = _gate_inputs(hidden * 5, num_tokens, hidden)
    _, saved, expect = _oracle_backward(x, k, v, wh, we, grad_out)

    gx, gk, gv, partial = ours.engram_gate_bwd(grad_out, x, k, v, ours.fused_weight(wh, we), *saved, CLAMP)
    assert partial.shape == (ours.DEFAULT_NUM_PERSISTENT_BLOCKS, HC, hidden) and partial.dtype == torch.float32
    gwh = torch.zeros(HC, hidden)
    gwe = torch.zeros(HC, hidden)
    ours.grad_w_reduce(partial, wh, we, gwh, gwe)
    r_x_k_abs = _r_x_k_abs(x, k, v, grad_out, *saved, hidden)
    _check_grads((gx, gk, gv, gwh, gwe), expect, x, k, wh, we, r_x_k_abs, same_gate=True)


def test_engram_gate_fn_against_oracle_autograd():
    """Our autograd Function (fwd + bwd on the references) against autograd of the oracle.

    The two pipelines run separate forwards whose dot products differ by fp32 rounding;
    where z is near 0 the gradient (~1/sqrt|z|) amplifies that, so tokens with
    |z| < 0.05 get a zero upstream gradient here (test_engram_gate_bwd covers them with
    shared intermediates).
    """
    hidden = 2048
    x, k, v, wh, we, grad_out = _gate_inputs(77, 6 * 50, hidden)
    _, dot0, _, rx0, rk0 = tk_ref.engram_gate_ref(x, k, v, wh, we, CLAMP, EPS, save_for_backward=True)
    ill = (dot0 * rx0 * rk0).abs() / math.sqrt(hidden) < 0.05
    assert 0 < ill.sum() < ill.numel() // 10
    grad_out[ill] = 0
    out_o, saved, expect = _oracle_backward(x, k, v, wh, we, grad_out)

    shape = (6, 50, HC, hidden)
    leaves = [x.view(shape).clone().requires_grad_(), k.view(shape).clone().requires_grad_(),
              v.view(6, 50, hidden).clone().requires_grad_(), wh.clone().requires_grad_(),
              we.clone().requires_grad_()]
    out = our_modeling.engram_gate_ref(*leaves, CLAMP, EPS)
    assert out.shape == shape and out.dtype == torch.bfloat16
    assert calc_diff(out, out_o.view(shape)) < 2e-10
    out.backward(grad_out.view(shape))
    # Weight .grad lands in the bf16 parameter dtype; compare the fp32 values through main_grad.
    wh_m, we_m = wh.clone().requires_grad_(), we.clone().requires_grad_()
    wh_m.main_grad, we_m.main_grad = torch.zeros(HC, hidden), torch.zeros(HC, hidden)
    our_modeling.engram_gate_ref(x.view(shape), k.view(shape), v.view(6, 50, hidden), wh_m, we_m, CLAMP, EPS).backward(
        grad_out.view(shape)
    )
    got = (leaves[0].grad.view_as(x), leaves[1].grad.view_as(k), leaves[2].grad.view_as(v),
           wh_m.main_grad, we_m.main_grad)
    # The gates come from different forwards: grad_v is compared within rounding.
    r_x_k_abs = _r_x_k_abs(x, k, v, grad_out, *saved, hidden)
    _check_grads(got, expect, x, k, wh, we, r_x_k_abs, same_gate=False)
    _same(leaves[3].grad, wh_m.main_grad.bfloat16())
    _same(leaves[4].grad, we_m.main_grad.bfloat16())
