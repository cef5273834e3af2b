"""The installed cubins against the manifest: ``info --verify`` on the installed package and
on a damaged copy of it, and the runtime's own SHA-256 (which checks each cubin before it is
loaded) against hashlib's."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_C = pytest.importorskip("tile_kernels_aot._C", reason="the extension is not installed")

import tile_kernels_aot  # noqa: E402
from tile_kernels_aot import manifest  # noqa: E402


def _verify(pythonpath=None):
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "tile_kernels_aot", "info", "--verify"], capture_output=True,
                          text=True, cwd="/", env=env)


def test_verify_passes_on_the_installed_package():
    result = _verify()
    assert result.returncode == 0, result.stdout + result.stderr
    total = sum(len(c["builds"]) for k in manifest.load()["kernels"].values() for c in k["configs"])
    assert f"verified {total} of {total} cubins" in result.stdout


def test_verify_names_a_tampered_and_a_missing_cubin(tmp_path):
    package = tmp_path / "tile_kernels_aot"
    shutil.copytree(Path(tile_kernels_aot.__file__).parent, package)
    builds = [b for k in manifest.load()["kernels"].values() for c in k["configs"] for b in c["builds"].values()]
    tampered, deleted = package / "kernels" / builds[0]["cubin"], package / "kernels" / builds[1]["cubin"]
    data = bytearray(tampered.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tampered.write_bytes(bytes(data))
    deleted.unlink()

    result = _verify(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert str(package) in result.stdout, "the copy, not the installed package, was verified"
    assert f"verified {len(builds) - 2} of {len(builds)} cubins" in result.stdout
    assert f"{tampered}: sha256 differs from the manifest" in result.stdout
    assert f"{deleted}: missing" in result.stdout


@pytest.mark.parametrize("size", [0, 3, 55, 56, 63, 64, 65, 119, 120, 128, 1 << 20])
def test_runtime_sha256_matches_hashlib(size):
    data = bytes((i * 131 + size) % 256 for i in range(size))
    assert _C._sha256_hex(data) == hashlib.sha256(data).hexdigest()


def test_test_files_have_unique_basenames():
    """The test folders are not packages: pytest imports each file by its basename, so a name
    used twice stops the collection of `python -m pytest tests`."""
    names = [p.name for p in (Path(__file__).resolve().parents[1]).glob("*/test_*.py")]
    assert sorted(set(names)) == sorted(names), sorted(n for n in set(names) if names.count(n) > 1)
