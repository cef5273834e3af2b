"""The modeling package's mHC ops run the prebuilt kernels where the build has them
(``ops._impl.sources()``), and fall back to the references for calls the kernels do not
take (CPU tensors, float64), with the caller's leading dims."""

import pytest
import torch

from tile_kernels_aot.modeling.mhc.ops import _impl
from tile_kernels_aot.torch import mhc as ref

STREAM_OPS = ["expand_to_mhc", "expand_to_mhc_bwd", "mhc_pre_apply_mix", "mhc_pre_apply_mix_bwd",
              "mhc_post", "mhc_post_fwd", "mhc_post_bwd"]


def _built() -> set:
    try:
        from tile_kernels_aot import mhc
    except ImportError:
        return set()
    return set(mhc.__all__)


@pytest.mark.parametrize("name", STREAM_OPS)
def test_sources_report_the_kernel_when_built(name):
    if name not in _built():
        pytest.skip(f"this build has no mhc.{name}")
    assert _impl.sources()[name] == "kernel"


def test_sources_cover_every_reference_name():
    sources = _impl.sources()
    assert set(sources) == set(ref.__all__)
    assert set(sources.values()) <= {"kernel", "kernel steps", "reference"}
    built = _built()
    assert {n for n, s in sources.items() if s == "kernel"} == built & set(ref.__all__)


def test_a_composition_runs_its_steps_on_the_kernels():
    """``mhc_pre_big_fuse`` in a build without its own kernel: its reference's steps (norm-fn,
    split, Sinkhorn, apply) resolve to the built kernels, and on CPU tensors (which the kernels do
    not take) the composition still gives the reference's values.  In a build with the fused
    kernel, ``impl`` takes that instead; the composition is then built here the same way."""
    steps = {"mhc_pre_norm_fn", "mhc_pre_split_mixes", "sinkhorn_normalize", "mhc_pre_apply_mix"}
    if not steps <= _built():
        pytest.skip("this build lacks one of mhc_pre_big_fuse's steps")
    if "mhc_pre_big_fuse" in _built():
        assert _impl.sources()["mhc_pre_big_fuse"] == "kernel"
        composed = _impl._over_kernels(ref.mhc_pre_big_fuse, _impl._kernel_steps(ref.mhc_pre_big_fuse))
    else:
        assert _impl.sources()["mhc_pre_big_fuse"] == "kernel steps"
        composed = _impl.impl.mhc_pre_big_fuse
    assert composed.__globals__["mhc_pre_norm_fn"] is _impl.impl.mhc_pre_norm_fn
    gen = torch.Generator().manual_seed(7)
    m, h = 4, 64
    res = torch.randn(3, m, h, generator=gen).bfloat16()
    fn = torch.randn(m * (m + 2), m * h, generator=gen)
    scale, base = torch.rand(3, generator=gen), torch.randn(m * (m + 2), generator=gen)
    got = composed(res, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 10)
    want = ref.mhc_pre_big_fuse(res, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 10)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_calls_the_kernels_do_not_take_run_the_reference():
    """CPU and float64 tensors, leading dims (n0, n1): the results are the reference's."""
    if not _built() & set(STREAM_OPS):
        pytest.skip("this build has no mHC stream kernels")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 4, 64, generator=gen).bfloat16()
    mix = torch.rand(2, 3, 4, 1, generator=gen)
    assert torch.equal(_impl.impl.mhc_pre_apply_mix(x, mix), ref.mhc_pre_apply_mix(x, mix))
    hidden = torch.randn(2, 3, 64, generator=gen, dtype=torch.float64)
    out = torch.empty(2, 3, 4, 64, dtype=torch.float64)
    assert _impl.impl.expand_to_mhc(hidden, 4, out) is out
    assert torch.equal(out, ref.expand_to_mhc(hidden, 4))
    comb = torch.rand(2, 3, 4, 4, generator=gen)
    d_o = torch.randn(2, 3, 4, 64, generator=gen).bfloat16()
    got = _impl.impl.mhc_post_bwd(x[..., 0, :], x, mix, comb, d_o, fuse_grad_acc=True)
    want = ref.mhc_post_bwd(x[..., 0, :], x, mix, comb, d_o, fuse_grad_acc=False)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(x.untyped_storage().grad_from_mhc_post, want[1])


def test_op_tolerance_is_data_and_checked_as_declared():
    """``Op.tolerance`` (an output compared within ``rtol * |want| + atol * max|want|``): plain
    JSON data in the manifest, and the GPU tests' comparison accepts exactly that bound."""
    import importlib.util
    from pathlib import Path

    from kernels_tl.schema import Op, to_json

    op = Op(module="m", name="n", params=[], outs=[], returns=[], reference="r", samples=[], doc="",
            tolerance={"y": (1e-3, 1e-4)})
    assert to_json(op)["tolerance"] == {"y": [1e-3, 1e-4]}
    assert to_json(Op(module="m", name="n", params=[], outs=[], returns=[], reference="r", samples=[],
                      doc=""))["tolerance"] == {}

    path = Path(__file__).resolve().parents[1] / "gpu" / "checks.py"
    spec = importlib.util.spec_from_file_location("gpu_checks", path)
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    record = {"tolerance": {"y": [1e-3, 1e-4]}}
    want = torch.tensor([1000.0, 1.0, float("nan"), float("inf")])
    checks.assert_matches(record, "y", want + torch.tensor([0.5, 0.05, 0, 0]), want)  # within 1e-3*|w| + 0.1
    with pytest.raises(AssertionError):
        checks.assert_matches(record, "y", want + torch.tensor([0.0, 0.2, 0, 0]), want)
    with pytest.raises(AssertionError):
        checks.assert_matches(record, "y", torch.tensor([1000.0, 1.0, 0.0, float("inf")]), want)  # NaN moved
    with pytest.raises(AssertionError):  # no tolerance for "z": bit for bit
        checks.assert_matches(record, "z", want + torch.tensor([0.5, 0, 0, 0]), want)


def test_only_token_leading_tensors_are_flattened():
    """A kernel call flattens the caller's leading dims of the per-token tensors only: the mix
    scale and bias (no token dim) are handed over as they are, so a call with leading dims
    (n0, n1) reaches the kernel instead of falling back to the reference."""
    if "mhc_pre_split_mixes" not in _built():
        pytest.skip("this build has no mhc.mhc_pre_split_mixes")
    from tile_kernels_aot import manifest

    record = manifest.op("mhc.mhc_pre_split_mixes")
    assert _impl._token_params(record) == {"input_mixes"}
    if "mhc_pre_apply_mix_bwd" in _built():  # an optional per-token input (absent from some samples)
        assert "x_grad" in _impl._token_params(manifest.op("mhc.mhc_pre_apply_mix_bwd"))


def test_outputs_without_the_token_dim_keep_their_shape():
    """A kernel's outputs are given the caller's leading dims back only when they have the token
    dim: the norm-fn backward's projection gradient and the split mixes' scale and base
    gradients are returned as they are."""
    from tile_kernels_aot import manifest

    built = _built()
    if "mhc_pre_norm_fn_bwd_mul" in built:
        record = manifest.op("mhc.mhc_pre_norm_fn_bwd_mul")
        firsts = _impl._token_params(record) | {record["params"][0]["name"]}
        assert _impl._token_outputs(record, firsts) == {"x_grad_out"}
    if "mhc_pre_split_mixes_bwd" in built:
        record = manifest.op("mhc.mhc_pre_split_mixes_bwd")
        assert _impl._token_outputs(record, _impl._token_params(record)) == {"input_mixes_grad"}


def test_norm_fn_backward_runs_its_k_wide_part_on_the_kernel():
    """``mhc_pre_norm_fn_bwd`` (the public backward, and ``MHCPreNormFn``'s off the kernel's
    inputs) composes the per-token part in PyTorch with ``mhc_pre_norm_fn_bwd_mul``, which
    resolves to the kernel where built; ``MHCPreNormFn.backward`` calls that kernel directly on
    CUDA bf16 inputs.  On CPU tensors the results are the reference's, leading dims kept."""
    if "mhc_pre_norm_fn_bwd_mul" not in _built():
        pytest.skip("this build has no mhc.mhc_pre_norm_fn_bwd_mul")
    from tile_kernels_aot.modeling.mhc.ops import norm_fn

    assert _impl.sources()["mhc_pre_norm_fn_bwd_mul"] == "kernel"
    assert _impl.sources()["mhc_pre_norm_fn_bwd"] == "kernel steps"
    composed = _impl.impl.mhc_pre_norm_fn_bwd
    assert composed.__globals__["mhc_pre_norm_fn_bwd_mul"] is _impl.impl.mhc_pre_norm_fn_bwd_mul
    assert "mhc_pre_norm_fn_bwd_mul" in norm_fn._pre_norm_fn_bwd.__code__.co_names
    gen = torch.Generator().manual_seed(11)
    m, h = 4, 64
    res = torch.randn(2, 3, m, h, generator=gen).bfloat16()
    fn = torch.randn(m * (m + 2), m * h, generator=gen)
    w = torch.rand(m * h, generator=gen)
    og = torch.randn(2, 3, m * (m + 2), generator=gen)
    acc = torch.randn(2, 3, m, h, generator=gen).bfloat16()
    for weight, x_grad in ((None, None), (w, acc)):
        got = composed(og, res, fn, weight, 1e-6, x_grad)
        want = ref.mhc_pre_norm_fn_bwd(og, res, fn, weight, 1e-6, x_grad)
        assert all((g is None and v is None) or torch.equal(g, v) for g, v in zip(got, want))
    ug, sg = og[0], og[0, :, 0].contiguous()
    got = _impl.impl.mhc_pre_norm_fn_bwd_mul(ug, sg, res[0], fn, acc[0])
    want = ref.mhc_pre_norm_fn_bwd_mul(ug, sg, res[0], fn, acc[0])
    assert got[0].shape == res[0].shape and got[1].shape == fn.shape
    assert all(torch.equal(g, v) for g, v in zip(got, want))


def test_the_fused_pre_path_kernel_takes_the_modeling_call():
    """With the fused ``mhc_pre_big_fuse`` kernel built, ``ops.mhc_pre_big_fuse`` is it (leading dims
    flattened and restored); a call it does not take (CPU tensors) gives the reference's values in
    the reference's shapes."""
    if "mhc_pre_big_fuse" not in _built():
        pytest.skip("this build has no fused mhc_pre_big_fuse kernel")
    from tile_kernels_aot.modeling.mhc.ops import mhc_pre_big_fuse

    assert _impl.sources()["mhc_pre_big_fuse"] == "kernel"
    gen = torch.Generator().manual_seed(11)
    m, h = 4, 256
    res = torch.randn(2, 3, m, h, generator=gen).bfloat16()
    fn = torch.randn(m * (m + 2), m * h, generator=gen) * 0.01
    scale, base = torch.rand(3, generator=gen), torch.randn(m * (m + 2), generator=gen)
    got = mhc_pre_big_fuse(res, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 10)
    want = ref.mhc_pre_big_fuse(res, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 10)
    assert [tuple(g.shape) for g in got] == [(2, 3, m, 1), (2, 3, m, m), (2, 3, h)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
