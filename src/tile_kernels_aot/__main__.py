"""``python -m tile_kernels_aot info`` | ``bench [--json FILE]``."""

import argparse
import sys


def info() -> int:
    from tile_kernels_aot import manifest

    m = manifest.load()
    kernel_dir = manifest.MANIFEST_PATH.parent / "kernels"
    tc = m["toolchain"]
    print(f"tile_kernels_aot bundle (schema {m['schema_version']}): archs {', '.join(m['archs'])}")
    print(f"toolchain: tilelang {tc['tilelang']}, nvcc {tc['nvcc']} {' '.join(tc['nvcc_flags'])}, git {tc['git_revision']}")
    total = 0
    for name, kernel in m["kernels"].items():
        sizes = [b["size"] for c in kernel["configs"] for b in c["builds"].values()]
        total += sum(sizes)
        print(f"\n{name}: {len(kernel['configs'])} configs x {len(m['archs'])} archs, {sum(sizes) / 1024:.0f} KiB"
              f"  (static: {', '.join(kernel['static'])})")
        for o in m["ops"]:
            if o["kernel"] == name:
                print(f"  {o['module']}.{o['signature']}")
        for c in kernel["configs"]:
            print(f"    {c['key']}")
    print(f"\ncubins: {total / 1024 / 1024:.1f} MiB in {kernel_dir}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tile_kernels_aot")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="list the ops, configs, archs, sizes and toolchain of this build")
    bench = sub.add_parser("bench", help="time every op at a prefill and a decode shape on the current GPU")
    bench.add_argument("--json", help="write the results as JSON to this file")
    bench.add_argument("--ops", help="comma-separated ops to run (default: all)")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    from tile_kernels_aot import bench as bench_module

    return bench_module.run(args.json, args.ops.split(",") if args.ops else None)


if __name__ == "__main__":
    sys.exit(main())
