"""The ops of the installed build and their samples, as the GPU tests parametrize over them."""

import pytest

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

