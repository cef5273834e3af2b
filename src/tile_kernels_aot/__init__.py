"""tile_kernels_aot: TileKernels' operators, compiled ahead of time.

``import tile_kernels_aot as tile_kernels`` is a drop-in swap for DeepSeek's
TileKernels: the same module paths (``moe``, ``quant``, ``transpose``, ...)
and signatures, with every kernel shipped as a prebuilt cubin.  Submodules
load on first use, so importing the package costs almost nothing and
``tile_kernels_aot.torch`` (the PyTorch references) works without the
compiled extension.
"""

import importlib

__all__ = ["engram", "mhc", "modeling", "moe", "quant", "torch", "transpose"]


def empty_cache():
    """Hand the memory of freed outputs that the ops keep for reuse back to torch.

    Outputs of up to 2 MiB per call come from a few recently freed allocations
    of earlier calls on the same device and stream (at most 8 are kept), which
    saves a trip through torch's caching allocator on every decode-sized call.
    This returns them to torch's caching allocator, as before a memory
    measurement; ``torch.cuda.empty_cache()`` then releases them to the driver.
    """
    from tile_kernels_aot import _C

    _C.empty_cache()


def __getattr__(name):
    if name in __all__:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
