"""The ops of the installed build and their samples, as the GPU tests parametrize over them,
and the ops' calls as the tests compare them: an in-place op (no outputs, a mutable tensor
parameter, returning None) is called on clones of its mutable tensors, which it returns, so
that its effect is compared like an output and the caller's tensors stay as drawn."""

import pytest
import torch

from tile_kernels_aot import samples

try:
    from tile_kernels_aot import manifest
    OPS = manifest.ops()
except (ImportError, FileNotFoundError):
    OPS = []


def qualname(record) -> str:
    return f"{record['module']}.{record['name']}"


def op_samples():
    """pytest params (record, sample) for every sample of every op."""
    return [pytest.param(r, s, id=f"{qualname(r)}[{s['name']}]") for r in OPS for s in r["samples"]]


def mutable_names(record) -> list:
    return [p["name"] for p in record["params"]
            if p["type"]["kind"] in ("tensor", "tensor_list") and p["type"].get("mutable")]


def clone_arg(v):
    """A tensor's clone, a tensor list's clones (a new list), anything else as it is."""
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
        return [t.clone() for t in v]
    return v


def in_place(record) -> bool:
    """An op whose only effect is on its mutable tensor parameters."""
    return not record["returns"] and bool(mutable_names(record))


def _on_clones(record, fn):
    names = [p["name"] for p in record["params"]]
    mutable = set(mutable_names(record))

    def call(*args, **kwargs):
        args = [clone_arg(a) if i < len(names) and names[i] in mutable else a for i, a in enumerate(args)]
        kwargs = {k: clone_arg(v) if k in mutable else v for k, v in kwargs.items()}
        fn(*args, **kwargs)
        updated = [a for i, a in enumerate(args) if i < len(names) and names[i] in mutable]
        updated += [v for k, v in kwargs.items() if k in mutable]
        return updated[0] if len(updated) == 1 else tuple(updated)

    return call


def function(record):
    """The public function; for an in-place op, one that returns its updated clones."""
    fn = samples.function(record)
    return _on_clones(record, fn) if in_place(record) else fn


def kernel_function(record):
    """The generated C function (the kernel op the torch custom op mirrors): the public function,
    or the one its Python wrapper calls; for an in-place op, one that returns its updated clones."""
    fn = samples.kernel_function(record)
    return _on_clones(record, fn) if in_place(record) else fn


def reference(record):
    ref = samples.reference(record)
    return _on_clones(record, ref) if in_place(record) else ref


def outputs_by_name(record, result) -> dict:
    """``{name: tensor}`` of what :func:`function` or :func:`reference` returned (an in-place
    op's updated tensors by parameter name).  Optional outputs the call left out (None)
    are not listed, so both sides of a comparison must leave out the same ones."""
    if not in_place(record):
        return {k: v for k, v in samples.outputs_by_name(record, result).items() if v is not None}
    returned = result if isinstance(result, tuple) else (result,)
    updated = {}
    for name, v in zip(mutable_names(record), returned):  # a tensor list's tensors as name[k]
        updated.update({f"{name}[{k}]": t for k, t in enumerate(v)} if isinstance(v, list) else {name: v})
    return updated
