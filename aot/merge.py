"""``python -m aot merge BUNDLE... --out DIR``: one bundle from bundles built apart.

CI builds each arch, or each shard of a big table (``python -m aot build --arch A --shard
i/N``), on its own machine and merges them.  The bundles must share the schema, the
toolchain and the table, and between them hold each (kernel, config, arch) that the table
and their archs call for exactly once.  The merged bundle is what one build of all those
archs and configs writes: the same manifest, cubins and stubs.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

from aot import manifest as mf
from aot.build import write_bundle
from aot.table import SHAPES_DIR, config_key, load_table
from aot.targets import ARCH_NAMES
from kernels_tl.folders import op_folders


def check_agreement(bundles: list) -> None:
    """``bundles``: [(path, manifest)].  Refuses when they differ in the table or the toolchain
    (``read_manifest`` has refused any other schema version)."""
    fields = {"table": [m["table"] for _, m in bundles]}
    for key in sorted({key for _, m in bundles for key in m["toolchain"]}):
        fields[f"toolchain.{key}"] = [m["toolchain"].get(key) for _, m in bundles]
    for name, values in fields.items():
        if any(v != values[0] for v in values):
            raise ValueError(f"the bundles differ in {name}: "
                             + "; ".join(f"{path}: {v}" for (path, _), v in zip(bundles, values)))


def _describe(where: tuple) -> str:
    """(kernel, config key, arch) as text; a kernel without static dims has an empty key."""
    return " ".join(part for part in where if part)


def bundle_builds(bundles: list) -> dict:
    """``{(kernel, config key, arch): (bundle path, build record)}`` over ``bundles``
    ([(path, manifest)]); refuses a build that two bundles hold."""
    found = {}
    for path, m in bundles:
        for kernel, entry in m["kernels"].items():
            for cfg in entry["configs"]:
                for arch, record in cfg["builds"].items():
                    where = (kernel, cfg["key"], arch)
                    if where in found:
                        raise ValueError(f"{_describe(where)} is in two bundles: {found[where][0]} and {path}")
                    found[where] = (path, record)
    return found


def check_coverage(found: dict, table: dict, archs: list, bundles: list) -> None:
    """Refuses when the builds ``found`` are not exactly the table's configs times ``archs``."""
    wanted = {(k, config_key(cfg), arch) for k, configs in table.items() for cfg in configs for arch in archs}
    names = ", ".join(str(path) for path, _ in bundles)
    for what, builds in (("lack {} builds the table calls for", wanted - found.keys()),
                         ("hold {} builds the table does not call for", found.keys() - wanted)):
        if builds:
            shown = "; ".join(_describe(b) for b in sorted(builds)[:5]) + ("; ..." if len(builds) > 5 else "")
            raise ValueError(f"the bundles {names} {what.format(len(builds))}: {shown}")


def merge(bundles: list, out: Path, table_path: Path = None, log=print) -> dict:
    out = Path(out)
    if any(out.resolve() == Path(b).resolve() for b in bundles):
        raise ValueError(f"--out {out} is one of the bundles")
    bundles = [(Path(b), mf.read_manifest(Path(b) / "manifest.json")) for b in bundles]
    check_agreement(bundles)
    first = bundles[0][1]
    table_path = Path(table_path or SHAPES_DIR / first["table"])
    if table_path.name != first["table"] or not table_path.is_file():
        raise ValueError(f"the bundles were built from table {first['table']}: give it with --table (not {table_path})")
    table = load_table(table_path)
    archs = [a for a in ARCH_NAMES if any(a in m["archs"] for _, m in bundles)]
    found = bundle_builds(bundles)
    check_coverage(found, table, archs, bundles)

    kernels_dir = out / "kernels"
    if kernels_dir.exists():
        shutil.rmtree(kernels_dir)
    for path, record in found.values():
        data = (path / "kernels" / record["cubin"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != record["sha256"]:
            raise ValueError(f"{path / 'kernels' / record['cubin']}: sha256 differs from the bundle's manifest")
        (kernels_dir / record["cubin"]).parent.mkdir(parents=True, exist_ok=True)
        (kernels_dir / record["cubin"]).write_bytes(data)
    folders = op_folders()
    manifest = mf.bundle_manifest(first["toolchain"], first["table"], table, folders, archs,
                                  {where: record for where, (_, record) in found.items()})
    stubs = write_bundle(out, manifest, folders)
    log(f"aot merge: {len(found)} cubins from {len(bundles)} bundles; wrote {out / 'manifest.json'} "
        f"and {len(stubs)} stub files")
    return manifest


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m aot merge", description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path, help="bundle directories (python -m aot build --out)")
    parser.add_argument("--out", required=True, type=Path, help="bundle directory to write")
    parser.add_argument("--table", type=Path, help="the bundles' shape table (default: aot/shapes/<its name>)")
    args = parser.parse_args(argv)
    try:
        merge(args.bundles, args.out, args.table)
    except (OSError, ValueError) as e:
        sys.exit(f"python -m aot merge: {e}")
    return 0
