"""Shared by every test: the repository root on sys.path (for ``aot`` and
``kernels_tl``), and the GPU tests skipped cleanly where there is no GPU or no
built extension."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "/tests/gpu/" in str(item.fspath).replace("\\", "/")]
    if not gpu_items:
        return
    reason = None
    try:
        import torch

        if not torch.cuda.is_available():
            reason = "no CUDA device"
    except ImportError:
        reason = "torch is not installed"
    if reason is None:
        try:
            import tile_kernels_aot._C  # noqa: F401
        except ImportError as e:
            reason = f"the extension is not built ({e})"
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
