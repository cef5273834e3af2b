"""tile_kernels_aot: TileKernels' operators, compiled ahead of time.

``import tile_kernels_aot as tile_kernels`` is a drop-in swap for DeepSeek's
TileKernels: the same module paths (``moe``, ``quant``, ``transpose``, ...)
and signatures, with every kernel shipped as a prebuilt cubin.  Importing the
package loads the extension (no GPU, driver or compiler is touched) to learn
which families this build holds; submodules load on first use, and
``tile_kernels_aot.torch`` (the PyTorch references) works without the
compiled extension.  Every op is also a torch custom op,
``torch.ops.tile_kernels_aot.<name>``, which ``torch.compile`` puts in its graphs.
"""

import importlib

from tile_kernels_aot import families as _families

# The families this build runs from prebuilt kernels, and the PyTorch references.
__all__ = sorted(_families.built() + ["torch"])
if _families.built():
    # every op in torch.ops.tile_kernels_aot, and traced by torch.compile (custom_ops.py)
    from tile_kernels_aot import custom_ops as _custom_ops

    _custom_ops.register()
# Importable too: ``modeling`` (autograd functions; those of families without kernels
# yet run on the references).
_SUBMODULES = set(__all__) | {"modeling"}


def empty_cache():
    """Hand the memory of freed outputs that the ops keep for reuse back to torch.

    Outputs of up to 8 MiB per call come from a few recently freed allocations
    of earlier calls on the same device and stream (at most 8 are kept, 64 MiB
    in all), which saves a trip through torch's caching allocator on every
    decode-sized call.
    This returns them to torch's caching allocator, as before a memory
    measurement; ``torch.cuda.empty_cache()`` then releases them to the driver.
    """
    from tile_kernels_aot import _C

    _C.empty_cache()


def __getattr__(name):
    if name in _SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES)
