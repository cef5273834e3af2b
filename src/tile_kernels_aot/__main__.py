"""``python -m tile_kernels_aot info [--verify]`` | ``bench [--json FILE]``."""

import argparse
import hashlib
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


def verify() -> int:
    """Re-hashes every installed cubin against the manifest: 0 when all match, 1 otherwise."""
    from tile_kernels_aot import manifest

    kernel_dir = manifest.MANIFEST_PATH.parent / "kernels"
    kernels = manifest.load()["kernels"].values()
    builds = [b for kernel in kernels for c in kernel["configs"] for b in c["builds"].values()]
    problems = []
    for build in builds:
        path = kernel_dir / build["cubin"]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        except OSError as e:
            problems.append(f"{path}: cannot be read ({e.strerror})")
            continue
        if len(data) != build["size"]:
            problems.append(f"{path}: wrong size ({len(data)} bytes, the manifest says {build['size']})")
        elif hashlib.sha256(data).hexdigest() != build["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest")
    print(f"verified {len(builds) - len(problems)} of {len(builds)} cubins in {kernel_dir} against the manifest"
          f" (sha256 and size): {len(problems) or 'no'} problem{'' if len(problems) == 1 else 's'}")
    for problem in problems:
        print(problem)
    if problems:
        print("the installed package is damaged: reinstall it")
    return 1 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tile_kernels_aot")
    sub = parser.add_subparsers(dest="command", required=True)
    info_parser = sub.add_parser("info", help="list the ops, configs, archs, sizes and toolchain of this build")
    info_parser.add_argument("--verify", action="store_true",
                             help="instead, check every installed cubin's size and sha256 against the manifest "
                                  "(exit status 1 on any mismatch)")
    bench = sub.add_parser("bench", help="time every op at a prefill and a decode shape on the current GPU")
    bench.add_argument("--json", help="write the results as JSON to this file")
    bench.add_argument("--ops", help="comma-separated ops to run (default: all)")
    bench.add_argument("--samples", help="comma-separated sample-name prefixes to run, e.g. decode,upstream "
                                         "(default: every sample)")
    bench.add_argument("--block", action="store_true",
                       help="instead, time the MoE block of tile_kernels_aot.serving_block per call: eager, "
                            "torch.compile (default and reduce-overhead), the references compiled, TileKernels")
    bench.add_argument("--layer", action="store_true",
                       help="instead, time the routed MoE layer of tile_kernels_aot.moe_layer, one CUDA graph "
                            "per layer, beside TileKernels' ops")
    bench.add_argument("--modeling", action="store_true",
                       help="instead, time the modeling paths of tile_kernels_aot.modeling_paths (the Engram "
                            "gate's training step, one layer's mHC path) beside TileKernels' modeling functions")
    args = parser.parse_args(argv)
    if args.command == "info":
        return verify() if args.verify else info()
    if args.block or args.layer or args.modeling:
        import importlib
        import json

        from tile_kernels_aot.bench import variant_table

        name = "serving_block" if args.block else "moe_layer" if args.layer else "modeling_paths"
        module = importlib.import_module(f"tile_kernels_aot.{name}")
        rows = module.bench()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        subject = {"serving_block": "block variant", "moe_layer": "MoE layer variant", "modeling_paths": "path"}[name]
        print(variant_table(rows, subject, "us per call" if args.block else "us per layer" if args.layer else "us"))
        return 0
    from tile_kernels_aot import bench as bench_module

    return bench_module.run(args.json, args.ops.split(",") if args.ops else None,
                            args.samples.split(",") if args.samples else None)


if __name__ == "__main__":
    sys.exit(main())
