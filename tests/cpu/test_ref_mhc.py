"""Properties of the mHC references (tile_kernels_aot.torch.mhc) and of the
autograd pipeline built on them (tile_kernels_aot.modeling.mhc).

Runs without TileKernels: each forward is checked against a slow loop written
here from the operator's definition, each ``*_bwd`` against autograd through its
forward reference and against finite differences (``gradcheck``, float64).
"""

import math

import pytest
import torch
from torch.autograd import gradcheck

from tile_kernels_aot.modeling import mhc as mm
from tile_kernels_aot.torch import mhc as ref

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tensors are tiny; a second intra-op thread only adds wake-up cost.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float32, scale=1.0, requires_grad=False):
    t = (torch.randn(*shape, generator=gen, dtype=torch.float32 if dtype != F64 else F64) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def _mixes_inputs(gen, lead, mhc, dtype=torch.float32):
    m3 = mhc * (mhc + 2)
    return (
        _randn(gen, *lead, m3, dtype=dtype),
        _randn(gen, 3, dtype=dtype, scale=0.5),
        _randn(gen, m3, dtype=dtype, scale=0.5),
    )


# ----------------------------------------------------------------------------
# expand
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mhc", [1, 2, 4])
def test_expand_to_mhc(mhc):
    gen = _gen(1)
    hidden = _randn(gen, 2, 5, 96, dtype=torch.bfloat16)
    out = ref.expand_to_mhc(hidden, mhc)
    assert out.shape == (2, 5, mhc, 96) and out.dtype == torch.bfloat16 and out.is_contiguous()
    for m in range(mhc):
        assert torch.equal(out[:, :, m], hidden)
    buf = torch.full((2, 5, mhc, 96), float("nan"), dtype=torch.bfloat16)
    assert ref.expand_to_mhc(hidden, mhc, out=buf) is buf
    assert torch.equal(buf, out)


def test_expand_to_mhc_bwd():
    gen = _gen(2)
    grad = _randn(gen, 3, 7, 4, 64, dtype=torch.bfloat16)
    # float32 accumulation in stream order, one rounding at the end
    acc = torch.zeros(3, 7, 64)
    for m in range(4):
        acc = acc + grad[:, :, m].float()
    got = ref.expand_to_mhc_bwd(grad)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 7, 64)
    assert torch.equal(got, acc.bfloat16())


# ----------------------------------------------------------------------------
# Sinkhorn
# ----------------------------------------------------------------------------


def _sinkhorn_loop(mat: list[list[float]], repeat: int, eps: float) -> list[list[float]]:
    n = len(mat)
    y = []
    for row in mat:
        top = max(row)
        e = [math.exp(v - top) for v in row]
        s = sum(e)
        y.append([v / s + eps for v in e])

    def cols(y):
        sums = [sum(y[i][j] for i in range(n)) for j in range(n)]
        return [[y[i][j] / (sums[j] + eps) for j in range(n)] for i in range(n)]

    def rows(y):
        return [[v / (sum(r) + eps) for v in r] for r in y]

    y = cols(y)
    for _ in range(repeat - 1):
        y = cols(rows(y))
    return y


@pytest.mark.parametrize("repeat", [1, 2, 10])
@pytest.mark.parametrize("n", [2, 4])
def test_sinkhorn_matches_loop(n, repeat):
    gen = _gen(3)
    x = _randn(gen, 3, 2, n, n, dtype=F64)
    got = ref.sinkhorn_normalize(x, repeat=repeat, eps=1e-6)
    assert got.shape == x.shape and got.dtype == F64
    for idx in [(0, 0), (1, 1), (2, 0)]:
        want = torch.tensor(_sinkhorn_loop(x[idx].tolist(), repeat, 1e-6), dtype=F64)
        torch.testing.assert_close(got[idx], want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "scale,repeat,row_tol",
    [
        (0.5, 10, 1e-4),  # logit spread of real comb mixes: converged after 10 rounds
        (1.0, 50, 1e-5),  # wider logits need more rounds
    ],
)
def test_sinkhorn_doubly_stochastic(scale, repeat, row_tol):
    """Columns sum to one (the last step normalises columns; the ``+ eps`` in
    the denominator leaves ``1 - eps / S``), rows converge to one."""
    gen = _gen(4)
    x = _randn(gen, 4096, 4, 4, scale=scale)
    y = ref.sinkhorn_normalize(x, repeat=repeat, eps=1e-6)
    assert y.dtype == torch.float32 and bool((y > 0).all())
    assert (y.sum(-2) - 1).abs().max().item() < 1e-5
    assert (y.sum(-1) - 1).abs().max().item() < row_tol


def test_sinkhorn_rows_converge_with_repeat():
    gen = _gen(5)
    x = _randn(gen, 2048, 4, 4, dtype=F64, scale=1.5)
    errs = [
        (ref.sinkhorn_normalize(x, repeat=r, eps=0.0).sum(-1) - 1).abs().max().item() for r in (1, 4, 16, 64, 256)
    ]
    assert all(a > b for a, b in zip(errs, errs[1:]))
    assert errs[-1] < 1e-9


# ----------------------------------------------------------------------------
# split mixes, head mix
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mhc", [2, 4])
def test_pre_split_mixes_matches_loop(mhc):
    gen = _gen(6)
    mixes, scale, base = _mixes_inputs(gen, (2, 3), mhc, dtype=F64)
    pre, post, comb = ref.mhc_pre_split_mixes(mixes, scale, base, mhc, 2.0, 1e-6)
    assert pre.shape == (2, 3, mhc, 1) and post.shape == (2, 3, mhc, 1) and comb.shape == (2, 3, mhc, mhc)
    assert pre.is_contiguous() and post.is_contiguous() and comb.is_contiguous()
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    for a in range(2):
        for b in range(3):
            v = mixes[a, b].tolist()
            for m in range(mhc):
                assert pre[a, b, m, 0].item() == pytest.approx(sig(v[m] * scale[0].item() + base[m].item()) + 1e-6, rel=1e-13)
                k = mhc + m
                assert post[a, b, m, 0].item() == pytest.approx(2.0 * sig(v[k] * scale[1].item() + base[k].item()), rel=1e-13)
                for n in range(mhc):
                    k = 2 * mhc + m * mhc + n
                    assert comb[a, b, m, n].item() == pytest.approx(v[k] * scale[2].item() + base[k].item(), rel=1e-13)


def test_pre_split_mixes_rejects_wrong_width():
    mixes, scale, base = _mixes_inputs(_gen(7), (1, 2), 4)
    with pytest.raises(ValueError, match="mhc_mult"):
        ref.mhc_pre_split_mixes(mixes[..., :20], scale, base[:20], 4, 1.0, 1e-6)


def test_head_compute_mix_matches_loop():
    gen = _gen(8)
    mix = _randn(gen, 2, 3, 4, dtype=F64)
    scale, base = _randn(gen, 1, dtype=F64), _randn(gen, 4, dtype=F64)
    got = ref.mhc_head_compute_mix(mix, scale, base, 1e-6)
    assert got.shape == mix.shape
    for a, b, m in [(0, 0, 0), (1, 2, 3), (0, 1, 2)]:
        z = mix[a, b, m].item() * scale.item() + base[m].item()
        assert got[a, b, m].item() == pytest.approx(1 / (1 + math.exp(-z)) + 1e-6, rel=1e-13)


# ----------------------------------------------------------------------------
# apply mix, post
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mhc", [1, 4])
def test_pre_apply_mix_matches_loop(mhc):
    gen = _gen(9)
    x = _randn(gen, 2, 9, mhc, 256, dtype=torch.bfloat16)
    mix = _randn(gen, 2, 9, mhc, 1)
    # float32 products, summed over streams in order, rounded once to bf16
    acc = torch.zeros(2, 9, 256)
    for m in range(mhc):
        acc = acc + mix[:, :, m] * x[:, :, m].float()
    got = ref.mhc_pre_apply_mix(x, mix)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 9, 256)
    assert torch.equal(got, acc.bfloat16())
    buf = torch.full((2, 9, 256), float("nan"), dtype=torch.bfloat16)
    assert ref.mhc_pre_apply_mix(x, mix, out=buf) is buf and torch.equal(buf, got)
    with pytest.raises(ValueError, match="mix"):
        ref.mhc_pre_apply_mix(x, mix.squeeze(-1))


def test_post_matches_loop():
    gen = _gen(10)
    mhc, h = 4, 128
    x = _randn(gen, 2, 5, h, dtype=torch.bfloat16)
    res = _randn(gen, 2, 5, mhc, h, dtype=torch.bfloat16)
    post = _randn(gen, 2, 5, mhc, 1)
    comb = _randn(gen, 2, 5, mhc, mhc)
    got = ref.mhc_post(x, res, post, comb)
    assert got.dtype == torch.bfloat16 and got.shape == res.shape and got.is_contiguous()
    want = torch.empty(2, 5, mhc, h, dtype=F64)
    for n in range(mhc):
        acc = post[:, :, n].double() * x.double()
        for m in range(mhc):
            acc = acc + comb[:, :, m, n, None].double() * res[:, :, m].double()
        want[:, :, n] = acc
    # float32 arithmetic vs exact: differ by at most one bf16 rounding step
    torch.testing.assert_close(got.double(), want.bfloat16().double(), rtol=2**-7, atol=1e-6)
    buf = torch.full_like(res, float("nan"))
    assert ref.mhc_post(x, res, post, comb, out=buf) is buf and torch.equal(buf, got)
    assert torch.equal(ref.mhc_post_fwd(x, res, post, comb), got)
    with pytest.raises(ValueError, match="comb_res_mix"):
        ref.mhc_post(x, res, post, comb[..., :3])


# ----------------------------------------------------------------------------
# norm fn
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("with_weight", [False, True])
def test_pre_norm_fn_matches_loop(with_weight):
    gen = _gen(11)
    mhc, h = 4, 64
    k = mhc * h
    res = _randn(gen, 2, 3, mhc, h, dtype=torch.bfloat16)
    fn = _randn(gen, 24, k, scale=1e-2)
    w = _randn(gen, k, scale=0.1) + 1 if with_weight else None
    got = ref.mhc_pre_norm_fn(res, fn, w, 1e-6)
    assert got.shape == (2, 3, 24) and got.dtype == torch.float32
    for a, b in [(0, 0), (1, 2), (0, 2)]:
        x = res[a, b].flatten().double().tolist()
        r = 1 / math.sqrt(sum(v * v for v in x) / k + 1e-6)
        # the projection (with the weight folded in, one float32 product) rounded to TF32
        merged = ref.round_to_tf32(fn * w if w is not None else fn)
        for j in range(24):
            row = merged[j].double().tolist()
            dot = sum(x[i] * row[i] for i in range(k))
            assert got[a, b, j].item() == pytest.approx(dot * r, rel=1e-4, abs=1e-6)
    with pytest.raises(ValueError, match="columns"):
        ref.mhc_pre_norm_fn(res, fn[:, :-1], None, 1e-6)


def test_round_to_tf32():
    values = torch.tensor([1.0, 1.0 + 2**-11, 1.0 + 2**-12, -(1.0 + 2**-11), 1.0 + 3 * 2**-12,
                           float("inf"), -float("inf"), 0.0, -0.0, 3.4e38])
    got = ref.round_to_tf32(values)
    want = torch.tensor([1.0, 1.0 + 2**-10, 1.0, -(1.0 + 2**-10), 1.0 + 2**-10,
                         float("inf"), -float("inf"), 0.0, -0.0, 3.4e38])
    assert torch.equal(got.view(torch.int32) & -8192, got.view(torch.int32))  # 10 mantissa bits
    assert torch.equal(got[:9], want[:9]) and got[8].item() == 0.0 and str(got[8].item()) == "-0.0"
    assert torch.isfinite(got[9]) or got[9] == float("inf")


def test_pre_norm_fn_lane_order():
    """The float32 forward sums in the kernel's lane order: equal to the double-precision sum of
    the same exact products within float32 rounding, over K not a multiple of 1024 (padded)."""
    gen = _gen(21)
    res = _randn(gen, 5, 4, 300, dtype=torch.bfloat16)
    fn = _randn(gen, 24, 1200, scale=1e-2)
    got = ref.mhc_pre_norm_fn(res, fn, None, 1e-6)
    x = res.flatten(-2).double()
    dot = x @ ref.round_to_tf32(fn).double().t()
    want = dot * (x.square().sum(-1, keepdim=True) / 1200 + 1e-6).rsqrt()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------
# backward references vs autograd through the forward references (float64)
# ----------------------------------------------------------------------------


def _autograd(fwd, inputs, grads):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fwd(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return torch.autograd.grad(outs, leaves, grads)


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_bwd_refs_match_autograd():
    gen = _gen(12)
    mhc, h = 4, 32
    lead = (2, 5)

    x = _randn(gen, *lead, mhc, mhc, dtype=F64)
    g = _randn(gen, *lead, mhc, mhc, dtype=F64)
    for repeat in (1, 3, 10):
        (want,) = _autograd(lambda t: ref.sinkhorn_normalize(t, repeat, 1e-6), [x], [g])
        _close(ref.sinkhorn_normalize_bwd(g, x, repeat, 1e-6), want)

    mixes, scale, base = _mixes_inputs(gen, lead, mhc, dtype=F64)
    grads = [_randn(gen, *lead, mhc, 1, dtype=F64), _randn(gen, *lead, mhc, 1, dtype=F64),
             _randn(gen, *lead, mhc, mhc, dtype=F64)]
    want = _autograd(lambda a, b, c: ref.mhc_pre_split_mixes(a, b, c, mhc, 2.5, 1e-6), [mixes, scale, base], grads)
    for got_t, want_t in zip(ref.mhc_pre_split_mixes_bwd(*grads, mixes, scale, base, mhc, 2.5), want):
        _close(got_t, want_t)

    im, s1, b4 = _randn(gen, *lead, mhc, dtype=F64), _randn(gen, 1, dtype=F64), _randn(gen, mhc, dtype=F64)
    go = _randn(gen, *lead, mhc, dtype=F64)
    want = _autograd(lambda a, b, c: ref.mhc_head_compute_mix(a, b, c, 1e-6), [im, s1, b4], [go])
    for got_t, want_t in zip(ref.mhc_head_compute_mix_bwd(go, im, s1, b4), want):
        _close(got_t, want_t)

    xs, mix = _randn(gen, *lead, mhc, h, dtype=F64), _randn(gen, *lead, mhc, 1, dtype=F64)
    og = _randn(gen, *lead, h, dtype=F64)
    want = _autograd(ref.mhc_pre_apply_mix, [xs, mix], [og])
    got = ref.mhc_pre_apply_mix_bwd(og, xs, mix)
    for got_t, want_t in zip(got, want):
        _close(got_t, want_t)
    acc = _randn(gen, *lead, mhc, h, dtype=F64)
    got_acc = ref.mhc_pre_apply_mix_bwd(og, xs, mix, x_grad=acc)
    _close(got_acc[0], want[0] + acc)

    y, post, comb = _randn(gen, *lead, h, dtype=F64), _randn(gen, *lead, mhc, 1, dtype=F64), _randn(gen, *lead, mhc, mhc, dtype=F64)
    do = _randn(gen, *lead, mhc, h, dtype=F64)
    want = _autograd(ref.mhc_post, [y, xs, post, comb], [do])
    for got_t, want_t in zip(ref.mhc_post_bwd(y, xs, post, comb, do, fuse_grad_acc=False), want):
        _close(got_t, want_t)

    fn = _randn(gen, 24, mhc * h, dtype=F64, scale=0.1)
    w = _randn(gen, mhc * h, dtype=F64, scale=0.1) + 1
    og = _randn(gen, *lead, 24, dtype=F64)
    want = _autograd(lambda a, b, c: ref.mhc_pre_norm_fn(a, b, c, 1e-6), [xs, fn, w], [og])
    got = ref.mhc_pre_norm_fn_bwd(og, xs, fn, w, 1e-6)
    for got_t, want_t in zip(got, want):
        _close(got_t, want_t)
    want = _autograd(lambda a, b: ref.mhc_pre_norm_fn(a, b, None, 1e-6), [xs, fn], [og])
    got = ref.mhc_pre_norm_fn_bwd(og, xs, fn, None, 1e-6, x_grad=acc)
    assert got[2] is None
    _close(got[0], want[0] + acc)
    _close(got[1], want[1])


def test_bwd_refs_keep_kernel_dtypes():
    gen = _gen(13)
    x = _randn(gen, 1, 3, 4, 256, dtype=torch.bfloat16)
    y = _randn(gen, 1, 3, 256, dtype=torch.bfloat16)
    post, comb = _randn(gen, 1, 3, 4, 1), _randn(gen, 1, 3, 4, 4)
    do = _randn(gen, 1, 3, 4, 256, dtype=torch.bfloat16)
    dx, dres, dpost, dcomb = ref.mhc_post_bwd(y, x, post, comb, do)
    assert (dx.dtype, dres.dtype, dpost.dtype, dcomb.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
    assert (dx.shape, dres.shape, dpost.shape, dcomb.shape) == (y.shape, x.shape, post.shape, comb.shape)
    # fuse_grad_acc=True (default) hands d_residual over on the storage, like upstream
    assert x.untyped_storage().grad_from_mhc_post is dres
    xg, mg = ref.mhc_pre_apply_mix_bwd(y, x, post)
    assert (xg.dtype, mg.dtype, xg.shape, mg.shape) == (torch.bfloat16, torch.float32, x.shape, post.shape)
    fn = _randn(gen, 24, 1024, scale=1e-2)
    rg, fg, wg = ref.mhc_pre_norm_fn_bwd(_randn(gen, 1, 3, 24), x, fn, None, 1e-6)
    assert (rg.dtype, fg.dtype, wg) == (torch.bfloat16, torch.float32, None)


# ----------------------------------------------------------------------------
# gradcheck of the autograd Functions (float64)
# ----------------------------------------------------------------------------


def _leaf(gen, *shape, scale=1.0):
    return _randn(gen, *shape, dtype=F64, scale=scale, requires_grad=True)


MHC, HID = 4, 6


@pytest.mark.parametrize(
    "name",
    ["expand", "sinkhorn", "split", "head_mix", "apply_mix", "post", "norm_fn", "norm_fn_weight"],
)
def test_gradcheck_ops(name):
    gen = _gen(14)
    lead = (2, 3)
    m3 = MHC * (MHC + 2)
    cases = {
        "expand": (lambda a: mm.expand_to_mhc(a, MHC), [_leaf(gen, *lead, HID)]),
        "sinkhorn": (lambda a: mm.sinkhorn_normalize(a, 10, 1e-6), [_leaf(gen, *lead, MHC, MHC)]),
        "split": (
            lambda a, b, c: mm.mhc_pre_split_mixes(a, b, c, MHC, 2.0, 1e-6),
            [_leaf(gen, *lead, m3), _leaf(gen, 3), _leaf(gen, m3)],
        ),
        "head_mix": (
            lambda a, b, c: mm.mhc_head_compute_mix(a, b, c, 1e-6),
            [_leaf(gen, *lead, MHC), _leaf(gen, 1), _leaf(gen, MHC)],
        ),
        "apply_mix": (mm.mhc_pre_apply_mix, [_leaf(gen, *lead, MHC, HID), _leaf(gen, *lead, MHC, 1)]),
        "post": (
            mm.mhc_post,
            [_leaf(gen, *lead, HID), _leaf(gen, *lead, MHC, HID), _leaf(gen, *lead, MHC, 1), _leaf(gen, *lead, MHC, MHC)],
        ),
        "norm_fn": (
            lambda a, b: mm.mhc_pre_norm_fn(a, b, None, 1e-6),
            [_leaf(gen, *lead, MHC, HID), _leaf(gen, m3, MHC * HID)],
        ),
        "norm_fn_weight": (
            lambda a, b, c: mm.mhc_pre_norm_fn(a, b, c, 1e-6),
            [_leaf(gen, 1, 2, MHC, HID), _leaf(gen, m3, MHC * HID), _leaf(gen, MHC * HID)],
        ),
    }
    fn, inputs = cases[name]
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_pipeline():
    """Embedding -> mhc_pre -> sublayer -> mhc_post -> mhc_head, all inputs at once."""
    gen = _gen(15)
    m3 = MHC * (MHC + 2)
    lead, hid = (1, 2), 4

    def pipeline(emb, fn, scale, base, normw, layer_w, head_fn, head_scale, head_base):
        res = mm.expand_from_embedding(emb, MHC)
        layer_in, (post, comb) = mm.mhc_pre(res, fn, scale, base, norm_weight=normw, mhc_mult=MHC, post_mult_value=2.0)
        res = mm.mhc_post(torch.tanh(layer_in * layer_w), res, post, comb)
        return mm.mhc_head(res, head_fn, head_scale, head_base, norm_weight=normw, mhc_mult=MHC)

    inputs = [
        _leaf(gen, *lead, hid),
        _leaf(gen, m3, MHC * hid, scale=0.5),
        _leaf(gen, 3),
        _leaf(gen, m3),
        _leaf(gen, MHC * hid, scale=0.1) + 1,
        _leaf(gen, hid),
        _leaf(gen, MHC, MHC * hid, scale=0.5),
        _leaf(gen, 1),
        _leaf(gen, MHC),
    ]
    inputs[4] = inputs[4].detach().requires_grad_()
    assert gradcheck(pipeline, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_modeling_forward_equals_references():
    gen = _gen(16)
    res = _randn(gen, 2, 3, 4, 64, dtype=torch.bfloat16)
    fn = _randn(gen, 24, 256, scale=1e-2)
    scale, base, w = _randn(gen, 3, scale=0.1), _randn(gen, 24, scale=0.1), _randn(gen, 256, scale=0.1) + 1
    layer_in, (post, comb) = mm.mhc_pre(res, fn, scale, base, norm_weight=w, post_mult_value=2.0)
    mixes = ref.mhc_pre_norm_fn(res, fn, w, 1e-6)
    pre_r, post_r, comb_r = ref.mhc_pre_split_mixes(mixes, scale, base, 4, 2.0, 1e-6)
    assert torch.equal(post, post_r)
    assert torch.equal(comb, ref.sinkhorn_normalize(comb_r, 10, 1e-6))
    assert torch.equal(layer_in, ref.mhc_pre_apply_mix(res, pre_r))

    # inference path (fused) gives the same bits, norm weight included
    with torch.no_grad():
        li2, (post2, comb2) = mm.mhc_pre(res, fn, scale, base, norm_weight=w, post_mult_value=2.0)
    assert torch.equal(li2, layer_in) and torch.equal(post2, post) and torch.equal(comb2, comb)

    hfn, hs, hb = _randn(gen, 4, 256, scale=1e-2), _randn(gen, 1), _randn(gen, 4)
    head = mm.mhc_head(res, hfn, hs.reshape(()), hb)
    mixes = ref.mhc_pre_norm_fn(res, torch.cat([hfn, torch.zeros(20, 256)]), None, 1e-6)[..., :4]
    want = ref.mhc_pre_apply_mix(res, ref.mhc_head_compute_mix(mixes, hs, hb, 1e-6).unsqueeze(-1))
    assert torch.equal(head, want)


def test_modeling_out_buffers():
    gen = _gen(17)
    hidden = _randn(gen, 1, 3, 32, dtype=F64, requires_grad=True)
    buf = torch.empty(1, 3, 4, 32, dtype=F64)
    out = mm.expand_to_mhc(hidden, 4, out=buf)
    assert out.data_ptr() == buf.data_ptr()
    out.sum().backward()
    assert torch.equal(hidden.grad, torch.full_like(hidden, 4.0))

    x = _randn(gen, 1, 3, 4, 32, dtype=F64, requires_grad=True)
    mix = _randn(gen, 1, 3, 4, 1, dtype=F64, requires_grad=True)
    buf = torch.empty(1, 3, 32, dtype=F64)
    out = mm.mhc_pre_apply_mix(x, mix, out=buf)
    assert out.data_ptr() == buf.data_ptr() and torch.equal(buf, ref.mhc_pre_apply_mix(x.detach(), mix.detach()))
    out.sum().backward()
    assert torch.equal(x.grad, mix.detach().expand_as(x))


# ----------------------------------------------------------------------------
# fused ops
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers,num_post", [(1, 0), (1, 1), (3, 2), (3, 3)])
def test_multilayer_recompute_equals_single_layers(num_layers, num_post):
    gen = _gen(18)
    lead, mhc, h = (2, 5), 4, 64
    r0 = _randn(gen, *lead, mhc, h, dtype=torch.bfloat16)
    pre = [_randn(gen, *lead, mhc, 1) for _ in range(num_layers)]
    outs = [_randn(gen, *lead, h, dtype=torch.bfloat16) for _ in range(num_post)]
    posts = [_randn(gen, *lead, mhc, 1) for _ in range(num_post)]
    combs = [_randn(gen, *lead, mhc, mhc) for _ in range(num_post)]
    layer_in = [torch.full((*lead, h), float("nan"), dtype=torch.bfloat16) for _ in range(num_layers)]
    resid = [torch.full((*lead, mhc, h), float("nan"), dtype=torch.bfloat16) for _ in range(num_post)]
    assert ref.mhc_multilayer_recompute(r0, pre, outs, posts, combs, layer_in, resid) is None

    r = r0
    for i in range(num_layers):
        assert torch.equal(layer_in[i], ref.mhc_pre_apply_mix(r, pre[i])), i
        if i < num_post:
            r = ref.mhc_post(outs[i], r, posts[i], combs[i])
            assert torch.equal(resid[i], r), i

    # mixes given as (..., M) instead of (..., M, 1) mean the same
    layer_in2 = [torch.empty_like(t) for t in layer_in]
    resid2 = [torch.empty_like(t) for t in resid]
    ref.mhc_multilayer_recompute(
        r0, [p.squeeze(-1) for p in pre], outs, [p.squeeze(-1) for p in posts], combs, layer_in2, resid2
    )
    assert all(torch.equal(a, b) for a, b in zip(layer_in + resid, layer_in2 + resid2))


def test_multilayer_recompute_rejects_bad_lists():
    gen = _gen(19)
    r0 = _randn(gen, 1, 2, 4, 8, dtype=torch.bfloat16)
    pre = [_randn(gen, 1, 2, 4, 1) for _ in range(3)]
    li = [torch.empty(1, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    one = lambda k, *s, **kw: [_randn(gen, *s, **kw) for _ in range(k)]  # noqa: E731
    with pytest.raises(ValueError, match="num_layers"):
        ref.mhc_multilayer_recompute(
            r0, pre, one(1, 1, 2, 8, dtype=torch.bfloat16), one(1, 1, 2, 4, 1), one(1, 1, 2, 4, 4), li,
            one(1, 1, 2, 4, 8, dtype=torch.bfloat16),
        )
    with pytest.raises(ValueError, match="equal lengths"):
        ref.mhc_multilayer_recompute(r0, pre, one(2, 1, 2, 8, dtype=torch.bfloat16), one(1, 1, 2, 4, 1), [], li, [])
    with pytest.raises(ValueError, match="layer inputs"):
        ref.mhc_multilayer_recompute(r0, pre, [], [], [], li[:2], [])
    with pytest.raises(ValueError, match="empty"):
        ref.mhc_multilayer_recompute(r0, [], [], [], [], [], [])


def test_pre_big_fuse_equals_composition():
    gen = _gen(20)
    res = _randn(gen, 2, 7, 4, 128, dtype=torch.bfloat16)
    fn = _randn(gen, 24, 512, scale=1e-2)
    scale, base = _randn(gen, 3, scale=0.1), _randn(gen, 24, scale=0.1)
    post, comb, layer_in = ref.mhc_pre_big_fuse(res, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 10)
    assert (post.shape, comb.shape, layer_in.shape) == ((2, 7, 4, 1), (2, 7, 4, 4), (2, 7, 128))
    assert (post.dtype, comb.dtype, layer_in.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    mixes = ref.mhc_pre_norm_fn(res, fn, None, 1e-6)
    pre_r, post_r, comb_r = ref.mhc_pre_split_mixes(mixes, scale, base, 4, 2.0, 1e-6)
    assert torch.equal(post, post_r)
    assert torch.equal(comb, ref.sinkhorn_normalize(comb_r, 10, 1e-6))
    assert torch.equal(layer_in, ref.mhc_pre_apply_mix(res, pre_r))
    with pytest.raises(ValueError, match="fn"):
        ref.mhc_pre_big_fuse(res, fn[:20], scale, base, 1e-6, 1e-6, 1e-6, 2.0, 10)
    with pytest.raises(ValueError, match="mhc_scale"):
        ref.mhc_pre_big_fuse(res, fn, scale[:2], base, 1e-6, 1e-6, 1e-6, 2.0, 10)


def test_norm_fn_backward_from_the_saved_output():
    """The per-token part from ``out = u * r`` and ``S`` equals the docstring's formula from
    ``u``, and the K-wide part (``mhc_pre_norm_fn_bwd_mul``) equals a per-token loop, in
    float64."""
    gen = torch.Generator().manual_seed(3)
    m, h, n = 4, 16, 5
    k, m3 = m * h, m * (m + 2)
    x = torch.randn(n, m, h, generator=gen, dtype=torch.float64)
    fn = torch.randn(m3, k, generator=gen, dtype=torch.float64)
    g = torch.randn(n, m3, generator=gen, dtype=torch.float64)
    flat = x.reshape(n, k)
    s = (flat * flat).sum(-1)
    r = (s / k + 1e-6).rsqrt()
    u = flat @ fn.t()
    ug, sg = ref._norm_fn_bwd_norm(g, u * r[:, None], s, k, 1e-6)
    torch.testing.assert_close(ug, g * r[:, None], rtol=1e-12, atol=0)
    torch.testing.assert_close(sg, -0.5 * (g * u).sum(-1) * r / (s + 1e-6 * k), rtol=1e-12, atol=1e-15)
    acc = torch.randn(n, m, h, generator=gen, dtype=torch.float64)
    xg, fg = ref.mhc_pre_norm_fn_bwd_mul(ug, sg, x, fn, acc)
    for t in range(n):
        want = acc[t].reshape(k) + sum(ug[t, j] * fn[j] for j in range(m3)) + 2 * flat[t] * sg[t]
        torch.testing.assert_close(xg[t].reshape(k), want, rtol=1e-12, atol=1e-12)
    want = sum(ug[t][:, None] * flat[t][None, :] for t in range(n))
    torch.testing.assert_close(fg, want, rtol=1e-12, atol=1e-12)
