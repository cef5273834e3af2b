"""Plain-PyTorch reference implementations of every operator.

They are the specification the kernels are tested against: written from the
operators' documented semantics, vectorized, and runnable on CPU or CUDA.
One module per family; each function keeps TileKernels' public signature.
"""
