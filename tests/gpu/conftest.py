"""GPU tests: kernels against the PyTorch references, and the launch contract.

TileLang (and TVM) are unimportable while each GPU test runs: the installed
package must need no JIT.  The GPU recipe also runs this suite with
``CUDA_DISABLE_PTX_JIT=1``, so a kernel that would need the driver to compile
PTX fails to load (and test_contract checks both in a fresh process).
"""

import sys

import pytest

BLOCKED = ("tilelang", "tvm", "tvm_ffi")


@pytest.fixture(autouse=True)
def no_jit():
    """A None entry in sys.modules makes ``import tilelang`` (and tvm's) raise ImportError,
    while probes such as ``importlib.util.find_spec`` (torch._dynamo makes them) see no module."""
    saved = {name: sys.modules.get(name) for name in BLOCKED if name in sys.modules}
    for name in BLOCKED:
        sys.modules[name] = None
    yield
    for name in BLOCKED:
        if name in saved:
            sys.modules[name] = saved[name]
        else:
            sys.modules.pop(name, None)


@pytest.fixture
def gen():
    import torch

    return torch.Generator(device="cuda").manual_seed(torch.initial_seed() % 2**31)
