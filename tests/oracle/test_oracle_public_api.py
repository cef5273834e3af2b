"""Our public ops against TileKernels 1.0.0's, live: the same parameters (names, order,
defaults) first, then only keyword-only additions.  Runs where both packages import
(CI installs our wheel into the oracle environment, with torch 2.13)."""

import importlib
import inspect

import pytest

tile_kernels = pytest.importorskip("tile_kernels")
ours = pytest.importorskip("tile_kernels_aot")
pytest.importorskip("tile_kernels_aot._C", reason="the extension is not installed here")

from tile_kernels_aot import manifest  # noqa: E402

OPS = [f"{o['module']}.{o['name']}" for o in manifest.load()["ops"]]


def _strip(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("op", OPS)
def test_signature_matches_upstream(op):
    module, name = op.split(".")
    if not hasattr(getattr(tile_kernels, module), name):
        # upstream's tile_kernels.mhc exports no functions: its API is the modeling paths
        # (test_modeling_functions_are_at_upstreams_paths) and its references'
        upstream_ref = getattr(importlib.import_module(f"tile_kernels.torch.{module}"), name, None)
        if upstream_ref is None:
            pytest.skip(f"tile_kernels.{module} has no {name}")
        theirs = [p.name for p in inspect.signature(upstream_ref).parameters.values()]
        mine = [p.name for p in inspect.signature(getattr(getattr(ours, module), name)).parameters.values()]
        assert mine[: len(theirs)] == theirs, f"{op}: {mine} vs upstream's reference {theirs}"
        return
    upstream = _strip(inspect.signature(getattr(getattr(tile_kernels, module), name)))
    mine = _strip(inspect.signature(getattr(getattr(ours, module), name)))
    assert mine[: len(upstream)] == upstream, f"{op}: {mine} vs upstream {upstream}"
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in mine[len(upstream):])



# TileKernels' modeling modules and the public functions each one holds
MODELING = {
    "modeling.mhc.functional": ("expand_from_embedding", "mhc_pre", "mhc_head"),
    "modeling.mhc.ops.expand": ("expand_to_mhc",),
    "modeling.mhc.ops.head_compute_mix": ("mhc_head_compute_mix",),
    "modeling.mhc.ops.multilayer_recompute": ("mhc_multilayer_recompute",),
    "modeling.mhc.ops.norm_fn": ("mhc_pre_norm_fn",),
    "modeling.mhc.ops.post": ("mhc_post", "mhc_post_fwd", "mhc_post_bwd"),
    "modeling.mhc.ops.pre_apply_mix": ("mhc_pre_apply_mix",),
    "modeling.mhc.ops.pre_big_fuse": ("mhc_pre_big_fuse",),
    "modeling.mhc.ops.pre_split_mixes": ("mhc_pre_split_mixes",),
    "modeling.mhc.ops.sinkhorn": ("sinkhorn_normalize",),
}


@pytest.mark.parametrize("path", sorted(MODELING))
def test_modeling_functions_are_at_upstreams_paths(path):
    """Each function of an upstream modeling module is at the same path here, with upstream's
    parameter names first."""
    import importlib

    upstream = importlib.import_module(f"tile_kernels.{path}")
    mine = importlib.import_module(f"tile_kernels_aot.{path}")
    for name in MODELING[path]:
        theirs = [p[0] for p in _strip(inspect.signature(getattr(upstream, name)))]
        ours_ = [p[0] for p in _strip(inspect.signature(getattr(mine, name)))]
        assert ours_[: len(theirs)] == theirs, f"{path}.{name}: {ours_} vs upstream {theirs}"
