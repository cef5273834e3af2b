"""The ops of the installed build and their samples, as the GPU tests parametrize over them."""

import pytest

from checks import prebuilt_configs  # noqa: F401  (re-exported for the tests)

try:
    from tile_kernels_aot import manifest
    OPS = manifest.ops()
except (ImportError, FileNotFoundError):
    OPS = []


def qualname(record) -> str:
    return f"{record['module']}.{record['name']}"


def op_samples():
    """pytest params (record, sample) for every sample of every op."""
    return [pytest.param(r, s, id=f"{qualname(r)}[{s['name']}]") for r in OPS for s in r["samples"]]


def ops(per_token_only=False):
    """pytest params of every op (its first sample is its decode call)."""
    return [pytest.param(r, id=qualname(r)) for r in OPS if not per_token_only or r["token_dim"] is not None]
