"""Check a built wheel: ``python wheels/verify.py WHEEL...``.

A wheel must hold the extension for its CPython tag, the manifest, and every cubin the
manifest names, each matching its sha256, SASS for its arch and free of PTX; the
extension must link neither libtorch, libcudart nor libcuda (it binds them at run time).
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


def needed_libraries(so_bytes: bytes) -> list:
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(so_bytes)
        f.flush()
        out = subprocess.run(["readelf", "-d", f.name], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def verify(wheel: Path) -> list:
    problems = []
    tag = re.search(r"-(cp\d+)-(cp\d+)-", wheel.name)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        ext = [n for n in names if re.fullmatch(r"tile_kernels_aot/_C\..*\.so", n)]
        if len(ext) != 1:
            return [f"expected one tile_kernels_aot/_C*.so, found {ext}"]
        if tag and f".cpython-{tag.group(1)[2:]}-" not in ext[0]:
            problems.append(f"{ext[0]} does not match the wheel tag {tag.group(1)}")
        for lib in needed_libraries(z.read(ext[0])):
            if lib.startswith(FORBIDDEN_LIBS):
                problems.append(f"_C links {lib}")
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
    print(f"{wheel.name}: {ext[0]}, {count} cubins for {', '.join(manifest['archs'])}: "
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
