"""GPU tests: kernels against the PyTorch references, and the launch contract.

TileLang (and TVM) are unimportable while each GPU test runs: the installed
package must need no JIT.  The GPU recipe also runs this suite with
``CUDA_DISABLE_PTX_JIT=1``, so a kernel that would need the driver to compile
PTX fails to load (and test_contract checks both in a fresh process).
"""

import importlib.abc
import sys

import pytest

BLOCKED = ("tilelang", "tvm", "tvm_ffi")


class _NoJit(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in the GPU tests: the runtime must not JIT")
        return None


@pytest.fixture(autouse=True)
def no_jit():
    finder = _NoJit()
    sys.meta_path.insert(0, finder)
    yield
    sys.meta_path.remove(finder)


@pytest.fixture
def gen():
    import torch

    return torch.Generator(device="cuda").manual_seed(torch.initial_seed() % 2**31)
