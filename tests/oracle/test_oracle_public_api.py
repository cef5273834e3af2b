"""Our public ops against TileKernels 1.0.0's, live: the same parameters (names, order,
defaults) first, then only keyword-only additions.  Runs where both packages import
(CI installs our wheel into the oracle environment, with torch 2.13)."""

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
    upstream = _strip(inspect.signature(getattr(getattr(tile_kernels, module), name)))
    mine = _strip(inspect.signature(getattr(getattr(ours, module), name)))
    assert mine[: len(upstream)] == upstream, f"{op}: {mine} vs upstream {upstream}"
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in mine[len(upstream):])
