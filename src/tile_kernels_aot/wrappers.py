"""Public functions that are thin Python wrappers over a kernel op (an op schema's ``wrapper``).

A wrapper keeps its kernel op's signature (``__signature__``), hands every argument to the
generated C function unchanged (which parses and checks them and raises the op's own errors),
and adds what a single launch cannot give: the host sync that learns a data-dependent size,
or a signature CPython cannot read from a C function's docstring (a ``torch.dtype`` default).
"""

from __future__ import annotations

import functools
import inspect
import operator

from tile_kernels_aot import _C


def _wraps(kernel_op):
    """Gives the wrapper the kernel op's name, documentation and signature."""

    def decorate(fn):
        fn = functools.wraps(kernel_op)(fn)
        fn.__signature__ = inspect.signature(kernel_op)
        del fn.__wrapped__
        return fn

    return decorate


_ROW_OUTPUTS = ("pos_to_expert", "pos_to_token", "pos_to_token_topk")


@_wraps(_C.moe.get_fused_mapping)
def get_fused_mapping(*args, **kwargs):
    """The kernel op ``moe.get_fused_mapping`` returns seven tensors and never synchronizes:
    with ``num_expanded_tokens == 0`` and ``force_no_sync`` False its row outputs have the most
    rows the layout can need.  This wrapper then copies the aligned counts to the host once,
    returns them as a list and the row outputs trimmed to their sum, as TileKernels does.
    Row outputs given as ``out=`` in that mode fix the row count instead (their length, which
    must be at least the sum; checked after the sync) and are returned whole."""
    rows = args[2] if len(args) > 2 else kwargs.get("num_expanded_tokens")
    force_no_sync = args[4] if len(args) > 4 else kwargs.get("force_no_sync", False)
    if rows.__class__ is int and (rows != 0 or force_no_sync):
        # no sync, the serving path: the least Python (a tuple concatenation, not an unpacking)
        return _C.moe.get_fused_mapping(*args, **kwargs) + ([],)
    try:
        rows = None if isinstance(rows, bool) else operator.index(rows)
    except TypeError:
        rows = None  # the C function refuses it
    if rows != 0 or force_no_sync:
        return _C.moe.get_fused_mapping(*args, **kwargs) + ([],)
    given = next((kwargs[n] for n in _ROW_OUTPUTS if kwargs.get(n) is not None), None)
    if given is not None and len(getattr(given, "shape", ())) == 1:
        # the caller's buffers fix the row count: a no-sync launch over them, then the counts
        args, kwargs = list(args), dict(kwargs)
        for index, name, value in ((2, "num_expanded_tokens", int(given.shape[0])), (4, "force_no_sync", True)):
            if len(args) > index:
                args[index] = value
            else:
                kwargs[name] = value
    else:
        given = None
    result = _C.moe.get_fused_mapping(*args, **kwargs)
    counts = result[6].tolist()
    total = sum(counts)
    if given is not None:
        if total > given.shape[0]:
            raise ValueError(f"moe.get_fused_mapping: pos_to_expert (the given row outputs) has {given.shape[0]} rows, "
                             f"fewer than the fused layout needs ({total}); the pairs past its end were not placed")
        return (*result, counts)
    return (result[0][:total], result[1][:total], result[2][:total], *result[3:], counts)


def _signature_of(qualname: str) -> inspect.Signature:
    """The public signature of a kernel op from its record: its parameters with their defaults
    (a dtype parameter's as the torch.dtype), then its outputs (positional ones, then
    keyword-only), default None."""
    from tile_kernels_aot import manifest
    from tile_kernels_aot.custom_ops import _default_value

    record = manifest.op(qualname)
    kind, empty = inspect.Parameter, inspect.Parameter.empty
    params = [kind(p["name"], kind.POSITIONAL_OR_KEYWORD,
                   default=empty if p["default"] == "<required>" else _default_value(p)) for p in record["params"]]
    params += [kind(o["name"], kind.POSITIONAL_OR_KEYWORD if o.get("positional") else kind.KEYWORD_ONLY, default=None)
               for o in sorted(record["outs"], key=lambda o: not o.get("positional"))]
    return inspect.Signature(params)


def _with_signature(module: str, name: str):
    """The public function of kernel op ``<module>.<name>`` whose default is a torch.dtype: the C
    function itself inside a ``functools.partial`` that binds nothing (a C-level call, no Python
    frame on the hot path), carrying the name, documentation and signature (None when this
    build lacks the op)."""
    kernel_op = getattr(getattr(_C, module, None), name, None)
    if kernel_op is None:
        return None
    call = functools.partial(kernel_op)
    call.__name__ = call.__qualname__ = name
    call.__module__ = f"tile_kernels_aot.{module}"
    call.__doc__ = kernel_op.__doc__
    call.__signature__ = _signature_of(f"{module}.{name}")
    return call


unpack_from_e2m1fn_x2 = _with_signature("quant", "unpack_from_e2m1fn_x2")
