"""Stage 1: lower one (kernel, static config, arch) with TileLang.

The result is plain data: the CUDA source, the kernel's entry symbol, its
parameters in device order, its launch geometry (grid, block, dynamic
shared memory) as C++ expressions over the kernel's dynamic variables, its
thread-block cluster shape (``T.Kernel(..., cluster_dims=...)``; the launch sets it),
and whether it waits for the previous grid itself (programmatic dependent launch).
This stage needs TileLang but no GPU.
"""

from __future__ import annotations

import dataclasses
import ast
import hashlib
import importlib
import inspect
import json
from pathlib import Path

from aot.targets import ARCH_NAMES
from kernels_tl.folders import op_folder



@dataclasses.dataclass(frozen=True)
class LoweredKernel:
    kernel: str  # the op folder's kernel name, e.g. 'moe.topk_gate'
    config: dict  # static parameters
    arch: str
    entry: str  # the __global__ function's symbol
    source: str  # CUDA C++ source
    params: list  # [{"name", "kind": "ptr"|"int32"|"int64"|"float32"}] in device order
    grid: list  # 3 C++ expressions
    block: list  # 3 ints
    dyn_smem: str  # C++ expression (bytes)
    # The kernel waits for the previous grid in the stream before touching memory
    # (``pdl_sync``), so it may be launched to overlap that grid's tail.
    pdl: bool
    # Blocks per thread-block cluster along x, y, z ([1, 1, 1]: no clusters), a launch attribute.
    cluster: list = dataclasses.field(default_factory=lambda: [1, 1, 1])
    # The kernel synchronizes its whole grid (``T.sync_grid()``): launched cooperatively, so that
    # every block is resident at once (the launch fails rather than hangs when they cannot be).
    cooperative: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "LoweredKernel":
        return LoweredKernel(**json.loads(text))


def kernel_module(kernel_name: str):
    """``'moe.topk_gate'`` -> the module ``kernels_tl.moe.topk_gate.kernel``."""
    return importlib.import_module(f"kernels_tl.{kernel_name}.kernel")


def kernel_sources(module_path: Path) -> list:
    """``kernel.py`` and the ``kernels_tl`` modules it imports, transitively: the Python source
    a kernel's lowering can depend on (so editing a module no kernel imports, or one this
    kernel does not import, leaves its cache valid)."""
    root = module_path.parents[2]  # kernels_tl/
    seen, todo = [], [module_path, module_path.parent / "__init__.py", module_path.parents[1] / "__init__.py",
                      root / "__init__.py"]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.append(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                dotted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                dotted = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in dotted:
                parts = name.split(".")
                if parts[0] == root.name and len(parts) > 1:
                    todo += [root.joinpath(*parts[1:]).with_suffix(".py"), root.joinpath(*parts[1:], "__init__.py")]
    return sorted(seen)


# The version of what :func:`lower` produces from an unchanged kernel.  Bump it with any change
# here that alters the lowered source or the recorded geometry, so cached lowerings are redone;
# an added field with a default (older records read back with it) needs no bump.
LOWERING_FORMAT = 1


def lowering_key(kernel_name: str, config: dict, arch: str) -> str:
    """Content hash of everything lowering depends on: the op folder's ``kernel.py`` and the
    ``kernels_tl`` modules it imports (:func:`kernel_sources`), ``LOWERING_FORMAT``, the config,
    the arch and the TileLang version.  (The host side, ``host.h``, and the schema do not
    change the cubin.)"""
    import tilelang

    root = Path(inspect.getfile(kernel_module(kernel_name))).parents[2]
    h = hashlib.sha256()
    for source in kernel_sources(Path(inspect.getfile(kernel_module(kernel_name)))):
        h.update(str(source.relative_to(root)).encode() + b"\0" + source.read_bytes())
    h.update(json.dumps({"config": config, "arch": arch, "tilelang": tilelang.__version__,
                         "format": LOWERING_FORMAT}, sort_keys=True).encode())
    return h.hexdigest()


def host_constants(kernel_name: str, config: dict) -> dict:
    """The integers of the kernel's layout its host side needs, for one config (``{}`` when
    its ``kernel.py`` defines no ``host_constants``)."""
    fn = getattr(kernel_module(kernel_name), "host_constants", None)
    return {k: int(v) for k, v in fn(**config).items()} if fn is not None else {}


def lower(kernel_name: str, config: dict, arch: str) -> LoweredKernel:
    import tilelang
    import tvm

    if arch not in ARCH_NAMES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCH_NAMES}")
    folder = op_folder(kernel_name)
    static = list(folder.schema.static)
    if sorted(static) != sorted(config):
        raise ValueError(f"{kernel_name}: config {config} does not match static params {static}")
    module = kernel_module(kernel_name)
    factory = getattr(module, folder.factory_name)
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    # The factory runs under the target too, so a kernel may specialize on the arch
    # (``tvm.target.Target.current()``).
    with tvm.transform.PassContext(config=dict(getattr(module, "PASS_CONFIGS", {}))), target:
        artifact = tilelang.lower(factory(**config), target=target)

    device_funcs = list(artifact.device_mod.functions.items())
    if len(device_funcs) != 1:
        raise ValueError(f"{kernel_name}: expected one device kernel, got {[str(g) for g, _ in device_funcs]}")
    gvar, dfunc = device_funcs[0]
    entry = str(dfunc.attrs["global_symbol"])
    params = [{"name": p.name, "kind": _param_kind(str(p.dtype))} for p in dfunc.params]
    launch_names = [str(n) for n in dfunc.attrs["tirx.kernel_launch_params"]]
    launch_args = _host_launch_args(artifact.host_mod, entry)[len(params):]
    if len(launch_args) != len(launch_names):
        raise ValueError(f"{kernel_name}: launch arguments {launch_args} do not match {launch_names}")
    geometry = dict(zip(launch_names, launch_args))
    grid = [to_cpp(geometry.get(f"blockIdx.{d}", 1)) for d in "xyz"]
    block = [int(geometry.get(f"threadIdx.{d}", 1)) for d in "xyz"]
    dyn_smem = to_cpp(geometry.get("tirx.use_dyn_shared_memory", 0))
    cluster = [int(geometry.get(f"tir.cluster_dim_{d}", 1)) for d in "xyz"]
    if cluster[0] * cluster[1] * cluster[2] > 8:  # the runtime launches portable cluster sizes only
        raise ValueError(f"{kernel_name}: a cluster of {cluster} blocks is above the portable 8")
    return LoweredKernel(
        kernel=kernel_name, config=dict(config), arch=arch, entry=entry, source=artifact.kernel_source,
        params=params, grid=grid, block=block, dyn_smem=dyn_smem, pdl="has_cuda_pdl_sync" in dfunc.attrs,
        cluster=cluster, cooperative="use_cooperative_groups" in dfunc.attrs,
    )


def _param_kind(dtype: str) -> str:
    kinds = {"handle": "ptr", "int32": "int32", "int64": "int64", "float32": "float32"}
    if dtype not in kinds:
        raise ValueError(f"unsupported kernel parameter dtype {dtype} (TMA descriptors are not supported)")
    return kinds[dtype]


def _host_launch_args(host_mod, entry: str) -> list:
    """The arguments of the host module's packed call to ``entry``: the kernel's
    parameters, then its launch geometry in ``tirx.kernel_launch_params`` order."""
    from tvm import tirx

    found = []

    def visit(node):
        if isinstance(node, tirx.Call) and node.op.name == "tirx.tvm_call_packed":
            if isinstance(node.args[0], tirx.StringImm) and node.args[0].value == entry:
                found.append(list(node.args[1:]))

    for _, func in host_mod.functions.items():
        tirx.stmt_functor.post_order_visit(func.body, visit)
    if len(found) != 1:
        raise ValueError(f"expected one launch of {entry} in the host module, found {len(found)}")
    return found[0]


def to_cpp(expr) -> str:
    """Print an integer TIR expression as C++ over ``int64_t`` variables named
    like the kernel's dynamic variables (read from the launch arguments ``a``)."""
    from tvm import tirx

    if isinstance(expr, int):
        return str(expr)
    if isinstance(expr, tirx.IntImm):
        return str(int(expr.value))
    if isinstance(expr, tirx.Var):
        return expr.name
    if isinstance(expr, tirx.Cast):
        return to_cpp(expr.value)
    binary = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*"}
    for cls, op in binary.items():
        if isinstance(expr, cls):
            return f"({to_cpp(expr.a)} {op} {to_cpp(expr.b)})"
    calls = {tirx.FloorDiv: "floordiv", tirx.Div: "truncdiv", tirx.FloorMod: "floormod",
             tirx.Mod: "truncmod", tirx.Min: "std::min<int64_t>", tirx.Max: "std::max<int64_t>"}
    for cls, fn in calls.items():
        if isinstance(expr, cls):
            return f"{fn}({to_cpp(expr.a)}, {to_cpp(expr.b)})"
    raise ValueError(f"cannot print launch expression {expr!r} ({type(expr).__name__})")
