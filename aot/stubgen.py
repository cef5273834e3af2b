"""Stage 4: generate the C++ host stubs of every op folder from its schema and the manifest.

For each op folder (``kernels_tl/<family>/<op>/``) this writes, under the bundle's
``stubs/``:

* ``include/<family>/<op>/args.h``: the types its ``host.h`` works on: per public
  function the parsed ``Args``, the ``OutSpecs`` it fills and the ``Outs`` it reads;
  per folder the static ``Config``, the kernel's ``Constants`` and its ``KernelArgs``
  (one field per kernel parameter, by name);
* ``include/<family>/<op>/host.h``: the folder's hand-written host side, copied;
* ``<family>_<op>.cc``: a launcher per prebuilt (config, arch) that packs the kernel's
  parameters in device order and computes its grid, the config lookup, and one raw
  CPython function per public op: argument parsing from the schema, the host side's
  plan, config dispatch, outputs, launch.

plus ``include/tka/targets.h`` (``aot.targets``) and ``ops_table.cc`` (every op, for the
module init).  Plain string generation: it needs neither TileLang nor a GPU.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from aot.targets import ARCH_NAMES, DTYPES, targets_header
from kernels_tl.schema import REQUIRED, Op

PARAM_CTYPES = {"ptr": "void*", "int32": "int64_t", "int64": "int64_t", "float32": "double"}


def ident(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", text)


def cpp_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def folder_namespace(kernel: str) -> str:
    """``'quant.per_token_cast'`` -> ``'tka::quant_per_token_cast'``."""
    return "tka::" + ident(kernel)


def _default_text(p) -> str:
    """A parameter's default as Python shows it (a dtype parameter's name as ``torch.<name>``)."""
    return f"torch.{p.default}" if p.type.kind == "dtype" else repr(p.default)


def has_text_signature(op: Op) -> bool:
    """Whether CPython can read the op's signature from a C function's docstring: only
    literal defaults (a torch.dtype is not one; such an op's public function is a wrapper
    that carries the signature)."""
    return not any(p.type.kind == "dtype" and p.default != REQUIRED for p in op.params)


def text_signature(op: Op) -> str:
    parts = [p.name if p.default == REQUIRED else f"{p.name}={_default_text(p)}" for p in op.params]
    parts += [f"{o.name}=None" for o in op.outs if o.positional]
    keyword_only = [o for o in op.outs if not o.positional]
    if keyword_only:
        parts.append("*")
        parts += [f"{o.name}=None" for o in keyword_only]
    return f"{op.name}({', '.join(parts)})"


def kernel_param_fields(kernel_manifest: dict) -> list:
    """[(name, kind)] of the kernel's parameters over every prebuilt build, first seen first."""
    fields = {}
    for cfg in kernel_manifest.get("configs", []):
        for build in cfg["builds"].values():
            for p in build["params"]:
                if fields.setdefault(p["name"], p["kind"]) != p["kind"]:
                    raise ValueError(f"kernel parameter {p['name']} changes type between builds")
    return list(fields.items())


def _constant_names(kernel_manifest: dict) -> list:
    names = None
    for cfg in kernel_manifest.get("configs", []):
        keys = list(cfg.get("constants", {}))
        if names is not None and keys != names:
            raise ValueError(f"host constants differ between configs: {names} and {keys}")
        names = keys
    return names or []


# ---- args.h ----------------------------------------------------------------------------

def _arg_fields(op: Op) -> list:
    """C++ field declarations of one op's ``Args``."""
    fields = []
    for p in op.params:
        t, n = p.type, p.name
        if t.kind == "tensor":
            fields.append(f"TensorArg {n};")
        elif t.kind == "tensor_list":
            fields.append(f"TensorListArg<{t.max_len}> {n};")
        elif t.kind == "quantized":
            fields += [f"TensorArg {n};  // the data, or the plain tensor", f"TensorArg {n}_sf;  // absent for a plain tensor"]
        elif t.kind == "int":
            fields.append(f"int64_t {n};")
        elif t.kind == "float":
            fields.append(f"double {n};")
        elif t.kind == "bool":
            fields.append(f"bool {n};")
        elif t.kind == "str":
            fields.append(f"int64_t {n};  // index into {list(t.choices)}" if t.enum else f"std::string_view {n};")
        elif t.kind == "int_tuple":
            fields.append(f"std::array<int64_t, {t.length}> {n};")
        elif t.kind == "dtype":
            fields.append(f"DType {n};  // one of {list(t.choices)}")
        else:
            raise ValueError(f"{op.module}.{op.name}: unknown parameter kind {t.kind!r}")
        if getattr(t, "optional", False) and t.kind not in ("tensor",):
            fields.append(f"bool {n}_is_none;")
    return fields


def generate_args_header(kernel: str, schema, kernel_manifest: dict, source: str) -> str:
    ns = folder_namespace(kernel)
    consts = _constant_names(kernel_manifest)
    L = [f"// Generated by aot.stubgen at build time from {source} and the kernel's parameters; do not edit.\n",
         "#pragma once\n\n#include <array>\n#include <cstdint>\n#include <string_view>\n\n#include \"tka/host.h\"\n\n",
         f"namespace {ns} {{\n\n"]
    L.append("// The static configuration, compared with the prebuilt ones (the shape table's keys).\n")
    L.append("struct Config {\n" + "".join(f"  ConfigValue {k};\n" for k in schema.static) + "};\n\n")
    L.append("// Integers of the kernel's layout for the chosen configuration (kernel.py: host_constants).\n")
    L.append("struct Constants {\n" + "".join(f"  int64_t {k};\n" for k in consts) + "};\n\n")
    L.append("// The kernel's parameters, by name (pointers, integers, floats).\n")
    L.append("struct KernelArgs {\n" + "".join(f"  {PARAM_CTYPES[kind]} {name};\n"
                                               for name, kind in kernel_param_fields(kernel_manifest)) + "};\n")
    for op in schema.ops:
        L.append(f"\n// {op.module}.{text_signature(op)}\nnamespace {op.name} {{\n")
        L.append("struct Args {\n" + "".join(f"  {f}\n" for f in _arg_fields(op)) + "};\n")
        bufs = list(op.outs) + list(op.scratch)
        L.append("struct OutSpecs {\n" + "".join(f"  OutSpec& {o.name};\n" for o in bufs) + "};\n")
        L.append("struct Outs {\n" + "".join(f"  const TensorArg& {o.name};\n" for o in bufs) + "};\n")
        L.append("// The op's host path without Python, for another folder's host side (e.g. its prologue):\n"
                 "// plan, config lookup, launch on `stream` of `device`, writing `o` (laid out as `outputs`\n"
                 "// gives them; the caller allocates them).  False with a Python error set, nothing launched.\n"
                 "bool run(const char* op, const Args& a, const Outs& o, int device, void* stream);\n")
        L.append(f"}}  // namespace {op.name}\n")
    L.append(f"\n}}  // namespace {ns}\n")
    return "".join(L)


# ---- the stub translation unit ---------------------------------------------------------

def _launcher(fn: str, build: dict, kernel: str) -> str:
    lines = [f"bool {fn}(const char* op, int device, void* stream, const KernelArgs& a) {{\n"]
    for p in build["params"]:
        if p["kind"] in ("int32", "int64"):
            lines.append(f"  [[maybe_unused]] const int64_t {p['name']} = a.{p['name']};\n")
    lines.append(f"  ParamSlot s[{max(len(build['params']), 1)}];\n")
    for i, p in enumerate(build["params"]):
        name, kind = p["name"], p["kind"]
        if kind == "ptr":
            lines.append(f"  s[{i}].ptr = a.{name};\n")
        elif kind == "int32":
            lines.append(f"  if (!fits_int32(op, {cpp_string(name)}, a.{name})) return false;\n")
            lines.append(f"  s[{i}].i32 = static_cast<int32_t>(a.{name});\n")
        elif kind == "int64":
            lines.append(f"  s[{i}].i64 = a.{name};\n")
        elif kind == "float32":
            lines.append(f"  s[{i}].f32 = static_cast<float>(a.{name});\n")
        else:
            raise ValueError(f"{kernel}: unknown kernel parameter kind {kind}")
    grid = ", ".join(build["grid"])
    block = ", ".join(str(b) for b in build["block"])
    cluster = ", ".join(str(int(c)) for c in build.get("cluster", (1, 1, 1)))
    lines.append(f"  const Geometry g{{{{{grid}}}, {{{block}}}, {build['dyn_smem']}, {{{cluster}}}}};\n")
    lines.append(f"  static KernelEntry entry{{{cpp_string(build['arch'])}, {cpp_string(build['cubin'])}, "
                 f"{cpp_string(build['sha256'])}, {cpp_string(build['entry'])}, {'true' if build['pdl'] else 'false'}, "
                 f"{'true' if build.get('cooperative') else 'false'}}};\n")
    lines.append(f"  return launch(op, &entry, device, stream, g, s, {len(build['params'])});\n}}\n")
    return "".join(lines)


def _config_match(static: list, config: dict) -> str:
    conds = []
    for key in static:
        value = config[key]
        if isinstance(value, bool):
            conds.append(f"c.{key}.i == {int(value)}")
        elif isinstance(value, int):
            conds.append(f"c.{key}.i == {value}")
        else:
            conds.append(f"c.{key}.s == std::string_view({cpp_string(str(value))})")
    return " && ".join(conds) or "true"


def _parse_param(i: int, p, qual: str) -> list:
    """Statements parsing v[i] into a.<name> (returning nullptr on error)."""
    t, n = p.type, p.name
    L = []
    fail = " return nullptr;"
    if t.kind in ("tensor", "quantized", "tensor_list"):
        def dtype_checks(field, dtypes, label):
            dts = ", ".join(DTYPES[d].enum for d in dtypes)
            return (f"!check_dtype(op, {cpp_string(label)}, a.{field}, {{{dts}}})")
        if t.kind == "tensor_list":
            if p.default != REQUIRED:
                raise ValueError(f"{qual}: a tensor list parameter must be required")
            L.append(f"  if (!tensor_list_arg(op, {cpp_string(n)}, v[{i}], {t.max_len}, a.{n}.items, &a.{n}.size)){fail}\n")
            item = f"{n}.items[k]"
            rank = "check_min_ndim" if t.leading else "check_ndim"
            checks = [dtype_checks(item, t.dtypes, n), f"!{rank}(op, {cpp_string(n)}, a.{item}, {t.ndim})",
                      f"!check_layout(op, {cpp_string(n)}, a.{item}, {'true' if t.contiguous else 'false'})"]
            L.append(f"  for (int64_t k = 0; k < a.{n}.size; ++k)\n    if ({' || '.join(checks)}){fail}\n")
        elif t.kind == "tensor":
            L.append(f"  if (!tensor_arg(op, {cpp_string(n)}, v[{i}], {'true' if t.optional else 'false'}, &a.{n})){fail}\n")
            rank = "check_min_ndim" if t.leading else "check_ndim"
            checks = [dtype_checks(n, t.dtypes, n), f"!{rank}(op, {cpp_string(n)}, a.{n}, {t.ndim})",
                      f"!check_layout(op, {cpp_string(n)}, a.{n}, {'true' if t.contiguous else 'false'})"]
            L.append(f"  if (a.{n}.present && ({' || '.join(checks)})){fail}\n")
        else:
            if p.default != REQUIRED:
                raise ValueError(f"{qual}: a quantized parameter must be required")
            plain = bool(t.plain_dtypes)
            L.append(f"  if (!quantized_arg(op, {cpp_string(n)}, v[{i}], {'true' if plain else 'false'}, &a.{n}, &a.{n}_sf)){fail}\n")
            data_checks = [f"!check_ndim(op, {cpp_string(n)}, a.{n}, {t.ndim})",
                           f"!check_layout(op, {cpp_string(n)}, a.{n}, {'true' if t.contiguous else 'false'})"]
            L.append(f"  if ({' || '.join(data_checks)}){fail}\n")
            L.append(f"  if (a.{n}_sf.present ? ({dtype_checks(n, t.dtypes, n)} || "
                     f"{dtype_checks(n + '_sf', t.sf_dtypes, n + chr(39) + 's sf')}) : "
                     + (f"{dtype_checks(n, t.plain_dtypes, n)}" if plain else "false") + f"){fail}\n")
        return L
    given = f"v[{i}] != nullptr"
    optional = "true" if getattr(t, "optional", False) else "false"
    if t.kind in ("int", "float"):
        cast, parse = (int, "int_arg") if t.kind == "int" else (float, "float_arg")
        L.append(f"  a.{n} = {cast(0 if p.default in (REQUIRED, None) else p.default)!r};\n")
        if t.optional:
            L.append(f"  a.{n}_is_none = {'true' if p.default is None else 'false'};\n")
        L.append(f"  if ({given} && !{parse}(op, {cpp_string(n)}, v[{i}], {optional}, &a.{n}, "
                 f"{'&a.' + n + '_is_none' if t.optional else 'nullptr'})){fail}\n")
    elif t.kind == "bool":
        L.append(f"  a.{n} = {'true' if p.default is True else 'false'};\n")
        L.append(f"  if ({given} && !bool_arg(op, {cpp_string(n)}, v[{i}], &a.{n})){fail}\n")
    elif t.kind == "str":
        choices = ", ".join(cpp_string(c) for c in t.choices)
        if t.enum:
            d = 0 if p.default == REQUIRED else list(t.choices).index(str(p.default))
            L.append(f"  a.{n} = {d};\n")
            L.append(f"  if ({given} && !enum_arg(op, {cpp_string(n)}, v[{i}], {{{choices}}}, &a.{n})){fail}\n")
        else:
            d = "" if p.default in (REQUIRED, None) else str(p.default)
            L.append(f"  a.{n} = {cpp_string(d)};\n")
            if t.optional:  # None: an empty string and <name>_is_none
                L.append(f"  a.{n}_is_none = {'true' if p.default is None else 'false'};\n")
                L.append(f"  if ({given} && v[{i}] == Py_None) {{ a.{n} = \"\"; a.{n}_is_none = true; }}\n")
                L.append(f"  else if ({given} && (a.{n}_is_none = false, "
                         f"!str_arg(op, {cpp_string(n)}, v[{i}], {{{choices}}}, &a.{n}))){fail}\n")
            else:
                L.append(f"  if ({given} && !str_arg(op, {cpp_string(n)}, v[{i}], {{{choices}}}, &a.{n})){fail}\n")
    elif t.kind == "int_tuple":
        if p.default not in (REQUIRED, None):
            L.append(f"  a.{n} = {{{', '.join(str(int(x)) for x in p.default)}}};\n")
        else:
            L.append(f"  a.{n} = {{}};\n")
        if t.optional:
            L.append(f"  a.{n}_is_none = {'true' if p.default is None else 'false'};\n")
        L.append(f"  if ({given} && !int_tuple_arg(op, {cpp_string(n)}, v[{i}], {optional}, {t.length}, a.{n}.data(), "
                 f"{'&a.' + n + '_is_none' if t.optional else 'nullptr'})){fail}\n")
    elif t.kind == "dtype":
        choices = ", ".join(DTYPES[c].enum for c in t.choices)
        if p.default not in (REQUIRED, None) and p.default not in t.choices:
            raise ValueError(f"{qual}: {n}'s default {p.default!r} is not among its choices")
        L.append(f"  a.{n} = {DTYPES[p.default].enum if p.default not in (REQUIRED, None) else 'UNKNOWN'};\n")
        L.append(f"  if ({given} && !dtype_arg(op, {cpp_string(n)}, v[{i}], {{{choices}}}, &a.{n})){fail}\n")
    else:
        raise ValueError(f"{qual}: unknown parameter kind {t.kind!r}")
    return L


def _op_function(op: Op, ns: str, prebuilt: bool = True) -> str:
    """One op's Python entry point.  ``prebuilt`` False (the table lists no config of the op's
    folder): it checks the call's arguments against the signature, then raises the not-prebuilt
    error; its folder's ``host.h`` is not compiled (its kernel arguments do not exist)."""
    qual = f"{op.module}.{op.name}"
    fid = f"op_{ident(op.module)}_{ident(op.name)}"
    names = [p.name for p in op.params] + [o.name for o in op.outs]
    positional_outs = sum(1 for o in op.outs if o.positional)
    if any(o.positional for o in op.outs[positional_outs:]):
        raise ValueError(f"{qual}: positional outputs must come first among the outputs")
    npos = len(op.params)  # where the outputs start in `v`
    nreq = sum(1 for p in op.params if p.default == REQUIRED)
    if any(p.default == REQUIRED for p in op.params[nreq:]):
        raise ValueError(f"{qual}: required parameters must come first")
    tensors = []
    for p in op.params:
        if p.type.kind == "tensor":
            tensors.append(p.name)
        elif p.type.kind == "quantized":
            tensors += [p.name, p.name + "_sf"]
    if not tensors:
        raise ValueError(f"{qual}: an op needs a tensor parameter")
    # how messages name each tensor view: a pair's scale factors are "<name>'s sf"
    labels = [n[:-3] + "'s sf" if n.endswith("_sf") and n[:-3] in tensors else n for n in tensors]
    nout = len(op.outs)
    nbuf = nout + len(op.scratch)  # the outputs, then the scratch buffers
    if nbuf > 8:
        raise ValueError(f"{qual}: at most 8 outputs and scratch buffers")
    L = [] if not prebuilt else _launch_and_run(op, ns, fid)
    L += [f"static inline PyObject* {fid}_body(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {{\n",
         f"  namespace F = {ns}::{op.name};\n",
         f"  static const char* const op = {cpp_string(qual)};\n",
         f"  static const char* const names[] = {{{', '.join(cpp_string(n) for n in names)}}};\n",
         f"  static PyObject* interned[{len(names)}] = {{}};\n",
         f"  PyObject* v[{len(names)}];\n",
         f"  if (!parse_args(op, args, nargs, kwnames, names, interned, {len(names)}, {npos + positional_outs}, {nreq}, v)) return nullptr;\n",
         "  F::Args a;\n"]
    for i, p in enumerate(op.params):
        L += _parse_param(i, p, qual)
    if not prebuilt:
        L.append("  (void)a;\n  not_prebuilt(op, \"any configuration of this op\", kPrebuilt);\n  return nullptr;\n}\n")
        L.append(f"bool {ns}::{op.name}::run(const char* op, const Args&, const Outs&, int, void*) {{\n"
                 "  return not_prebuilt(op, \"any configuration of this op\", kPrebuilt);\n}\n")
        return "".join(L) + _op_entry(op, fid, qual)
    # the host side's plan, then the config lookup (before any device work: a machine
    # without a GPU reports an unbuilt configuration too)
    L.append("  F::Plan p;\n  Config c;\n  if (!F::plan(op, a, p, c)) return nullptr;\n")
    L.append("  const int cfg = find_config(c);\n")
    L.append("  if (cfg < 0) { not_prebuilt(op, wanted(c).c_str(), kPrebuilt); return nullptr; }\n")
    first = tensors[0]
    L.append(f"  const int device = a.{first}.device;\n")
    for n, label in zip(tensors, labels):
        L.append(f"  if (a.{n}.present && !check_same_device(op, {cpp_string(label)}, a.{n}, device)) return nullptr;\n")
    for p in op.params:
        if p.type.kind == "tensor_list":
            L.append(f"  for (int64_t k = 0; k < a.{p.name}.size; ++k)\n"
                     f"    if (!check_same_device(op, {cpp_string(p.name)}, a.{p.name}.items[k], device)) return nullptr;\n")
    L.append("  const int arch = device_arch(op, device);\n  if (arch < 0) return nullptr;\n")
    L.append("  const Launcher launcher = kLaunch[cfg][arch];\n")
    L.append("  if (launcher == nullptr) { runtime_error(op, \"this build has no %s kernel for this configuration\", "
             "kArchs[arch].name); return nullptr; }\n")
    # the current stream, asked once: outputs are allocated for it and the kernel runs on it
    L.append("  void* stream;\n  if (!current_stream(op, device, &stream)) return nullptr;\n")
    if nbuf:
        L.append(f"  OutSpec specs[{nbuf}];\n")
        L.append(f"  F::OutSpecs s{{{', '.join(f'specs[{k}]' for k in range(nbuf))}}};\n")
        L.append("  F::outputs(a, p, s);\n")
        L.append(f"  static const char* const out_names[] = "
                 f"{{{', '.join(cpp_string(o.name) for o in list(op.outs) + list(op.scratch))}}};\n")
        L.append(f"  Output outs[{nbuf}];\n")
        given = f"v + {npos}"
        if op.scratch:  # no caller's tensor for a scratch buffer
            L.append(f"  PyObject* given[{nbuf}] = {{{', '.join([f'v[{npos + k}]' for k in range(nout)] + ['nullptr'] * len(op.scratch))}}};\n")
            given = "given"
        L.append(f"  if (!make_outputs(op, {nbuf}, out_names, {given}, specs, device, stream, outs)) return nullptr;\n")
        L.append(f"  static const char* const input_names[] = {{{', '.join(cpp_string(n) for n in labels)}}};\n")
        L.append(f"  const TensorArg* const inputs[] = {{{', '.join(f'&a.{n}' for n in tensors)}}};\n")
        L.append(f"  if (!check_no_overlap(op, {nout}, out_names, v + {npos}, outs, {len(tensors)}, input_names, inputs)) "
                 "return nullptr;\n")
    outs = ", ".join(f"outs[{k}].t" for k in range(nbuf))
    L.append(f"  if (F::needs_launch(p) && !launch_{fid}(op, a, p, cfg, launcher, F::Outs{{{outs}}}, device, stream)) "
             "return nullptr;\n")
    index = {o.name: k for k, o in enumerate(op.outs)}
    if not op.returns:
        L.append("  Py_RETURN_NONE;\n")
    elif len(op.returns) == 1:
        L.append(f"  return outs[{index[op.returns[0]]}].release_or_none();\n")
    else:
        # a list entry of returns is a nested tuple (e.g. a (data, sf) pair)
        def build(var, entries):
            L.append(f"  PyObject* {var} = PyTuple_New({len(entries)});\n  if ({var} == nullptr) return nullptr;\n")
            for k, r in enumerate(entries):
                if isinstance(r, (list, tuple)):
                    build(f"{var}_{k}", r)
                    L.append(f"  PyTuple_SET_ITEM({var}, {k}, {var}_{k});\n")
                else:
                    L.append(f"  PyTuple_SET_ITEM({var}, {k}, outs[{index[r]}].release_or_none());\n")
        build("result", op.returns)
        L.append("  return result;\n")
    L.append("}\n")
    return "".join(L) + _op_entry(op, fid, qual)


def _launch_and_run(op: Op, ns: str, fid: str) -> list:
    """An op's launch (the host side's prologue, then the kernel's launch or chained launches) and its
    Python-free ``run`` (args.h), which plans, finds the config and launches into given outputs."""
    L = [f"static bool launch_{fid}(const char* op, const {ns}::{op.name}::Args& a, const {ns}::{op.name}::Plan& p, "
         f"int cfg, Launcher launcher, const {ns}::{op.name}::Outs& o, int device, void* stream) {{\n",
         f"  namespace F = {ns}::{op.name};\n"]
    prologue = "  if (!F::prologue(op, a, p, o, device, stream)) return false;\n" if op.prologue else ""
    if op.launches:  # chained launches: the host side's count, kernel_args per launch index
        L.append(prologue + "  const int64_t launches = F::launches(p);\n  for (int64_t j = 0; j < launches; ++j) {\n"
                 "    KernelArgs ka{};\n    if (!F::kernel_args(op, a, p, kConstants[cfg], o, ka, j)) return false;\n"
                 "    if (!launcher(op, device, stream, ka)) return false;\n  }\n  return true;\n}\n")
    else:  # the kernel's arguments (and their checks) before the prologue launches anything
        L.append("  KernelArgs ka{};\n  if (!F::kernel_args(op, a, p, kConstants[cfg], o, ka)) return false;\n" + prologue +
                 "  return launcher(op, device, stream, ka);\n}\n")
    L.append(f"bool {ns}::{op.name}::run(const char* op, const Args& a, const Outs& o, int device, void* stream) {{\n"
             "  Plan p;\n  Config c;\n  if (!plan(op, a, p, c)) return false;\n"
             "  const int cfg = find_config(c);\n"
             "  if (cfg < 0) return not_prebuilt(op, wanted(c).c_str(), kPrebuilt);\n"
             "  if (!needs_launch(p)) return true;\n"
             "  const int arch = device_arch(op, device);\n  if (arch < 0) return false;\n"
             "  const Launcher launcher = kLaunch[cfg][arch];\n"
             "  if (launcher == nullptr) return runtime_error(op, \"this build has no %s kernel for this configuration\", "
             "kArchs[arch].name);\n"
             f"  return launch_{fid}(op, a, p, cfg, launcher, o, device, stream);\n}}\n")
    return L


def _op_entry(op: Op, fid: str, qual: str) -> str:
    """The PyMethodDef of an op and the function it points to (the body, then torch's path for a
    tensor subclass)."""
    L = []
    # a failed body may have met a tensor subclass: then the call goes through torch
    L.append(f"static PyObject* {fid}(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {{\n"
             f"  PyObject* result = {fid}_body(args, nargs, kwnames);\n"
             f"  return result != nullptr ? result : torch_path_or_error({cpp_string(qual)}, args, nargs, kwnames);\n}}\n")
    # "--" marks a signature CPython reads (inspect.signature); otherwise it is the doc's first line
    doc = text_signature(op) + ("\n--\n\n" if has_text_signature(op) else "\n\n") + op.doc
    L.append(f"namespace tka::gen {{\nPyMethodDef {fid} = {{{cpp_string(op.name)}, "
             f"reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(::{fid})), METH_FASTCALL | METH_KEYWORDS,\n"
             f"    {cpp_string(doc)}}};\n}}  // namespace tka::gen\n\n")
    return "".join(L)


def generate_kernel_unit(kernel: str, schema, kernel_manifest: dict, include_dir: str, source: str) -> str:
    """The C++ translation unit of one op folder."""
    ns = folder_namespace(kernel)
    configs = kernel_manifest.get("configs", [])
    static = list(schema.static)
    consts = _constant_names(kernel_manifest)
    out = [f"// Generated by aot.stubgen at build time from {source}; do not edit.\n",
           "#include <string>\n#include <string_view>\n\n#include \"tka/ops.h\"\n",
           f"#include \"{include_dir}/args.h\"\n"]
    if not configs:  # the table lists none of this folder's configs: the ops only refuse calls
        out.append(f"\nnamespace {{\nusing namespace tka;\nusing namespace {ns};\nconst char kPrebuilt[] = \"\";\n}}  // namespace\n\n")
        return "".join(out) + "".join(_op_function(op, ns, prebuilt=False) for op in schema.ops)
    out += [f"#include \"{include_dir}/host.h\"\n\n",
           f"namespace {{\nusing namespace tka;\nusing namespace {ns};\n",
           "using Launcher = bool (*)(const char*, int, void*, const KernelArgs&);\n"]
    rows = []
    for ci, cfg in enumerate(configs):
        row = []
        for arch in ARCH_NAMES:
            build = cfg["builds"].get(arch)
            if build is None:
                row.append("nullptr")
                continue
            fn = f"launch_{ci}_{ident(arch)}"
            row.append(fn)
            out.append(_launcher(fn, build, kernel))
        rows.append(row)
    out.append("const Launcher kLaunch[][kNumArchs] = {\n" + "".join(f"    {{{', '.join(r)}}},\n" for r in rows) + "};\n")
    out.append("const Constants kConstants[] = {\n" + "".join(
        f"    {{{', '.join(str(int(cfg['constants'][k])) for k in consts)}}},\n" for cfg in configs) + "};\n")
    out.append("int find_config(const Config& c) {\n  (void)c;\n")
    for ci, cfg in enumerate(configs):
        out.append(f"  if ({_config_match(static, cfg['config'])}) return {ci};\n")
    out.append("  return -1;\n}\n")
    out.append(f"const char kPrebuilt[] = {cpp_string('; '.join(cfg['key'] for cfg in configs))};\n")
    shown = ' + ", " + '.join(f"std::string({cpp_string(k + '=')}) + c.{k}.show()" for k in static) or 'std::string()'
    out.append(f"std::string wanted(const Config& c) {{ return {shown}; }}\n")
    out.append("}  // namespace\n\n")
    for op in schema.ops:
        out.append(_op_function(op, ns))
    return "".join(out)


def generate_ops_table(ops: list) -> str:
    """``ops_table.cc``: every op's PyMethodDef, for the module init."""
    lines = ["// Generated by aot.stubgen at build time; do not edit.\n", '#include "tka/ops.h"\n\n', "namespace tka::gen {\n"]
    fids = [(op.module, f"op_{ident(op.module)}_{ident(op.name)}") for op in ops]
    lines += [f"extern PyMethodDef {fid};\n" for _, fid in fids]
    lines.append("}  // namespace tka::gen\n\nnamespace tka {\nconst OpDef kOps[] = {\n")
    lines += [f"    {{{cpp_string(module)}, &tka::gen::{fid}}},\n" for module, fid in fids]
    lines.append("    {nullptr, nullptr},\n};\n}  // namespace tka\n")
    return "".join(lines)


def write_stubs(out_dir: Path, units: list) -> list:
    """``units``: [(kernel name, schema, kernel manifest entry, op folder path)].  Writes the
    files listed in this module's docstring; returns the ``.cc`` paths written."""
    out_dir = Path(out_dir)
    include = out_dir / "include"
    _write_if_changed(include / "tka" / "targets.h", targets_header())
    written, all_ops = [], []
    for kernel, schema, kernel_manifest, folder in units:
        family, name = kernel.split(".")
        rel = f"{family}/{name}"
        source = f"kernels_tl/{rel}/schema.py"
        _write_if_changed(include / rel / "args.h", generate_args_header(kernel, schema, kernel_manifest, source))
        host = include / rel / "host.h"
        if not host.exists() or host.read_bytes() != (Path(folder) / "host.h").read_bytes():
            shutil.copyfile(Path(folder) / "host.h", host)
        path = out_dir / f"{ident(kernel)}.cc"
        _write_if_changed(path, generate_kernel_unit(kernel, schema, kernel_manifest, rel, source))
        written.append(path)
        all_ops += list(schema.ops)
    path = out_dir / "ops_table.cc"
    _write_if_changed(path, generate_ops_table(all_ops))
    written.append(path)
    return written


def _write_if_changed(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
