"""Every public op as a torch custom op, ``torch.ops.tile_kernels_aot.<name>``, generated from
the op records of the manifest (the op folders' schemas), so an op added to a folder is
registered with no line here.

Per public function ``<module>.<name>`` two ops are defined:

* ``<name>``: functional; allocates its outputs (schema: the declared parameters, with
  ``Tensor(a!)`` for tensors the op updates in place; a ``(data, sf)`` parameter ``x`` is
  split into ``Tensor x, Tensor? x_sf``);
* ``<name>_out``: the ``out=`` form; every output is a ``Tensor(a!)`` argument and it
  returns nothing (an op without outputs, updating a tensor in place, has none).

Each has a CUDA kernel (the public C function: the same launch path as eager calls) and a
Meta kernel that builds the outputs from the schema's declarations (``Out.dtype``,
``Out.shape``, ``Out.strides``, ``Op.dims``), so fake tensors get the shapes, dtypes and
strides the kernels produce, with the token dim symbolic.

The public name stays the C function, so eager calls cost what they cost without torch in
the way.  Two bridges lead from it to the custom ops:

* under ``torch.compile``, a dynamo rule (``torch.compiler.substitute_in_graph``) traces the
  call as :func:`torch_call` of the op, which puts the custom op in the graph.  The rule is
  installed when ``torch._dynamo`` is imported (importing it costs seconds, which an eager
  server should not pay);
* a call whose tensors are tensor subclasses (fake or functional tensors while
  ``torch.export`` or another tracer runs, or a user's subclass) is handed by the C
  function to :func:`torch_call` too.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

import torch

from tile_kernels_aot import manifest

NAMESPACE = "tile_kernels_aot"

_LIBRARY = None  # the torch.library.Library holding the definitions
_CALLS = {}  # '<module>.<name>' -> its torch_call function
_BINDINGS = {}  # '<module>.<name>' -> its binding()


# ---- expressions of the schema's output declarations ------------------------------------

def ceil_div(a, b):
    # sizes are never negative: a floor division of positive terms, which symbolic sizes
    # (SymInt) simplify exactly, also nested (align_up of a ceil_div)
    return (a + b - 1) // b


def align_up(a, b):
    return ceil_div(a, b) * b


def num_sms(tensor):
    """Streaming multiprocessors of a CUDA tensor's device (ops with one block per SM);
    132 (an H200's) for other devices, as the references use."""
    if tensor.device.type == "cuda":
        return torch.cuda.get_device_properties(tensor.device).multi_processor_count
    return 132


_HELPERS = {"__builtins__": {"list": list, "len": len, "int": int}, "ceil_div": ceil_div,
            "align_up": align_up, "sym_max": torch.sym_max, "num_sms": num_sms}


class OutputDeclarations:
    """The ``dims`` and ``outs`` declarations of one op record, compiled on first use (the
    package's import registers every op and should not pay for it)."""

    def __init__(self, record: dict):
        self.record = record
        self.dims = self.outs = None

    def _compile(self) -> None:
        record = self.record
        qual = f"{record['module']}.{record['name']}"
        self.dims = [(name, compile(expr, f"<{qual} dim {name}>", "eval")) for name, expr in record["dims"]]
        self.outs = [(o["name"], compile(o["dtype"], f"<{qual} {o['name']}.dtype>", "eval"),
                      compile(o["shape"], f"<{qual} {o['name']}.shape>", "eval"),
                      compile(o["strides"] or "None", f"<{qual} {o['name']}.strides>", "eval"))
                     for o in record["outs"]]

    def evaluate(self, values: dict) -> list:
        """``[(name, dtype, shape, strides or None)]`` of the outputs for the parameters
        ``values`` (tensors may be fake, with symbolic sizes); an optional output whose
        shape declaration gives None is absent (shape None)."""
        if self.outs is None:
            self._compile()
        scope = dict(values)
        for name, code in self.dims:
            scope[name] = eval(code, _HELPERS, scope)
        result = []
        for name, dtype, shape, strides in self.outs:
            dt = eval(dtype, _HELPERS, scope)
            extents = eval(shape, _HELPERS, scope)
            result.append((name, dt if isinstance(dt, torch.dtype) else getattr(torch, dt),
                           None if extents is None else list(extents), eval(strides, _HELPERS, scope)))
        return result

    def allocate(self, values: dict, device) -> list:
        """Empty output tensors as declared, on ``device`` (None for an absent optional one)."""
        return [None if shape is None else torch.empty(shape, dtype=dtype, device=device) if strides is None
                else torch.empty_strided(shape, strides, dtype=dtype, device=device)
                for _, dtype, shape, strides in self.evaluate(values)]


# ---- schemas --------------------------------------------------------------------------------

def _default_text(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(int(v)) for v in value) + "]"
    return repr(value)


def torch_params(record: dict) -> list:
    """``[(name, type text, default text or None)]``: the custom op's parameters, in order."""
    result, alias = [], iter("abcdefghijklmnopqrstuvwxyz")
    for p in record["params"]:
        t, kind = p["type"], p["type"]["kind"]
        default = None if p["default"] == "<required>" else _default_text(p["default"])
        if kind == "tensor":
            text = "Tensor" + (f"({next(alias)}!)" if t["mutable"] else "") + ("?" if t["optional"] else "")
            result.append((p["name"], text, default))
        elif kind == "tensor_list":
            result.append((p["name"], "Tensor" + (f"({next(alias)}!)" if t["mutable"] else "") + "[]", default))
        elif kind == "quantized":
            result += [(p["name"], "Tensor", None), (p["name"] + "_sf", "Tensor?", None)]
        elif kind in ("int", "float"):
            result.append((p["name"], kind + ("?" if t["optional"] else ""), default))
        elif kind == "bool":
            result.append((p["name"], "bool", default))
        elif kind == "str":
            result.append((p["name"], "str" + ("?" if t.get("optional") else ""), default))
        elif kind == "int_tuple":
            result.append((p["name"], f"int[{t['length']}]" + ("?" if t["optional"] else ""), default))
        elif kind == "dtype":  # the default by name, as torch's schema parser reads a ScalarType's
            result.append((p["name"], "ScalarType", None if p["default"] == "<required>" else p["default"]))
        else:
            raise ValueError(f"{record['module']}.{record['name']}: no torch type for parameter kind {kind!r}")
    return result


def _decl(params: list) -> str:
    return ", ".join(f"{text} {name}" + (f"={default}" if default is not None else "")
                     for name, text, default in params)


def schemas(record: dict, params: list) -> tuple:
    """The functional op's schema and the out form's (None for an op without outputs), as
    ``torch.library`` defines them, over ``torch_params(record)``."""
    optional = {o["name"]: o["optional"] for o in record["outs"]}
    kinds = ["Tensor?" if optional[r] else "Tensor" for r in flat_returns(record["returns"])]
    n = len(kinds)
    returns = "()" if n == 0 else kinds[0] if n == 1 else "(" + ", ".join(kinds) + ")"
    functional = f"{record['name']}({_decl(params)}) -> {returns}"
    taken = sum(1 for _, text, _ in params if "!" in text)
    letters = "abcdefghijklmnopqrstuvwxyz"[taken:]
    if not record["outs"]:  # an in-place op: nothing to pass as out=, no out form
        return functional, None
    outs = ", ".join(f"Tensor({letters[i]}!){'?' if o['optional'] else ''} {o['name']}"
                     for i, o in enumerate(record["outs"]))
    out_form = f"{record['name']}_out({_decl(params)}, *, {outs}) -> ()"
    return functional, out_form


# ---- the kernels behind each op ------------------------------------------------------------

def _public_call(record: dict, values: list) -> list:
    """The C function's positional arguments for the custom op's parameter values."""
    args = []
    it = iter(values)
    for p in record["params"]:
        v = next(it)
        kind = p["type"]["kind"]
        if kind == "quantized":
            sf = next(it)
            v = v if sf is None else (v, sf)
        elif kind == "int_tuple" and v is not None:
            v = tuple(v)
        args.append(v)
    return args


def _default_value(p: dict):
    """A parameter's default as the public function has it (a dtype parameter's name as the
    torch.dtype)."""
    if p["type"]["kind"] == "dtype" and p["default"] is not None:
        return getattr(torch, p["default"])
    return p["default"]


def _defaults(record: dict) -> list:
    """The custom op's parameters' default values, in order (None where required)."""
    result = []
    for p in record["params"]:
        default = None if p["default"] == "<required>" else _default_value(p)
        result += [default, None] if p["type"]["kind"] == "quantized" else [default]
    return result


def _complete(defaults: list, values: tuple, named: dict) -> list:
    """The values of a kernel's call: the dispatcher leaves out trailing arguments equal to
    their defaults, and may pass some by name."""
    return list(values) + [named.pop(n, d) for n, d in list(defaults)[len(values):]]


def _has_layout(t: torch.Tensor, shape: list, strides) -> bool:
    """Whether ``t`` has the declared strides (contiguous when None) in every dim of size > 1,
    the rule the C function applies to a given output."""
    if strides is None:
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * max(int(shape[i + 1]), 1)
    return all(int(n) <= 1 or t.stride(i) == int(st) for i, (n, st) in enumerate(zip(shape, strides)))


def _staged_outputs(declarations, values: dict, given: dict) -> dict:
    """``{name: (given tensor, temporary)}`` for the given outputs whose strides differ from the
    op's layout: functionalization (``torch.compile`` of a call with ``out=``) hands the out form
    clones, and a clone of a padded layout (TMA-aligned column-major factors) is compacted.  The
    op writes a temporary of its own layout, copied into the given tensor."""
    staged = {}
    for name, dtype, shape, strides in declarations.evaluate(values):
        t = given.get(name)
        if t is None or shape is None or _has_layout(t, shape, strides):
            continue
        if list(t.shape) != [int(n) for n in shape] or t.dtype != dtype:
            continue  # the C function names the mismatch
        temporary = (torch.empty(shape, dtype=dtype, device=t.device) if strides is None
                     else torch.empty_strided(shape, strides, dtype=dtype, device=t.device))
        staged[name] = (t, temporary)
    return staged


def _register(lib, record: dict, spec: dict, public) -> None:
    params = torch_params(record)
    functional, out_form = schemas(record, params)
    name = record["name"]
    declarations = OutputDeclarations(record)
    out_names = spec["out_names"]
    names = [n for n, _, _ in params]
    first_tensor = next(n for n, text, _ in params if text.startswith("Tensor"))
    defaults = list(zip(names, _defaults(record)))
    lib.define(functional)
    if out_form is not None:
        lib.define(out_form)

    def cuda(*values, **named):
        values = _complete(defaults, values, named)
        by_name = dict(zip(names, values))
        outs = declarations.allocate(by_name, by_name[first_tensor].device)
        public(*_public_call(record, values), **dict(zip(out_names, outs)))
        return _op_result(spec, outs)

    def meta(*values, **named):
        values = _complete(defaults, values, named)
        return _op_result(spec, declarations.allocate(dict(zip(names, values)), "meta"))

    def cuda_out(*values, **named):
        values = _complete(defaults, values, named)
        staged = _staged_outputs(declarations, dict(zip(names, values)), named)
        public(*_public_call(record, values), **{**named, **{n: t for n, (_, t) in staged.items()}})
        for given, temporary in staged.values():
            given.copy_(temporary)

    def meta_out(*values, **named):
        return None

    lib.impl(name, cuda, "CUDA")
    lib.impl(name, meta, "Meta")
    if out_form is not None:
        lib.impl(name + "_out", cuda_out, "CUDA")
        lib.impl(name + "_out", meta_out, "Meta")


def binding(record: dict) -> dict:
    """How the public function's arguments become the custom ops', as plain data (dynamo
    traces :func:`bind` over it as constants)."""
    params = record["params"]
    out_names = [o["name"] for o in record["outs"]]
    return {
        "qual": f"{record['module']}.{record['name']}",
        "names": [p["name"] for p in params],
        "defaults": {p["name"]: _default_value(p) for p in params if p["default"] != "<required>"},
        "out_names": out_names,
        # outputs the public function also takes by position, after its parameters
        "positional_outs": sum(1 for o in record["outs"] if o.get("positional", False)),
        "enums": {p["name"]: p["type"]["choices"] for p in params if p["type"]["kind"] == "str" and p["type"]["enum"]},
        "quantized": [p["name"] for p in params if p["type"]["kind"] == "quantized"],
        "returns": _return_indices(record["returns"], out_names),
    }


def bind(spec: dict, args: tuple, kwargs: dict) -> tuple:
    """``(values, given_outs)``: the custom op's parameter values, in order (a ``(data, sf)``
    pair split, an enum member as its name), and the ``out=`` tensors (None where not given)."""
    names, qual = spec["names"], spec["qual"]
    positional = len(names) + spec.get("positional_outs", 0)
    if len(args) > positional:
        raise TypeError(f"{qual}: takes at most {positional} positional arguments ({len(args)} given)")
    bound = dict(zip(names, args))
    kwargs = dict(kwargs)
    out_args = dict(zip(spec["out_names"], args[len(names):]))
    for n in out_args:
        if n in kwargs:
            raise TypeError(f"{qual}: got multiple values for argument {n!r}")
    given_outs = [out_args[n] if n in out_args else kwargs.pop(n, None) for n in spec["out_names"]]
    for k, v in kwargs.items():
        if k not in names or k in bound:
            raise TypeError(f"{qual}: unexpected or repeated argument {k!r}")
        bound[k] = v
    values = []
    for n in names:
        if n not in bound and n not in spec["defaults"]:
            raise TypeError(f"{qual}: missing argument {n!r}")
        v = bound[n] if n in bound else spec["defaults"][n]
        if n in spec["quantized"]:
            values += list(v) if isinstance(v, tuple) else [v, None]
            continue
        if n in spec["enums"] and not isinstance(v, str):
            v = spec["enums"][n][int(v)]
        values.append(v)
    return values, given_outs


def flat_returns(returns: list) -> list:
    """The out names of ``returns`` in order, nested tuples (list entries) flattened."""
    return [n for r in returns for n in (flat_returns(r) if isinstance(r, (list, tuple)) else [r])]


def _return_indices(returns: list, out_names: list) -> list:
    return [_return_indices(r, out_names) if isinstance(r, (list, tuple)) else out_names.index(r) for r in returns]


def _nest(returns: list, outs: list) -> tuple:
    return tuple(_nest(k, outs) if isinstance(k, list) else outs[k] for k in returns)


def _op_result(spec: dict, outs: list):
    """What the custom op returns: the returned outputs, flat (a torch schema has no nested
    tuples)."""
    flat = flat_returns(spec["returns"])
    if not flat:
        return None
    return outs[flat[0]] if len(flat) == 1 else tuple(outs[k] for k in flat)


def _from_op(spec: dict, made):
    """The public result from the custom op's flat one (nested tuples rebuilt)."""
    if not any(isinstance(r, list) for r in spec["returns"]):
        return made
    outs = [None] * len(spec["out_names"])
    for k, t in zip(flat_returns(spec["returns"]), made):
        outs[k] = t
    return _result(spec, outs)


def _result(spec: dict, outs: list):
    returns = spec["returns"]
    if not returns:
        return None
    return outs[returns[0]] if len(returns) == 1 and not isinstance(returns[0], list) else _nest(returns, outs)


def _torch_call_function(record: dict, spec: dict):
    """The public function's semantics over the custom ops (a plain Python function that
    dynamo traces): arguments bound as the C function binds them (``spec``: its
    :func:`binding`), then the functional op, or with every ``out=`` given the out form, or
    with some given the functional op and a copy."""
    single = len(spec["out_names"]) == 1
    name = record["name"]

    def torch_call(*args, **kwargs):
        values, given_outs = bind(spec, args, kwargs)
        functional = getattr(torch.ops.tile_kernels_aot, name).default
        if all(o is None for o in given_outs):
            return _from_op(spec, functional(*values))
        if all(o is not None for o in given_outs):
            out_form = getattr(torch.ops.tile_kernels_aot, name + "_out").default
            out_form(*values, **dict(zip(spec["out_names"], given_outs)))
            return _result(spec, given_outs)
        made = functional(*values)
        made = [made] if single else list(made)
        outs = []
        for given, m in zip(given_outs, made):
            if given is not None:
                given.copy_(m)
            outs.append(given if given is not None else m)
        return _result(spec, outs)

    torch_call.__name__ = record["name"]
    torch_call.__qualname__ = record["name"]
    torch_call.__doc__ = f"{spec['qual']} through torch.ops.{NAMESPACE}.{record['name']} (what torch.compile traces)."
    return torch_call


def custom_op_arguments(qualname: str, args: tuple, kwargs: dict) -> tuple:
    """``(values, out=)`` of a public call ``'<module>.<name>'(*args, **kwargs)`` as its custom
    ops take them: ``torch.ops.tile_kernels_aot.<name>(*values)``, or the out form with
    ``**out`` when every output is given."""
    register()
    spec = _BINDINGS[qualname]
    values, given = bind(spec, args, kwargs)
    return values, dict(zip(spec["out_names"], given))


def torch_call(qualname: str):
    """The function that runs ``'<module>.<name>'`` through its custom ops."""
    register()
    return _CALLS[qualname]


def _public(record: dict):
    from tile_kernels_aot import _C

    return getattr(getattr(_C, record["module"]), record["name"])


def register() -> None:
    """Define every op of this build in ``torch.ops.tile_kernels_aot`` (once), let the C
    functions hand tensor subclasses to them, and arrange the dynamo rules."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    from tile_kernels_aot import _C

    records = manifest.ops()
    names = [r["name"] for r in records]
    if len(set(names)) != len(names):
        raise RuntimeError(f"{NAMESPACE}: two public ops share a name: {sorted(names)}")
    lib = torch.library.Library(NAMESPACE, "DEF")
    for record in records:
        spec = binding(record)
        _register(lib, record, spec, _public(record))
        _BINDINGS[spec["qual"]] = spec
        _CALLS[spec["qual"]] = _torch_call_function(record, spec)
    _LIBRARY = lib
    _C._set_torch_path(_torch_path, torch.Tensor, (torch.Tensor, torch.nn.Parameter))
    _when_dynamo_imported(_install_dynamo_rules)


def _torch_path(qualname: str, args: tuple, kwargs: dict):
    """Called by a C function given a tensor subclass: the same call through the custom ops."""
    return _CALLS[qualname](*args, **kwargs)


def _install_dynamo_rules() -> None:
    for record in manifest.ops():
        qual = f"{record['module']}.{record['name']}"
        torch.compiler.substitute_in_graph(_public(record), skip_signature_check=True)(_CALLS[qual])


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Runs a callback right after ``torch._dynamo`` has been imported."""

    def __init__(self, callback):
        self.callback = callback

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_callback(module):
            exec_module(module)
            _run_hook(callback)

        spec.loader.exec_module = exec_then_callback
        return spec


def _run_hook(callback) -> None:
    try:
        callback()
    except Exception as e:  # a failed rule costs graph breaks, never the import
        warnings.warn(f"{NAMESPACE}: the torch.compile rules were not installed ({type(e).__name__}: {e}); "
                      "calls under torch.compile will break the graph", RuntimeWarning, stacklevel=2)


def _when_dynamo_imported(callback) -> None:
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and hasattr(dynamo, "substitute_in_graph"):
        _run_hook(callback)
    else:
        sys.meta_path.insert(0, _DynamoImportHook(callback))
