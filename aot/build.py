"""The whole bundle build: table -> lower -> compile -> manifest -> stubs.

``--arch`` and ``--shard i/N`` split a build over machines (``python -m aot merge`` joins
the bundles).  Output layout (``--out DIR``)::

    DIR/manifest.json
    DIR/kernels/<arch>/<kernel>__<config>.cubin
    DIR/stubs/*.cc            (generated C++ host stubs)
    build/aot-cache/          (content-hash caches: lowered/*.json, cubin/*.cubin; TKA_CACHE_DIR overrides)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from aot import lower as lw
from aot import manifest as mf
from aot import stubgen
from aot.cubin import cubin_arch, has_ptx
from aot.table import config_key, load_table
from aot.targets import ARCH_NAMES
from kernels_tl.folders import op_folders

def cubin_name(kernel: str, config: dict) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", f"{kernel}__{config_key(config).replace(',', '__')}") + ".cubin"


def build_one(kernel: str, config: dict, arch: str, cache_dir: str) -> tuple:
    """Lower (cached) and compile (cached) one kernel; returns (lowered json, cubin path, what ran)."""
    from aot.compile import compile_cubin

    cache = Path(cache_dir)
    key = lw.lowering_key(kernel, config, arch)
    lowered_path = cache / "lowered" / f"{key}.json"
    ran = []
    if lowered_path.exists():
        lowered = lw.LoweredKernel.from_json(lowered_path.read_text())
    else:
        lowered = lw.lower(kernel, config, arch)
        lowered_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = lowered_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(lowered.to_json())
        os.replace(tmp, lowered_path)
        ran.append("lowered")
    before = time.time()
    cubin = compile_cubin(lowered.source, arch, cache / "cubin")
    if cubin.stat().st_mtime >= before:
        ran.append("compiled")
    return lowered.to_json(), str(cubin), "+".join(ran) or "cached"


def shard_table(table: dict, shard: tuple) -> dict:
    """Shard ``(i, n)`` (1-based) of ``table``: the configs whose index in the order of
    (kernel name, config key) is i - 1 modulo n, in the table's order."""
    i, n = shard
    mine = set(sorted((k, config_key(cfg)) for k, configs in table.items() for cfg in configs)[i - 1::n])
    return {k: [cfg for cfg in configs if (k, config_key(cfg)) in mine] for k, configs in table.items()}


def write_bundle(out: Path, manifest: dict, folders) -> list:
    """A bundle's manifest.json and stubs (its cubins in place); returns the stubs' ``.cc`` paths."""
    out.mkdir(parents=True, exist_ok=True)
    mf.write_manifest(out / "manifest.json", manifest)
    units = [(f.kernel, f.schema, manifest["kernels"][f.kernel], f.path) for f in folders]
    return stubgen.write_stubs(out / "stubs", units)


def build(out: Path, table_path: Path, archs: list, jobs: int, shard=(1, 1), log=print) -> dict:
    out = Path(out)
    cache_dir = Path(os.environ.get("TKA_CACHE_DIR", Path(__file__).resolve().parent.parent / "build" / "aot-cache"))
    table = load_table(table_path)
    folders = op_folders()
    kernels = [f.kernel for f in folders]
    unknown = [k for k in table if k not in kernels]
    if unknown:
        raise ValueError(f"{table_path}: unknown kernels {unknown}; known: {kernels}")
    table = shard_table(table, shard)
    tasks = [(k, cfg, arch) for k in kernels for cfg in table.get(k, []) for arch in archs]
    part = f", shard {shard[0]}/{shard[1]}" if shard[1] > 1 else ""
    log(f"aot build: {len(tasks)} kernels ({len(archs)} archs{part}) from {table_path} with {jobs} jobs")
    results = {}
    started = time.time()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(build_one, k, cfg, arch, str(cache_dir)): (k, cfg, arch) for k, cfg, arch in tasks}
        for done, fut in enumerate(as_completed(futures), 1):
            k, cfg, arch = futures[fut]
            lowered_json, cubin, ran = fut.result()
            results[(k, config_key(cfg), arch)] = (lw.LoweredKernel.from_json(lowered_json), Path(cubin))
            log(f"[{done}/{len(tasks)}] {k} {config_key(cfg)} {arch}: {ran} ({time.time() - started:.0f}s)")

    kernels_dir = out / "kernels"
    if kernels_dir.exists():
        shutil.rmtree(kernels_dir)
    builds = {}
    for k, cfg, arch in tasks:
        lowered, cubin = results[(k, config_key(cfg), arch)]
        data = cubin.read_bytes()
        if cubin_arch(data) != arch or has_ptx(data):
            raise RuntimeError(f"{cubin}: expected SASS for {arch} without PTX, got {cubin_arch(data)}")
        rel = f"{arch}/{cubin_name(k, cfg)}"
        (kernels_dir / arch).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cubin, kernels_dir / rel)
        builds[(k, config_key(cfg), arch)] = mf.kernel_build_record(lowered, rel, data)
    manifest = mf.bundle_manifest(mf.toolchain(), Path(table_path).name, table, folders, archs, builds, shard)
    stubs = write_bundle(out, manifest, folders)
    log(f"aot build: wrote {out / 'manifest.json'} and {len(stubs)} stub files in {time.time() - started:.0f}s")
    return manifest


def parse_shard(text: str) -> tuple:
    """``"i/N"`` (1 <= i <= N) -> (i, N)."""
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise argparse.ArgumentTypeError(f"expected i/N with 1 <= i <= N, got {text!r}")
    return int(i), int(n)


def main(argv=None) -> int:
    from aot.table import DEFAULT_TABLE

    parser = argparse.ArgumentParser(prog="python -m aot build", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--out", required=True, type=Path, help="bundle directory to write")
    parser.add_argument("--table", type=Path, default=DEFAULT_TABLE, help="shape table (default: the wheel's)")
    parser.add_argument("--arch", default=",".join(ARCH_NAMES), help="comma-separated archs (default: %(default)s)")
    parser.add_argument("--shard", type=parse_shard, default=(1, 1), metavar="i/N",
                        help="build only the i-th of N parts of the table's configs (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    archs = [a for a in args.arch.split(",") if a]
    bad = [a for a in archs if a not in ARCH_NAMES]
    if bad:
        parser.error(f"unknown arch {bad}; choose from {ARCH_NAMES}")
    build(args.out, args.table, archs, max(1, args.jobs), args.shard, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
