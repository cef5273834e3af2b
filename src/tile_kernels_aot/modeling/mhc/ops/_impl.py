"""Where the mHC ops' forward and backward computations come from.

Each name of :mod:`tile_kernels_aot.torch.mhc` that the autograd Functions call resolves to
the prebuilt kernel of ``tile_kernels_aot.mhc`` when this build has one of that name, and to
the PyTorch reference otherwise; :func:`sources` says which, per name.

A kernel takes per-token tensors with the leading dims flattened into one token dim
(``[N, H]``, ``[N, M, H]``, ``[N, M, 1]``), on a CUDA device, in its dtypes (bf16 streams,
float32 mixes).  The call here flattens the caller's leading dims (``(n0, n1, ...)``) on the
way in and restores them on the results, and runs the reference instead for a call the
kernels do not take: tensors off the GPU or of other dtypes (float64 for ``gradcheck``), a
non-contiguous ``out``, or a static configuration (``mhc_mult``) this build lacks.
"""

from __future__ import annotations

import functools
import re
import types

import torch

from tile_kernels_aot.torch import mhc as _reference


def _kernels():
    try:
        from tile_kernels_aot import mhc
    except ImportError:  # no mHC kernels in this build
        return None
    return mhc


class _Unsupported(Exception):
    """A call the kernel does not take: run the reference."""


def _flat(t: torch.Tensor, lead: tuple, rest: int, dtypes, is_out: bool = False) -> torch.Tensor:
    if not t.is_cuda or str(t.dtype).rsplit(".", 1)[-1] not in dtypes or t.dim() < rest:
        raise _Unsupported
    if tuple(t.shape[:t.dim() - rest]) != lead or (is_out and not t.is_contiguous()):
        raise _Unsupported  # the kernel's own checks (or the reference's) name the mismatch
    return t.reshape(-1, *t.shape[t.dim() - rest:]) if not is_out else t.view(-1, *t.shape[t.dim() - rest:])


def _token_params(record: dict) -> set:
    """The tensor parameters with a leading token dim (in the op's samples, a shape that starts
    with ``T``); the others (mix scales, biases, projections) are passed as they are."""
    names = [p["name"] for p in record["params"]]
    found = set()
    for sample in record["samples"]:
        given = {**dict(zip(names, sample["args"])), **sample["kwargs"]}
        found |= {name for name, spec in given.items()
                  if isinstance(spec, dict) and (spec.get("shape") or [None])[0] == "T"}
    return found


def _token_outputs(record: dict, token_params: set) -> set:
    """The outputs with the leading token dim: shaped ``list(<p>.shape)`` or ``[<p>.shape[0], ...]``
    for a per-token parameter ``p``; the others (gradients of projections, scales, biases) are
    returned as the kernel gives them."""
    found = set()
    for o in record["outs"]:
        m = re.match(r"\s*(?:list\((\w+)\.shape\)|\[(\w+)\.shape\[0\])", o["shape"] or "")
        if m and (m.group(1) or m.group(2)) in token_params:
            found.add(o["name"])
    return found


def _as_is(t: torch.Tensor, dtypes) -> torch.Tensor:
    """A parameter without the token dim: the kernel takes it on the GPU, in its dtypes."""
    if not t.is_cuda or str(t.dtype).rsplit(".", 1)[-1] not in dtypes:
        raise _Unsupported
    return t


def _attach_residual_grad(bound: dict, result) -> None:
    """``mhc_post_bwd(..., fuse_grad_acc=True)``: hang ``d_residual`` on the residual's storage,
    as the reference (and upstream) do."""
    if bound.get("fuse_grad_acc", True):
        bound["residual"].untyped_storage().grad_from_mhc_post = result[1]


_AFTER = {"mhc_post_bwd": _attach_residual_grad}


def _takes(t, spec: dict) -> bool:
    """Whether the kernel takes tensor ``t`` for a parameter of ``spec`` as it is: on the GPU,
    in its dtypes, contiguous."""
    return (isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous()
            and str(t.dtype).rsplit(".", 1)[-1] in spec["dtypes"])


def _list_call(record: dict, kernel, reference):
    """An op with tensor lists (``mhc_multilayer_recompute``): its kernel takes the caller's
    leading dims itself, so the call goes to it as it is, or to ``reference`` for tensors it
    does not take (off the GPU, other dtypes, not contiguous) or a configuration this build
    lacks."""
    names = [p["name"] for p in record["params"]]
    specs = {p["name"]: p["type"] for p in record["params"] if p["type"]["kind"] in ("tensor", "tensor_list")}

    def call(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        for pname, spec in specs.items():
            v = bound.get(pname)
            items = v if spec["kind"] == "tensor_list" and isinstance(v, (list, tuple)) else [v]
            if not all(_takes(t, spec) for t in items):
                return reference(*args, **kwargs)
        try:
            return kernel(*args, **kwargs)
        except ValueError as e:
            if "no prebuilt kernel" in str(e):
                return reference(*args, **kwargs)
            raise

    functools.update_wrapper(call, reference)
    return call


def _kernel_call(name: str, kernel, reference):
    """``kernel`` with the caller's leading dims, or ``reference`` for a call it does not take."""
    from tile_kernels_aot import manifest

    record = manifest.op(f"mhc.{name}")
    if any(p["type"]["kind"] == "tensor_list" for p in record["params"]):
        return _list_call(record, kernel, reference)
    names = [p["name"] for p in record["params"]] + [o["name"] for o in record["outs"] if o.get("positional")]
    tensors = {p["name"]: p["type"] for p in record["params"] if p["type"]["kind"] == "tensor"}
    per_token = _token_params(record)
    outs = {o["name"] for o in record["outs"]}
    first = next(iter(tensors))
    token_outs = _token_outputs(record, per_token | {first})
    first_rest = tensors[first]["ndim"] - 1
    after = _AFTER.get(name)

    def call(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        try:
            head = bound.get(first)
            if not isinstance(head, torch.Tensor) or head.dim() < first_rest:
                raise _Unsupported
            lead = tuple(head.shape[:head.dim() - first_rest])
            flat = dict(bound)
            for pname, spec in tensors.items():
                if bound.get(pname) is None:
                    continue
                if pname in per_token or pname == first:
                    flat[pname] = _flat(bound[pname], lead, spec["ndim"] - 1, spec["dtypes"])
                else:
                    flat[pname] = _as_is(bound[pname], spec["dtypes"])
            given = {}
            for oname in outs:
                if bound.get(oname) is not None:
                    t = bound[oname]
                    given[id(t)] = t
                    flat[oname] = _flat(t, lead, t.dim() - len(lead), [str(t.dtype).rsplit(".", 1)[-1]], True)
            try:
                result = kernel(**flat)
            except ValueError as e:
                if "no prebuilt kernel" in str(e):
                    raise _Unsupported from e
                raise
        except _Unsupported:
            return reference(*args, **kwargs)

        originals = {id(flat[o]): bound[o] for o in outs if bound.get(o) is not None}

        def restore(r, name):
            if id(r) in originals:
                return originals[id(r)]
            if isinstance(r, torch.Tensor) and name in token_outs:
                return r.view(*lead, *r.shape[1:])
            return r

        if isinstance(result, tuple):
            result = tuple(restore(r, n) for r, n in zip(result, record["returns"]))
        else:
            result = restore(result, record["returns"][0] if record["returns"] else None)
        if after is not None:
            after(bound, result)
        return result

    functools.update_wrapper(call, reference)  # the reference's name, doc and signature
    return call


def _kernel_steps(reference) -> list:
    """The built kernels' names among the reference functions ``reference`` calls: a reference
    that composes others (``mhc_pre_big_fuse``: norm-fn, split, Sinkhorn, apply;
    ``mhc_multilayer_recompute`` in a build without its fused kernel: apply and post per
    layer) can run them as kernels."""
    kernels = _kernels()
    if kernels is None:
        return []
    return [n for n in reference.__code__.co_names
            if n in _reference.__all__ and n != reference.__name__ and hasattr(kernels, n)]


def _over_kernels(reference, steps: list):
    """``reference`` with the steps it calls resolved through :data:`impl` (kernel, or reference
    for a call the kernel does not take): the same code, hence the same values, one launch per
    step instead of one fused kernel."""
    scope = dict(reference.__globals__)
    scope.update({n: getattr(impl, n) for n in steps})
    fn = types.FunctionType(reference.__code__, scope, reference.__name__, reference.__defaults__,
                            reference.__closure__)
    fn.__kwdefaults__ = reference.__kwdefaults__
    return functools.update_wrapper(fn, reference)


class _Impl:
    """Attribute access to the kernel of a name when built, else its reference (whose steps run
    as kernels where it composes built ones)."""

    def __getattr__(self, name):
        kernels = _kernels()
        reference = getattr(_reference, name)
        kernel = getattr(kernels, name, None) if kernels is not None else None
        if kernel is not None:
            fn = _kernel_call(name, kernel, reference)
        else:
            steps = _kernel_steps(reference)
            fn = _over_kernels(reference, steps) if steps else reference
        setattr(self, name, fn)
        return fn


impl = _Impl()


def sources() -> dict:
    """``{name: 'kernel' | 'kernel steps' | 'reference'}`` for every computation the mHC ops use
    ('kernel steps': the reference's composition, its steps on their kernels)."""
    kernels = _kernels()

    def source(name):
        if kernels is not None and hasattr(kernels, name):
            return "kernel"
        return "kernel steps" if _kernel_steps(getattr(_reference, name)) else "reference"

    return {name: source(name) for name in _reference.__all__}


def written(ctx, result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Return ``result`` or, when an ``out`` buffer was filled, mark it dirty."""
    if out is not None:
        ctx.mark_dirty(out)
    return result
