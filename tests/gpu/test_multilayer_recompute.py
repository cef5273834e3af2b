"""``mhc_multilayer_recompute``'s fused kernel against the single-layer kernels it fuses
(``mhc_pre_apply_mix``, ``mhc_post``) chained, bit for bit, on every sample (the reference
comparison, within ``mhc_post``'s tolerance, is test_ops'); through the modeling path with
leading dims; and captured in a CUDA graph (the pointers are kernel parameters, no table)."""

import pytest
import torch

from tile_kernels_aot import manifest, samples

from checks import assert_bits_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RECORD = next((r for r in manifest.ops() if r["name"] == "mhc_multilayer_recompute"), None)
SAMPLES = RECORD["samples"] if RECORD else []


def _kernels():
    from tile_kernels_aot import mhc

    for name in ("mhc_multilayer_recompute", "mhc_pre_apply_mix", "mhc_post"):
        if not hasattr(mhc, name):
            pytest.skip(f"this build lacks {name}")
    return mhc


def _chain(mhc, r, pre, outs, posts, combs):
    inputs, residuals = [], []
    for i in range(len(pre)):
        inputs.append(mhc.mhc_pre_apply_mix(r, pre[i]))
        if i < len(outs):
            r = mhc.mhc_post(outs[i], r, posts[i], combs[i])
            residuals.append(r)
    return inputs, residuals


def _check(got_inputs, got_residuals, inputs, residuals, what):
    assert len(got_inputs) == len(inputs) and len(got_residuals) == len(residuals)
    for i, (g, w) in enumerate(zip(got_inputs, inputs)):
        assert_bits_equal(g, w, f"{what} layer_input_list[{i}]")
    for i, (g, w) in enumerate(zip(got_residuals, residuals)):
        assert_bits_equal(g, w, f"{what} residual_list[{i}]")


@pytest.mark.parametrize("sample", SAMPLES, ids=[s["name"] for s in SAMPLES])
def test_fused_equals_the_chained_kernels(sample):
    mhc = _kernels()
    if not samples.is_prebuilt(RECORD, sample):
        pytest.skip("not prebuilt")
    g = torch.Generator(device="cuda").manual_seed(0)
    (r0, pre, outs, posts, combs, li, res), _ = samples.make_args(sample, gen=g)
    assert mhc.mhc_multilayer_recompute(r0, pre, outs, posts, combs, li, res) is None
    _check(li, res, *_chain(mhc, r0, pre, outs, posts, combs), sample["name"])


def test_modeling_path_with_leading_dims():
    """The modeling function on [2, T/2, ...] tensors (mixes as [..., M]) runs the kernel and
    equals the chained kernels on the flattened tensors."""
    mhc = _kernels()
    from tile_kernels_aot.modeling.mhc.ops import mhc_multilayer_recompute

    g = torch.Generator(device="cuda").manual_seed(1)
    n, m, h, layers = 96, 4, 2560, 5

    def draw(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.rand(shape, generator=g, device="cuda") * scale).to(dtype)

    r0 = draw(2, n // 2, m, h)
    pre = [draw(2, n // 2, m, dtype=torch.float32, scale=2.0) for _ in range(layers)]
    outs = [draw(2, n // 2, h) for _ in range(layers - 1)]
    posts = [draw(2, n // 2, m, 1, dtype=torch.float32, scale=2.0) for _ in range(layers - 1)]
    combs = [draw(2, n // 2, m, m, dtype=torch.float32) for _ in range(layers - 1)]
    li = [torch.empty(2, n // 2, h, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    res = [torch.empty(2, n // 2, m, h, dtype=torch.bfloat16, device="cuda") for _ in range(layers - 1)]
    mhc_multilayer_recompute(r0, pre, outs, posts, combs, li, res)
    flat = lambda ts, *rest: [t.reshape(n, *rest) for t in ts]  # noqa: E731
    want = _chain(mhc, r0.reshape(n, m, h), flat(pre, m, 1), flat(outs, h), flat(posts, m, 1), flat(combs, m, m))
    _check(flat(li, h), flat(res, m, h), *want, "modeling")


def test_graph_capture_replays_new_inputs():
    """Captured with more layers than one launch takes (chained launches), replayed after the
    inputs changed in place: the replay equals an eager call on the new inputs."""
    mhc = _kernels()
    sample = next(s for s in SAMPLES if s["name"].startswith("chained"))
    g = torch.Generator(device="cuda").manual_seed(2)
    (r0, pre, outs, posts, combs, li, res), _ = samples.make_args(sample, gen=g)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mhc.mhc_multilayer_recompute(r0, pre, outs, posts, combs, li, res)  # warm up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            mhc.mhc_multilayer_recompute(r0, pre, outs, posts, combs, li, res)
    torch.cuda.current_stream().wait_stream(stream)
    for t in [r0, *outs]:
        t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    _check(li, res, *_chain(mhc, r0, pre, outs, posts, combs), "graph replay")
