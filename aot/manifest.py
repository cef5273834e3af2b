"""Stage 3: the manifest -- what a bundle holds, as JSON.

It records the toolchain, the archs, the table (and the shard of it a partial
build holds) and, per kernel and static config, each arch's cubin
(file, sha256, size), entry symbol, parameters, launch geometry (with its thread-block
cluster shape) and whether it
may be launched as a programmatic dependent of the previous grid, plus the
public ops with their schemas (parameters, outputs, reference, samples, byte formulas).  The runtime package
installs it; ``python -m tile_kernels_aot info`` and the bench read it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from aot.lower import host_constants
from aot.table import config_key
from aot.targets import ARCH_NAMES

SCHEMA_VERSION = 3


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kernels_tl", "aot"], capture_output=True,
                               text=True, cwd=Path(__file__).parent.parent).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def toolchain() -> dict:
    import tilelang

    from aot import compile as cc

    return {"tilelang": tilelang.__version__, "nvcc": cc.nvcc_version(), "nvcc_flags": list(cc.NVCC_FLAGS),
            "git_revision": git_revision()}


def kernel_build_record(lowered, cubin_rel: str, cubin_bytes: bytes) -> dict:
    return {
        "arch": lowered.arch,
        "cubin": cubin_rel,
        "sha256": hashlib.sha256(cubin_bytes).hexdigest(),
        "size": len(cubin_bytes),
        "entry": lowered.entry,
        "params": lowered.params,
        "grid": lowered.grid,
        "block": lowered.block,
        "dyn_smem": lowered.dyn_smem,
        "pdl": lowered.pdl,
        "cluster": lowered.cluster,
        "cooperative": lowered.cooperative,
    }


def op_record(op, kernel_name: str) -> dict:
    """A public op as the installed package reads it: its schema as plain data (parameters,
    outputs, returns, reference, samples, bytes formula) plus its kernel and signature."""
    from aot.stubgen import text_signature
    from kernels_tl.schema import to_json

    return {**to_json(op), "kernel": kernel_name, "signature": text_signature(op)}


def bundle_manifest(toolchain: dict, table_name: str, table: dict, folders, archs, builds: dict,
                    shard=(1, 1)) -> dict:
    """The manifest of a bundle holding ``table``'s configs (``{kernel: [config]}``, in the
    table's order) for ``archs`` (listed in ``ARCH_NAMES`` order), one per op folder of
    ``folders``; ``builds[(kernel, config key, arch)]`` is a ``kernel_build_record``.  Shard
    ``(i, n)`` of a table is recorded when n > 1.  ``build`` and ``merge`` both write this."""
    archs = [a for a in ARCH_NAMES if a in archs]
    manifest = {"schema_version": SCHEMA_VERSION, "toolchain": toolchain, "archs": archs, "table": table_name}
    if shard[1] > 1:
        manifest["shard"] = list(shard)
    manifest.update(kernels={}, ops=[])
    for folder in folders:
        k = folder.kernel
        configs = [{"config": cfg, "key": config_key(cfg), "constants": host_constants(k, cfg),
                    "builds": {arch: builds[(k, config_key(cfg), arch)] for arch in archs}} for cfg in table.get(k, [])]
        manifest["kernels"][k] = {"static": list(folder.schema.static), "configs": configs}
        manifest["ops"] += [op_record(op, k) for op in folder.schema.ops]
    return manifest


def write_manifest(path: Path, manifest: dict) -> None:
    Path(path).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def read_manifest(path: Path) -> dict:
    manifest = json.loads(Path(path).read_text())
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: manifest schema {manifest.get('schema_version')} != {SCHEMA_VERSION}")
    return manifest
