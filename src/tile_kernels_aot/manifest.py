"""The installed bundle's manifest: what kernels this package holds."""

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


def op_bytes(op: str, dims: dict) -> int:
    """The bytes one launch of ``op`` (``'module.name'``) must move, from its kernel spec's formula."""
    for record in load()["ops"]:
        if f"{record['module']}.{record['name']}" == op:
            return int(eval(record["bytes"], {"__builtins__": {}, "ceil_div": lambda a, b: -(-a // b)}, dict(dims)))
    raise KeyError(op)
