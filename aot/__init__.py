"""Build pipeline: shape table -> lowered kernels -> cubins -> manifest -> C++ stubs.

Every stage is a plain function over plain data and can run (and be tested)
alone; lowering and compiling are cached by content hash.
"""
