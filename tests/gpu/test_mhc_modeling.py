"""The mHC modeling paths on the GPU: ``mhc_pre_big_fuse`` (its own two-launch kernel where the
build has it, else its reference's composition with each step on its kernel), and one decoder
layer's mHC path (``mhc_pre`` -> a stand-in sublayer -> ``mhc_post``, as
``tile_kernels_aot.modeling_paths`` times it) gives the same bits captured in a CUDA graph as eagerly.

``mhc_pre_big_fuse`` is checked bit for bit against the four kernels it fuses called one by one
(every sample of the kernel, and through the modeling path), and against the reference chain within
``mhc_pre_norm_fn``'s stated tolerance (its kernel sums the projection in another order than the
reference: docs/ops.md), propagated through the later steps.
"""

import pytest
import torch

from tile_kernels_aot import manifest, modeling_paths, samples
from tile_kernels_aot.modeling.mhc.ops import _impl
from tile_kernels_aot.torch import mhc as ref

from checks import SPECIALS, assert_bits_equal, prebuilt_configs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = ("mhc_pre_norm_fn", "mhc_pre_split_mixes", "sinkhorn_normalize", "mhc_pre_apply_mix")


def _needs_steps():
    missing = [s for s in STEPS if _impl.sources()[s] != "kernel"]
    if missing:
        pytest.skip(f"this build lacks the kernels of {missing}")
    hidden = {c.get("hidden") for c in prebuilt_configs("mhc.mhc_pre_norm_fn")}
    if modeling_paths.MHC_HIDDEN not in hidden and None not in hidden:
        pytest.skip(f"no prebuilt mhc_pre_norm_fn for hidden {modeling_paths.MHC_HIDDEN}")


def _chained_kernels(mhc, residual, fn, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat, n_splits=16):
    """``mhc_pre_big_fuse``'s four steps, each on its own kernel."""
    mixes = mhc.mhc_pre_norm_fn(residual, fn, None, rms_eps, n_splits=n_splits)
    pre, post, comb = mhc.mhc_pre_split_mixes(mixes, scale, base, residual.shape[1], post_mult, pre_eps)
    comb = mhc.sinkhorn_normalize(comb, repeat=repeat, eps=sinkhorn_eps)
    return post, comb, mhc.mhc_pre_apply_mix(residual, pre)


_FUSED = next((r for r in manifest.ops() if r["name"] == "mhc_pre_big_fuse"), None)
_FUSED_SAMPLES = _FUSED["samples"] if _FUSED else []


@pytest.mark.parametrize("sample", _FUSED_SAMPLES, ids=[s["name"] for s in _FUSED_SAMPLES])
def test_pre_big_fuse_kernel_equals_the_chained_kernels(sample):
    """The fused op (norm-fn's kernel, then one kernel for split, Sinkhorn and apply) gives the bits
    of the four kernels chained, on every sample (test_ops compares it with the reference)."""
    from tile_kernels_aot import mhc

    for name in ("mhc_pre_big_fuse",) + STEPS:
        if not hasattr(mhc, name):
            pytest.skip(f"this build lacks {name}")
    if not samples.is_prebuilt(_FUSED, sample):
        pytest.skip("not prebuilt")
    g = torch.Generator(device="cuda").manual_seed(0)
    args, kwargs = samples.make_args(sample, gen=g)
    got = mhc.mhc_pre_big_fuse(*args, **kwargs)
    want = _chained_kernels(mhc, *args, **kwargs)
    for name, a, b in zip(("post_mix", "comb_mix", "layer_input"), got, want):
        assert_bits_equal(a, b, f"{sample['name']}: {name}")
    # into given outputs (out=), a second call on the same inputs: the same bits
    outs = {n: torch.empty_like(t) for n, t in zip(("post_mix", "comb_mix", "layer_input"), got)}
    again = mhc.mhc_pre_big_fuse(*args, **kwargs, **outs)
    for name, a, b in zip(("post_mix", "comb_mix", "layer_input"), again, want):
        assert a is outs[name]
        assert_bits_equal(a, b, f"{sample['name']}: {name} (out=)")


@pytest.mark.parametrize("special", sorted(SPECIALS))
def test_pre_big_fuse_special_values_equal_the_chained_kernels(special):
    """The edge harness's special values in residual and fn (NaN, infinities, values at the
    formats' maxima, which make Sinkhorn's comb_mix a discontinuous function of the mixes:
    Op.ill_conditioned): the fused op gives the bits of its four steps' kernels chained."""
    from tile_kernels_aot import mhc

    for name in ("mhc_pre_big_fuse",) + STEPS:
        if not hasattr(mhc, name):
            pytest.skip(f"this build lacks {name}")
    sample = next((s for s in _FUSED_SAMPLES if samples.is_prebuilt(_FUSED, s)), None)
    if sample is None:
        pytest.skip("not prebuilt")
    g = torch.Generator(device="cuda").manual_seed(1)
    args, kwargs = samples.make_args(sample, min(sample["tokens"], 512), g)
    for tensor in args[:2]:  # residual, fn
        SPECIALS[special](tensor)
    got = mhc.mhc_pre_big_fuse(*args, **kwargs)
    want = _chained_kernels(mhc, *args, **kwargs)
    for name, a, b in zip(("post_mix", "comb_mix", "layer_input"), got, want):
        assert_bits_equal(a, b, f"{special}: {name}")


@pytest.mark.parametrize("tokens", [128, 8192])
def test_pre_big_fuse_through_the_modeling_path_equals_its_steps_kernels(tokens):
    """``ops.mhc_pre_big_fuse`` (the fused kernel where built, else the steps on their kernels)."""
    _needs_steps()
    assert _impl.sources()["mhc_pre_big_fuse"] in ("kernel", "kernel steps")
    p = modeling_paths.mhc_inputs(tokens, seed=tokens)
    args = (p["residual"], p["fn"], p["scale"], p["base"], 1e-6, 1e-6, 1e-6, 2.0, 10)
    post, comb, layer_input = _impl.impl.mhc_pre_big_fuse(*args)

    impl = _impl.impl
    mixes = impl.mhc_pre_norm_fn(p["residual"], p["fn"], None, 1e-6)
    pre_k, post_k, comb_k = impl.mhc_pre_split_mixes(mixes, p["scale"], p["base"], 4, 2.0, 1e-6)
    comb_k = impl.sinkhorn_normalize(comb_k, repeat=10, eps=1e-6)
    assert_bits_equal(post, post_k)
    assert_bits_equal(comb, comb_k)
    assert_bits_equal(layer_input, impl.mhc_pre_apply_mix(p["residual"], pre_k))

    post_r, comb_r, layer_input_r = ref.mhc_pre_big_fuse(*args)
    # the norm-fn kernel's mixes differ from the reference's by its projection's summation order
    # (up to 1e-4 of the largest mix by its stated bound, ~2e-6 of it at K = 10240 by a
    # truncating-accumulator model); post = 2 sigmoid(scale * mix + base) and sinkhorn's comb move
    # by at most scale * that relative (softmax: up to twice), which rtol 1e-5 does not cover
    torch.testing.assert_close(post, post_r, rtol=5e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_r, rtol=5e-5, atol=1e-6)
    torch.testing.assert_close(layer_input.float(), layer_input_r.float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("tokens", [128, 8192])
def test_mhc_layer_path_in_a_cuda_graph_matches_eager(tokens):
    _needs_steps()
    from tile_kernels_aot.bench import capture_graph

    p = modeling_paths.mhc_inputs(tokens, seed=tokens + 1)
    with torch.no_grad():
        eager = modeling_paths.mhc_layer("tile_kernels_aot", p).clone()
        graph, out = capture_graph(lambda: modeling_paths.mhc_layer("tile_kernels_aot", p))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    assert_bits_equal(out, eager)


def _close_to_largest(got, want, rtol, atol):
    """``|got - want| <= rtol * |want| + atol * max|want|`` (the ops' tolerance rule)."""
    got, want = got.double(), want.double()
    bound = rtol * want.abs() + atol * want.abs().max()
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())


@pytest.mark.parametrize("tokens", [128, 8192])
@pytest.mark.parametrize("weight", [False, True])
def test_norm_fn_backward_on_the_kernel(tokens, weight):
    """``mhc_pre_norm_fn``'s autograd backward on CUDA bf16 (``S`` from one float32 reduction,
    the per-token part from the saved output, ``mhc_pre_norm_fn_bwd_mul`` on its kernel) agrees
    with the same steps on the references within the kernel's stated tolerance (docs/ops.md),
    and with the reference backward within TF32 (the saved output comes from the forward
    kernel's TF32 projection, which moves ``S_grad`` by ~2^-11 relative); the public backward
    (``impl.mhc_pre_norm_fn_bwd``: the reference's composition with the K-wide part on the
    kernel) agrees with the reference within the kernel's tolerance."""
    if _impl.sources().get("mhc_pre_norm_fn_bwd_mul") != "kernel" or _impl.sources()["mhc_pre_norm_fn"] != "kernel":
        pytest.skip("this build lacks the norm-fn kernels")
    from tile_kernels_aot.modeling.mhc.ops import norm_fn

    p = modeling_paths.mhc_inputs(tokens, seed=tokens + 2)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    k = p["fn"].shape[1]
    normw = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")) if weight else None
    og = torch.randn(*p["residual"].shape[:-2], p["fn"].shape[0], generator=gen, device="cuda")
    acc = torch.randn(p["residual"].shape, generator=gen, device="cuda").bfloat16()

    residual = p["residual"].detach().requires_grad_()
    fn = p["fn"].detach().requires_grad_()
    w = normw.detach().requires_grad_() if weight else None
    norm_fn.mhc_pre_norm_fn(residual, fn, w, 1e-6).backward(og)

    # the same steps on the references
    merged = p["fn"] if normw is None else ref.mhc_fn_normw_merge(p["fn"], normw)
    out = _impl.impl.mhc_pre_norm_fn(p["residual"], merged, None, 1e-6)
    sqrsum = torch.linalg.vector_norm(p["residual"].flatten(-2), dim=-1, dtype=torch.float32).square()
    ug, sg = ref._norm_fn_bwd_norm(og, out, sqrsum, k, 1e-6)
    x_want, merged_want = ref.mhc_pre_norm_fn_bwd_mul(ug, sg, p["residual"], merged)
    _close_to_largest(residual.grad.float(), x_want.float(), 2 ** -7, 2 ** -20)
    if weight:
        fn_want, w_want = ref.mhc_fn_normw_merge_bwd(p["fn"], normw, merged_want)
        _close_to_largest(fn.grad, fn_want, 1e-5, 1e-5)
        _close_to_largest(w.grad, w_want, 1e-5, 1e-5)
    else:
        _close_to_largest(fn.grad, merged_want, 1e-5, 1e-5)

    want = ref.mhc_pre_norm_fn_bwd(og, p["residual"], p["fn"], normw, 1e-6)
    _close_to_largest(residual.grad.float(), want[0].float(), 2 ** -7, 2 ** -10)
    _close_to_largest(fn.grad, want[1], 1e-4, 1e-5)

    got = _impl.impl.mhc_pre_norm_fn_bwd(og, p["residual"], p["fn"], normw, 1e-6, acc)
    want = ref.mhc_pre_norm_fn_bwd(og, p["residual"], p["fn"], normw, 1e-6, acc)
    _close_to_largest(got[0].float(), want[0].float(), 2 ** -7, 2 ** -20)
    _close_to_largest(got[1], want[1], 1e-5, 1e-5)
