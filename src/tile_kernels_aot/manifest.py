"""The installed bundle's manifest: what this build holds (kernels, configs, archs, and every
public op with its schema: parameters, outputs, reference, samples)."""

import functools
import json
from pathlib import Path

MANIFEST_PATH = Path(__file__).parent / "manifest.json"


@functools.lru_cache(None)
def load() -> dict:
    return json.loads(MANIFEST_PATH.read_text())


def configs(kernel: str) -> list:
    """The static configs of ``kernel`` (``'family.op'``) this bundle holds, in build order
    (empty when the bundle has none)."""
    return [c["config"] for c in load()["kernels"].get(kernel, {}).get("configs", [])]


def ops() -> list:
    """Every public op's record (``module``, ``name``, ``kernel``, ``params``, ``outs``,
    ``returns``, ``reference``, ``samples``, ``bytes``, ``token_dim``, ``signature``)."""
    return load()["ops"]


def op(qualname: str) -> dict:
    """The record of ``'<module>.<name>'``."""
    for record in ops():
        if f"{record['module']}.{record['name']}" == qualname:
            return record
    raise KeyError(qualname)
