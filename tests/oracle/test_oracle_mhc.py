"""Our mHC references against TileKernels 1.0.0's own torch references.

Forwards are compared bit for bit with ``tile_kernels.torch.mhc``.  Upstream
has no torch reference for the backward passes, so each ``*_bwd`` is compared
with autograd run through upstream's forward reference, and the fused ops
(``mhc_pre_big_fuse``, ``mhc_multilayer_recompute``, the modeling pipeline)
with the composition of upstream's single-op references, as upstream's own
tests do.

Shapes: upstream's hidden sizes (1280, 2560, 4096, 7168, 7680) with mhc_mult 4;
token counts are kept small (odd and even) because this runs on a CPU.
"""

import zlib

import pytest
import torch

tile_kernels = pytest.importorskip("tile_kernels")

from tile_kernels.torch import mhc as up  # noqa: E402

from tile_kernels_aot.modeling import mhc as mm  # noqa: E402
from tile_kernels_aot.torch import mhc as ref  # noqa: E402

MHC = 4
M3 = MHC * (MHC + 2)
HIDDEN = [1280, 2560, 4096, 7168, 7680]
TOKENS = [(1, 13), (2, 64)]


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _residual(gen, n0, n1, h):
    # upstream's test data: streams with slightly different scales
    ramp = 1 + torch.arange(MHC).mul(0.01).view(1, 1, -1, 1)
    return (_randn(gen, n0, n1, MHC, h) * ramp).bfloat16()


def _fn(gen, h, rows=M3):
    ramp = 1 + torch.arange(MHC).mul(0.01).view(1, -1, 1)
    return (_randn(gen, rows, MHC, h) * 1e-4 * ramp).flatten(1, 2)


def _grads_via_autograd(fwd, inputs, grads):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    outs = fwd(*leaves)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    torch.autograd.backward(list(outs), list(grads))
    return [None if t is None else t.grad for t in leaves]


def _assert_tf32_close(got, want):
    """Outputs downstream of the norm-fn projection: ours rounds the projection to TF32 like
    upstream's kernel (upstream's float32 reference does not), so float32 values agree to
    upstream's own norm-fn test tolerance (1e-3) and bf16 values within that plus a bf16 step."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def _assert_equal(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), f"max diff {(got.double() - want.double()).abs().max().item()}"


def _assert_bf16_within_one_ulp(got, want):
    """bf16 results of float32 sums taken in another order: at most one bf16 step
    apart, plus float32 cancellation error (2**-20 of the largest magnitude) where
    terms cancel to nearly zero."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    g, w = got.double(), want.double()
    _, exp = torch.frexp(w.abs().clamp_min(2.0**-126))
    ulp = torch.ldexp(torch.ones_like(w), exp - 8)
    tol = ulp + 2.0**-20 * w.abs().max()
    assert bool(((g - w).abs() <= tol).all()), f"max diff {(g - w).abs().max().item()}"


def _assert_fp32_sum_close(got, want):
    """float32 reductions in another order: relative to the largest magnitude."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


# ----------------------------------------------------------------------------
# forwards: bit-exact
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("n0,n1", TOKENS)
@pytest.mark.parametrize("h", HIDDEN)
def test_expand_to_mhc(n0, n1, h):
    gen = _gen("expand", n0, n1, h)
    hidden = _randn(gen, n0, n1, h, dtype=torch.bfloat16)
    _assert_equal(ref.expand_to_mhc(hidden, MHC), up.expand_to_mhc_ref(hidden, MHC))
    g = _randn(gen, n0, n1, MHC, h, dtype=torch.bfloat16)
    (want,) = _grads_via_autograd(lambda t: up.expand_to_mhc_ref(t, MHC), [hidden], [g])
    _assert_equal(ref.expand_to_mhc_bwd(g), want)


@pytest.mark.parametrize("repeat", [1, 10, 20])
@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0])
def test_sinkhorn_normalize(scale, repeat):
    gen = _gen("sinkhorn", scale, repeat)
    x = _randn(gen, 2, 1000, MHC, MHC, scale=scale)
    _assert_equal(ref.sinkhorn_normalize(x, repeat, 1e-6), up.sinkhorn_normalize_ref(x, repeat, 1e-6))
    # backward: no upstream reference; autograd through upstream's forward,
    # float32 with a different association of the same terms
    g = _randn(gen, 2, 1000, MHC, MHC)
    (want,) = _grads_via_autograd(lambda t: up.sinkhorn_normalize_ref(t, repeat, 1e-6), [x], [g])
    got = ref.sinkhorn_normalize_bwd(g, x, repeat, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("post_mult", [1.0, 2.0])
@pytest.mark.parametrize("n0,n1", [(1, 13), (2, 4096)])
def test_pre_split_mixes(n0, n1, post_mult):
    gen = _gen("split", n0, n1, post_mult)
    mixes = _randn(gen, n0, n1, M3)
    scale, base = _randn(gen, 3, scale=0.1), _randn(gen, M3, scale=0.1)
    got = ref.mhc_pre_split_mixes(mixes, scale, base, MHC, post_mult, 1e-6)
    want = up.mhc_pre_split_mixes_ref(mixes, scale, base, MHC, post_mult, 1e-6)
    for g_t, w_t in zip(got, want):
        _assert_equal(g_t, w_t)
        assert g_t.is_contiguous()  # upstream's reference returns strided views; the kernel does not
    grads = [_randn(gen, *t.shape) for t in want]
    want_g = _grads_via_autograd(
        lambda a, b, c: up.mhc_pre_split_mixes_ref(a, b, c, MHC, post_mult, 1e-6), [mixes, scale, base], grads
    )
    got_g = ref.mhc_pre_split_mixes_bwd(*grads, mixes, scale, base, MHC, post_mult)
    _assert_equal(got_g[0], want_g[0])
    _assert_fp32_sum_close(got_g[1], want_g[1])
    _assert_fp32_sum_close(got_g[2], want_g[2])


@pytest.mark.parametrize("n0,n1", [(1, 13), (2, 4096)])
def test_head_compute_mix(n0, n1):
    gen = _gen("head", n0, n1)
    mix = _randn(gen, n0, n1, MHC)
    scale, base = _randn(gen, 1), _randn(gen, MHC)
    _assert_equal(ref.mhc_head_compute_mix(mix, scale, base, 1e-6), up.mhc_head_compute_mix_ref(mix, scale, base, 1e-6))
    g = _randn(gen, n0, n1, MHC)
    want = _grads_via_autograd(lambda a, b, c: up.mhc_head_compute_mix_ref(a, b, c, 1e-6), [mix, scale, base], [g])
    got = ref.mhc_head_compute_mix_bwd(g, mix, scale, base)
    _assert_equal(got[0], want[0])
    _assert_fp32_sum_close(got[1], want[1])
    _assert_fp32_sum_close(got[2], want[2])


@pytest.mark.parametrize("n0,n1", TOKENS)
@pytest.mark.parametrize("h", HIDDEN)
def test_pre_apply_mix(n0, n1, h):
    gen = _gen("apply", n0, n1, h)
    x = _randn(gen, n0, n1, MHC, h).sigmoid().bfloat16()
    mix = _randn(gen, n0, n1, MHC, 1).softmax(-2)
    _assert_equal(ref.mhc_pre_apply_mix(x, mix), up.mhc_pre_apply_mix_ref(x, mix))
    og = _randn(gen, n0, n1, h, dtype=torch.bfloat16)
    want = _grads_via_autograd(up.mhc_pre_apply_mix_ref, [x, mix], [og])
    got = ref.mhc_pre_apply_mix_bwd(og, x, mix)
    _assert_equal(got[0], want[0])
    _assert_fp32_sum_close(got[1], want[1])


@pytest.mark.parametrize("n0,n1", TOKENS)
@pytest.mark.parametrize("h", HIDDEN)
def test_post(n0, n1, h):
    gen = _gen("post", n0, n1, h)
    x = _randn(gen, n0, n1, h, dtype=torch.bfloat16)
    res = _randn(gen, n0, n1, MHC, h, dtype=torch.bfloat16)
    post = _randn(gen, n0, n1, MHC, 1)
    comb = _randn(gen, n0, n1, MHC, MHC)
    _assert_equal(ref.mhc_post(x, res, post, comb), up.mhc_post_ref(x, res, post, comb))
    do = _randn(gen, n0, n1, MHC, h, dtype=torch.bfloat16)
    want = _grads_via_autograd(up.mhc_post_ref, [x, res, post, comb], [do])
    got = ref.mhc_post_bwd(x, res, post, comb, do, fuse_grad_acc=False)
    _assert_equal(got[0], want[0])
    _assert_equal(got[1], want[1])
    _assert_fp32_sum_close(got[2], want[2])
    _assert_fp32_sum_close(got[3], want[3])


@pytest.mark.parametrize(
    "h,n0,n1,with_weight",
    [(1280, 1, 160, True), (2560, 2, 13, False), (4096, 1, 64, True), (7168, 1, 13, False), (7168, 1, 32, True)],
)
def test_pre_norm_fn(h, n0, n1, with_weight):
    gen = _gen("norm_fn", h, n0, n1, with_weight)
    res = _residual(gen, n0, n1, h)
    fn = _fn(gen, h)
    w = _randn(gen, MHC * h, scale=0.1) + 1 if with_weight else None
    # same float32 GEMM call and reductions as upstream's reference
    _assert_tf32_close(ref.mhc_pre_norm_fn(res, fn, w, 1e-6), up.mhc_pre_norm_fn_ref(res, fn, w, 1e-6))
    og = _randn(gen, n0, n1, M3)
    want = _grads_via_autograd(lambda a, b, c: up.mhc_pre_norm_fn_ref(a, b, c, 1e-6), [res, fn, w], [og])
    got = ref.mhc_pre_norm_fn_bwd(og, res, fn, w, 1e-6)
    _assert_bf16_within_one_ulp(got[0], want[0])
    _assert_fp32_sum_close(got[1], want[1])
    if with_weight:
        _assert_fp32_sum_close(got[2], want[2])
    else:
        assert got[2] is None


# ----------------------------------------------------------------------------
# fused ops against compositions of upstream's references
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("h", [1280, 2560, 4096])
@pytest.mark.parametrize("post_mult", [1.0, 2.0])
def test_pre_big_fuse(h, post_mult):
    gen = _gen("big_fuse", h, post_mult)
    res = _residual(gen, 1, 96, h)
    fn = _fn(gen, h)
    scale, base = _randn(gen, 3, scale=0.1), _randn(gen, M3, scale=0.1)
    post, comb, layer_in = ref.mhc_pre_big_fuse(res, fn, scale, base, 1e-6, 1e-6, 1e-6, post_mult, 10)
    mixes = up.mhc_pre_norm_fn_ref(res, fn, None, 1e-6)
    pre_u, post_u, comb_u = up.mhc_pre_split_mixes_ref(mixes, scale, base, MHC, post_mult, 1e-6)
    _assert_tf32_close(post, post_u)
    _assert_tf32_close(comb, up.sinkhorn_normalize_ref(comb_u, 10, 1e-6))
    _assert_tf32_close(layer_in, up.mhc_pre_apply_mix_ref(res, pre_u))


@pytest.mark.parametrize(
    "num_layers,num_post,h",
    [(1, 1, 2560), (3, 2, 2560), (3, 3, 4096), (10, 9, 7168), (10, 10, 1280)],
)
def test_multilayer_recompute(num_layers, num_post, h):
    gen = _gen("multilayer", num_layers, num_post, h)
    lead = (1, 24)
    r0 = _randn(gen, *lead, MHC, h, dtype=torch.bfloat16)
    pre = [_randn(gen, *lead, MHC, 1) for _ in range(num_layers)]
    outs = [_randn(gen, *lead, h, dtype=torch.bfloat16) for _ in range(num_post)]
    posts = [_randn(gen, *lead, MHC, 1) for _ in range(num_post)]
    combs = [_randn(gen, *lead, MHC, MHC) for _ in range(num_post)]
    layer_in = [torch.full((*lead, h), float("nan"), dtype=torch.bfloat16) for _ in range(num_layers)]
    resid = [torch.full((*lead, MHC, h), float("nan"), dtype=torch.bfloat16) for _ in range(num_post)]
    ref.mhc_multilayer_recompute(r0, pre, outs, posts, combs, layer_in, resid)
    r = r0
    for i in range(num_layers):
        _assert_equal(layer_in[i], up.mhc_pre_apply_mix_ref(r, pre[i]))
        if i < num_post:
            r = up.mhc_post_ref(outs[i], r, posts[i], combs[i])
            _assert_equal(resid[i], r)


def _upstream_pre(res, fn, scale, base, w, post_mult):
    mixes = up.mhc_pre_norm_fn_ref(res, fn, w, 1e-6)
    pre_u, post_u, comb_u = up.mhc_pre_split_mixes_ref(mixes, scale, base, MHC, post_mult, 1e-6)
    return up.mhc_pre_apply_mix_ref(res, pre_u), post_u, up.sinkhorn_normalize_ref(comb_u, 10, 1e-6)


@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("h", [1280, 2560])
def test_modeling_mhc_pre(h, with_weight):
    """The autograd pipeline against upstream's references, forward and backward."""
    gen = _gen("mhc_pre", h, with_weight)
    res = _residual(gen, 1, 48, h)
    fn = _fn(gen, h)
    scale, base = _randn(gen, 3, scale=0.1), _randn(gen, M3, scale=0.1)
    w = _randn(gen, MHC * h, scale=0.1) + 1 if with_weight else None
    inputs = [res, fn, scale, base, w]
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    layer_in, (post, comb) = mm.mhc_pre(*leaves[:4], norm_weight=leaves[4], post_mult_value=2.0)
    want = _upstream_pre(*inputs, 2.0)
    for got_t, want_t in zip((layer_in, post, comb), want):
        _assert_tf32_close(got_t.detach(), want_t)

    with torch.no_grad():
        fused = mm.mhc_pre(res, fn, scale, base, norm_weight=w, post_mult_value=2.0)
    _assert_tf32_close(fused[0], want[0])
    _assert_tf32_close(fused[1][0], want[1])
    _assert_tf32_close(fused[1][1], want[2])

    grads = [_randn(gen, *t.shape, dtype=t.dtype) for t in want]
    torch.autograd.backward([layer_in, post, comb], grads)
    want_g = _grads_via_autograd(lambda *a: _upstream_pre(*a, 2.0), inputs, grads)
    # float32 everywhere, the residual gradient summed from three paths in
    # another order and rounded to bf16
    _assert_bf16_within_one_ulp(leaves[0].grad, want_g[0])
    # the parameters' gradients flow through the forward's mixes, which round the projection
    # to TF32 as upstream's kernel does (upstream's reference does not): TF32's tolerance
    for leaf, want_t in zip(leaves[1:], want_g[1:]):
        if leaf is not None:
            _assert_tf32_close(leaf.grad, want_t)


@pytest.mark.parametrize("h", [1280, 7168])
def test_modeling_mhc_head(h):
    gen = _gen("mhc_head", h)
    res = _residual(gen, 1, 32, h)
    fn = _fn(gen, h, rows=MHC)
    scale, base = _randn(gen, 1), _randn(gen, MHC, scale=0.1)
    got = mm.mhc_head(res, fn, scale, base)
    mixes = up.mhc_pre_norm_fn_ref(res, torch.cat([fn, fn.new_zeros(M3 - MHC, fn.shape[1])]), None, 1e-6)
    mix = up.mhc_head_compute_mix_ref(mixes[..., :MHC], scale, base, 1e-6)
    # the mixes come from the TF32-rounded projection (upstream's kernel rounds it too)
    _assert_tf32_close(got, up.mhc_pre_apply_mix_ref(res, mix.unsqueeze(-1)))
