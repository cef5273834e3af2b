"""The mHC modeling paths on the GPU: ``mhc_pre_big_fuse`` (no kernel of its own in this build)
runs its reference's composition with each step on its kernel, and one decoder layer's mHC path
(``mhc_pre`` -> a stand-in sublayer -> ``mhc_post``, as ``tile_kernels_aot.modeling_paths`` times
it) gives the same bits captured in a CUDA graph as eagerly.

The composition is checked bit for bit against the same four kernels called one by one, and
against the reference chain within ``mhc_pre_norm_fn``'s stated tolerance (its kernel sums the
projection in another order than the reference: docs/ops.md), propagated through the later steps.
"""

import pytest
import torch

from tile_kernels_aot import modeling_paths
from tile_kernels_aot.modeling.mhc.ops import _impl
from tile_kernels_aot.torch import mhc as ref

from checks import assert_bits_equal, prebuilt_configs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = ("mhc_pre_norm_fn", "mhc_pre_split_mixes", "sinkhorn_normalize", "mhc_pre_apply_mix")


def _needs_steps():
    missing = [s for s in STEPS if _impl.sources()[s] != "kernel"]
    if missing:
        pytest.skip(f"this build lacks the kernels of {missing}")
    hidden = {c.get("hidden") for c in prebuilt_configs("mhc.mhc_pre_norm_fn")}
    if modeling_paths.MHC_HIDDEN not in hidden and None not in hidden:
        pytest.skip(f"no prebuilt mhc_pre_norm_fn for hidden {modeling_paths.MHC_HIDDEN}")


@pytest.mark.parametrize("tokens", [128, 8192])
def test_pre_big_fuse_runs_its_steps_on_the_kernels(tokens):
    _needs_steps()
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
    torch.testing.assert_close(post, post_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_r, rtol=1e-5, atol=1e-6)
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
