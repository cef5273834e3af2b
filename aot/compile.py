"""Stage 2: compile a lowered kernel's CUDA source to a SASS-only cubin.

nvcc is run with ``-cubin`` and an explicit ``-gencode arch=compute_XXa,code=sm_XXa``,
so the output is machine code for exactly one arch and carries no PTX.
Results are cached under ``cache_dir`` by a hash of the source, the flags,
the nvcc version and TileLang's headers' version.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# -lineinfo/-G are left out on purpose: no source paths end up in the cubin, so
# two builds of the same source are byte-identical.
NVCC_FLAGS = ("-std=c++20", "-O3", "-w", "-Xcudafe", "--diag_suppress=177")
PINNED_NVCC = "13.0.88"


@functools.lru_cache(None)
def nvcc_path() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and Path(cuda_home, "bin", "nvcc").exists():
        return str(Path(cuda_home, "bin", "nvcc"))
    found = shutil.which("nvcc")
    if found:
        return found
    try:  # PyPI's nvidia-cuda-nvcc
        import nvidia.cuda_nvcc as pkg  # type: ignore

        candidate = Path(pkg.__path__[0], "bin", "nvcc")
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise RuntimeError("nvcc not found: set CUDA_HOME or put nvcc on PATH (pinned version %s)" % PINNED_NVCC)


@functools.lru_cache(None)
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if "release" in line and ", V" in line:
            return line.rsplit(", V", 1)[1].strip()
    raise RuntimeError(f"cannot parse nvcc --version output:\n{out}")


@functools.lru_cache(None)
def include_dirs() -> tuple:
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    return (os.path.realpath(TILELANG_TEMPLATE_PATH), os.path.realpath(CUTLASS_INCLUDE_DIR))


def arch_flags(arch: str) -> list:
    number = arch.removeprefix("sm_")  # '90a'
    return ["-gencode", f"arch=compute_{number},code=sm_{number}"]


def cubin_key(source: str, arch: str) -> str:
    import tilelang

    h = hashlib.sha256()
    for part in (source, arch, " ".join(NVCC_FLAGS), nvcc_version(), tilelang.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_cubin(source: str, arch: str, cache_dir: Path) -> Path:
    """Return the path of the cached cubin for ``source`` on ``arch``, compiling it if needed."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = cache_dir / f"{cubin_key(source, arch)}.cubin"
    if cached.exists():
        return cached
    with tempfile.TemporaryDirectory(prefix="tka-nvcc-") as tmp:
        src = Path(tmp, "kernel.cu")
        src.write_text(source)
        out = Path(tmp, "kernel.cubin")
        cmd = [nvcc_path(), "-cubin", *arch_flags(arch), *NVCC_FLAGS]
        cmd += [f"-I{d}" for d in include_dirs()]
        cmd += ["-o", str(out), str(src)]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{result.stderr[-4000:]}")
        tmp_cached = cached.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(out, tmp_cached)
        os.replace(tmp_cached, cached)  # atomic: parallel builds may race on one key
    return cached
