"""Check a built wheel: ``python wheels/verify.py WHEEL...``.

A wheel must carry a ``manylinux_X_Y_x86_64`` platform tag (``auditwheel repair`` gives it)
and hold the extension for its CPython tag, the manifest, and every cubin the manifest names,
each matching its sha256, SASS for its arch and free of PTX.  The extension must link
neither libtorch, libcudart nor libcuda (it binds them at run time), nothing but the C and C++
runtimes, and no symbol version newer than its tag's glibc allows; the wheel stays under 50 MB.
Exits non-zero with the problems listed.
"""

import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aot.cubin import cubin_arch, has_ptx  # noqa: E402

FORBIDDEN_LIBS = ("libtorch", "libc10", "libcudart", "libcuda.so")
MAX_WHEEL_BYTES = 50 * 1024 * 1024  # the default table's wheel stays under 50 MB
# what a manylinux wheel may link without vendoring it
SYSTEM_LIBS = ("libc.so.6", "ld-linux-x86-64.so.2", "libm.so.6", "libdl.so.2", "libpthread.so.0", "libstdc++.so.6", "libgcc_s.so.1")


def readelf(so_bytes: bytes, *flags) -> str:
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(so_bytes)
        f.flush()
        return subprocess.run(["readelf", *flags, f.name], capture_output=True, text=True, check=True).stdout


def needed_libraries(so_bytes: bytes) -> list:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf(so_bytes, "-d"))


def newest_glibc(so_bytes: bytes) -> tuple:
    """The newest ``GLIBC_X.Y`` symbol version the library needs, as (X, Y)."""
    versions = re.findall(r"Name: GLIBC_(\d+)\.(\d+)", readelf(so_bytes, "-V"))
    return max(((int(a), int(b)) for a, b in versions), default=(0, 0))


def verify(wheel: Path) -> list:
    problems = []
    tag = re.search(r"-(cp\d+)-(cp\d+)-", wheel.name)
    platform = re.search(r"-manylinux_(\d+)_(\d+)_x86_64\.whl$", wheel.name)
    if platform is None:
        problems.append("the platform tag is not manylinux_X_Y_x86_64 (run auditwheel repair)")
    if wheel.stat().st_size > MAX_WHEEL_BYTES:
        problems.append(f"{wheel.stat().st_size / 2**20:.1f} MB, over the {MAX_WHEEL_BYTES >> 20} MB budget")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        ext = [n for n in names if re.fullmatch(r"tile_kernels_aot/_C\..*\.so", n)]
        if len(ext) != 1:
            return [f"expected one tile_kernels_aot/_C*.so, found {ext}"]
        if tag and f".cpython-{tag.group(1)[2:]}-" not in ext[0]:
            problems.append(f"{ext[0]} does not match the wheel tag {tag.group(1)}")
        so = z.read(ext[0])
        for lib in needed_libraries(so):
            if lib.startswith(FORBIDDEN_LIBS) or lib not in SYSTEM_LIBS:
                problems.append(f"_C links {lib}")
        glibc = newest_glibc(so)
        if platform and glibc > (int(platform.group(1)), int(platform.group(2))):
            problems.append(f"_C needs GLIBC_{glibc[0]}.{glibc[1]}, newer than its tag allows")
        manifest = json.loads(z.read("tile_kernels_aot/manifest.json"))
        count = 0
        for kernel, entry in manifest["kernels"].items():
            for config in entry["configs"]:
                if set(config["builds"]) != set(manifest["archs"]):
                    problems.append(f"{kernel} {config['key']}: archs {sorted(config['builds'])}")
                for arch, build in config["builds"].items():
                    path = f"tile_kernels_aot/kernels/{build['cubin']}"
                    if path not in names:
                        problems.append(f"missing {path}")
                        continue
                    data = z.read(path)
                    count += 1
                    if hashlib.sha256(data).hexdigest() != build["sha256"]:
                        problems.append(f"{path}: sha256 differs from the manifest")
                    if cubin_arch(data) != arch or has_ptx(data):
                        problems.append(f"{path}: not PTX-free SASS for {arch}")
    print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MB, {ext[0]}, {count} cubins for {', '.join(manifest['archs'])}: "
          f"{'OK' if not problems else str(len(problems)) + ' problems'}")
    return problems


def main(paths) -> int:
    problems = []
    for p in paths:
        problems += [f"{Path(p).name}: {x}" for x in verify(Path(p))]
    for p in problems:
        print("  " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
