"""Release engineering without a GPU: the wheel workflow calls only scripts and commands that
exist, and two builds of the extension wheel from one bundle are identical manylinux wheels
that pass wheels/verify.py."""

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "wheels.yml"


def test_the_workflow_calls_the_repos_scripts():
    text = WORKFLOW.read_text()
    scripts = set(re.findall(r"\b((?:wheels|aot|tests|\.ci)/[\w./-]+\.(?:sh|py|toml))\b", text))
    assert {"wheels/build.sh", "wheels/verify.py", "aot/shapes/default.toml"} <= scripts
    for script in scripts:
        assert (ROOT / script).exists(), f"the workflow names {script}, which does not exist"
    commands = set(re.findall(r"python3? -m (aot|tile_kernels_aot) (\w+)", text))
    assert ("aot", "build") in commands and ("aot", "merge") in commands
    for module, command in commands:
        if module == "tile_kernels_aot":
            pytest.importorskip("tile_kernels_aot._C", reason="the package is not installed")
        result = subprocess.run([sys.executable, "-m", module, command, "--help"], capture_output=True, text=True,
                                cwd=ROOT)
        assert result.returncode == 0, f"python -m {module} {command}: {result.stderr[-500:]}"


def _wheel(bundle: Path, work: Path, epoch: str) -> Path:
    """One clean extension-wheel build from ``bundle``, repaired by auditwheel."""
    env = dict(os.environ, TKA_BUNDLE_DIR=str(bundle), SOURCE_DATE_EPOCH=epoch)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w",
                    str(work / "raw"), f"--config-settings=build-dir={work / 'build'}", str(ROOT)],
                   check=True, env=env, capture_output=True)
    raw = next((work / "raw").glob("*.whl"))
    subprocess.run([shutil.which("auditwheel"), "repair", "-w", str(work / "repaired"), str(raw)], check=True,
                   env=env, capture_output=True)
    return next((work / "repaired").glob("*.whl"))


def test_two_clean_builds_give_identical_verified_manylinux_wheels(tmp_path):
    pytest.importorskip("tilelang")
    pytest.importorskip("scikit_build_core")
    if shutil.which("auditwheel") is None:
        pytest.skip("auditwheel is not installed")
    from aot.build import build
    from aot.targets import ARCH_NAMES

    bundle = tmp_path / "bundle"
    build(bundle, ROOT / "aot" / "shapes" / "ci.toml", list(ARCH_NAMES), 2, log=lambda s: None)
    epoch = "1767225600"
    first, second = _wheel(bundle, tmp_path / "a", epoch), _wheel(bundle, tmp_path / "b", epoch)
    assert re.search(r"-manylinux_\d+_\d+_x86_64\.whl$", first.name), first.name
    assert first.name == second.name
    assert hashlib.sha256(first.read_bytes()).hexdigest() == hashlib.sha256(second.read_bytes()).hexdigest()
    result = subprocess.run([sys.executable, str(ROOT / "wheels" / "verify.py"), str(first)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
