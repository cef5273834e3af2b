"""A cubin that does not match the manifest is refused when it would be loaded: the op
raises a RuntimeError naming the cubin instead of launching it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import tile_kernels_aot
from tile_kernels_aot import manifest


def test_a_tampered_cubin_is_refused_at_load(tmp_path):
    package = tmp_path / "tile_kernels_aot"
    shutil.copytree(Path(tile_kernels_aot.__file__).parent, package)
    config = manifest.load()["kernels"]["moe.topk_gate"]["configs"][0]
    # every arch's cubin of the config: the one this GPU loads is among them
    cubins = [package / "kernels" / b["cubin"] for b in config["builds"].values()]
    for cubin in cubins:
        data = bytearray(cubin.read_bytes())
        data[len(data) // 2] ^= 0xFF
        cubin.write_bytes(bytes(data))
    code = (
        "import torch\n"
        "import tile_kernels_aot as tk\n"
        f"assert tk.__file__.startswith({str(package)!r}), tk.__file__\n"
        "try:\n"
        f"    tk.moe.topk_gate(torch.randn(16, {config['config']['max_experts']}, device='cuda'), 2)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    print('launched')\n"
    )
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                            env={**os.environ, "PYTHONPATH": pythonpath})
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    assert message.startswith("moe.topk_gate: "), message
    assert any(str(c) in message for c in cubins), message
    assert "does not match the manifest" in message and "reinstall" in message, message
