"""Each stage of the AOT pipeline on its own: table, lowering, cubin compile (cache,
reproducibility, SASS-only), stub generation (the generated C++ compiles)."""

import subprocess
import sysconfig
from pathlib import Path

import pytest

from aot.table import config_key, load_table

ROOT = Path(__file__).resolve().parents[2]


def test_table_is_a_cartesian_product_without_duplicates(tmp_path):
    table = tmp_path / "t.toml"
    table.write_text(
        '[[kernel]]\nname = "moe.topk_gate"\nnum_experts = [72, 256]\n\n'
        '[[kernel]]\nname = "moe.topk_gate"\nnum_experts = 256\n\n'
        '[[kernel]]\nname = "transpose.batched_transpose"\ndtype = ["bfloat16", "float32"]\nflag = [true, false]\n'
    )
    t = load_table(table)
    assert t["moe.topk_gate"] == [{"num_experts": 72}, {"num_experts": 256}]
    assert len(t["transpose.batched_transpose"]) == 4
    assert config_key({"b": True, "a": 3}) == "a=3,b=true"


def test_op_folders_are_discovered_from_the_tree():
    from kernels_tl.folders import op_folders

    folders = op_folders()
    names = [f.kernel for f in folders]
    assert names == sorted(names)
    assert {"moe.topk_gate", "quant.per_token_cast", "quant.swiglu_forward_and_per_token_cast",
            "transpose.batched_transpose"} <= set(names)
    for folder in folders:
        assert (folder.path / "kernel.py").exists() and (folder.path / "host.h").exists()
        assert folder.factory_name in (folder.path / "kernel.py").read_text()
        for op in folder.schema.ops:
            assert op.samples and op.reference.startswith("tile_kernels_aot.torch.")


def test_shipped_tables_name_known_kernels_and_valid_params():
    from kernels_tl.folders import op_folders

    static = {f.kernel: set(f.schema.static) for f in op_folders()}
    for path in (ROOT / "aot" / "shapes").glob("*.toml"):
        for kernel, configs in load_table(path).items():
            assert kernel in static, f"{path.name}: unknown kernel {kernel}"
            for cfg in configs:
                assert set(cfg) == static[kernel], f"{path.name}: {kernel} {cfg} != static params {static[kernel]}"


def test_ci_table_builds_every_kernel():
    from kernels_tl.folders import op_folders

    table = load_table(ROOT / "aot" / "shapes" / "ci.toml")
    assert [f.kernel for f in op_folders() if not table.get(f.kernel)] == []


def test_launch_expressions_print_as_cpp():
    pytest.importorskip("tilelang")  # brings its TVM onto the path
    from tvm import tirx

    from aot.lower import to_cpp

    n = tirx.Var("num_tokens", "int32")
    expr = tirx.FloorDiv(n + 7, tirx.IntImm("int32", 8))
    assert to_cpp(expr) == "floordiv((num_tokens + 7), 8)"
    assert to_cpp(tirx.Max(n, tirx.IntImm("int32", 1))) == "std::max<int64_t>(num_tokens, 1)"


@pytest.fixture(scope="module")
def lowered():
    pytest.importorskip("tilelang")
    from aot.lower import lower

    return lower("moe.topk_gate", {"max_experts": 256}, "sm_90a")


def test_lowering_gives_entry_params_and_geometry(lowered):
    names = {p["name"]: p["kind"] for p in lowered.params}
    assert names["scores"] == "ptr" and names["topk_idx"] == "ptr"
    assert names["num_tokens"] == "int32"
    assert "num_tokens" in lowered.grid[0]
    assert lowered.block[0] > 0 and lowered.entry in lowered.source
    # it waits for the previous grid before touching memory, so it may launch as its dependent
    assert lowered.pdl and "cudaGridDependencySynchronize()" in lowered.source


def test_cubin_is_cached_reproducible_and_sass_only(lowered, tmp_path, monkeypatch):
    from aot import compile as cc
    from aot.cubin import cubin_arch, has_ptx

    first = cc.compile_cubin(lowered.source, "sm_90a", tmp_path / "a").read_bytes()
    second = cc.compile_cubin(lowered.source, "sm_90a", tmp_path / "b").read_bytes()
    assert first == second, "two compiles of one source differ"
    assert cubin_arch(first) == "sm_90a" and not has_ptx(first)

    def no_nvcc(*args, **kwargs):
        raise AssertionError("nvcc ran on a cache hit")

    monkeypatch.setattr(cc.subprocess, "run", no_nvcc)
    assert cc.compile_cubin(lowered.source, "sm_90a", tmp_path / "a").read_bytes() == first


def test_generated_stub_compiles(lowered, tmp_path):
    """The generated stub, with the op folder's host.h, compiles warning-free (-Wall -Werror)."""
    from aot import lower, stubgen
    from aot.manifest import kernel_build_record
    from kernels_tl.folders import op_folder

    folder = op_folder("moe.topk_gate")
    record = kernel_build_record(lowered, "sm_90a/x.cubin", b"\0")
    unit = {"configs": [{"config": lowered.config, "key": config_key(lowered.config),
                         "constants": lower.host_constants("moe.topk_gate", lowered.config), "builds": {"sm_90a": record}}]}
    _assert_stubs_compile(stubgen.write_stubs(tmp_path, [(folder.kernel, folder.schema, unit, folder.path)]), tmp_path)


def test_stub_of_a_folder_the_table_leaves_out_compiles(tmp_path):
    """A table that lists none of an op folder's configs (a model's own table): the folder's
    stub compiles without its host.h (whose kernel arguments were never lowered) and its ops
    refuse every call as not prebuilt."""
    from aot import stubgen
    from kernels_tl.folders import op_folder

    folder = op_folder("engram.engram_gate_fwd")
    paths = stubgen.write_stubs(tmp_path, [(folder.kernel, folder.schema, {"configs": []}, folder.path)])
    unit = paths[0].read_text()
    # each op refuses twice: its Python entry point and its run (for other folders' host sides)
    assert "host.h" not in unit and unit.count("not_prebuilt(op,") == 2 * len(folder.schema.ops)
    _assert_stubs_compile(paths, tmp_path)


def _assert_stubs_compile(paths, stub_dir):
    includes = [f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc' / 'third_party'}", f"-I{stub_dir / 'include'}",
                f"-I{sysconfig.get_paths()['include']}"]
    for path in paths:
        result = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", *includes, str(path)],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]



def test_cluster_shape_reaches_the_launch(lowered, tmp_path):
    """A kernel built for thread-block clusters: the stub's geometry carries its cluster shape
    (the launch sets it as an attribute), and a kernel without clusters gets {1, 1, 1}."""
    import dataclasses

    from aot import stubgen
    from aot.manifest import kernel_build_record

    assert lowered.cluster == [1, 1, 1]
    for cluster in ([1, 1, 1], [8, 1, 1]):
        record = kernel_build_record(dataclasses.replace(lowered, cluster=cluster), "sm_90a/x.cubin", b"\0")
        assert record["cluster"] == cluster
        text = stubgen._launcher("launch_0", record, "moe.topk_gate")
        assert f"{lowered.dyn_smem}, {{{', '.join(map(str, cluster))}}}}};" in text


def test_grid_synchronizing_kernel_is_launched_cooperatively(lowered):
    """A kernel that synchronizes its grid (``T.sync_grid()``) lowers as cooperative, and its
    stub's kernel entry says so (the launch then sets the cooperative attribute); others do not."""
    import dataclasses

    from aot import stubgen
    from aot.lower import lower
    from aot.manifest import kernel_build_record

    assert not lowered.cooperative
    assert lower("moe.get_fused_mapping", {"path": "cooperative"}, "sm_90a").cooperative
    assert not lower("moe.get_fused_mapping", {"path": "blocks"}, "sm_90a").cooperative
    for cooperative in (False, True):
        record = kernel_build_record(dataclasses.replace(lowered, cooperative=cooperative), "sm_90a/x.cubin", b"\0")
        assert record["cooperative"] is cooperative
        text = stubgen._launcher("launch_0", record, "moe.topk_gate")
        assert f", true, {'true' if cooperative else 'false'}}};" in text


@pytest.mark.parametrize("kernel, config", [
    ("mhc.mhc_pre_norm_fn", {"cluster": 8, "tile_tokens": 128}),
    ("mhc.mhc_pre_norm_fn_bwd", {"cluster": 2})])
def test_installed_cluster_kernel_records_its_cluster(kernel, config):
    """A cluster kernel (its config's ``cluster`` blocks per cluster): the installed manifest says
    so for every arch, so the launch sets the cluster shape, and its grid is a multiple of the
    cluster."""
    manifest = pytest.importorskip("tile_kernels_aot.manifest")
    try:
        kernels = manifest.load()["kernels"]
    except FileNotFoundError:
        pytest.skip("no installed bundle")
    configs = [c for c in kernels.get(kernel, {}).get("configs", [])
               if all(c["config"].get(k) == v for k, v in config.items())]
    if not configs:
        pytest.skip(f"{kernel} {config} is not in this build")
    cluster = config["cluster"]
    for build in configs[0]["builds"].values():
        assert build["cluster"] == [cluster, 1, 1]
        assert build["grid"][0].endswith(f" * {cluster})") and build["grid"][1:] == ["1", "1"]


def test_readme_operator_table_is_current():
    from aot.docs import README, updated_readme

    text = README.read_text()
    assert updated_readme(text) == text, "README.md's operator table is out of date: run python -m aot docs"


def test_editing_one_kernel_relowers_only_that_kernel(monkeypatch):
    """A lowering's cache key covers its own kernel.py and the kernels_tl modules it imports
    (package __init__ files, shared and family modules, another kernel it builds on), not the
    other op folders, not a module it does not import, nor any schema.py or host.h: a warm
    rebuild after editing one kernel, or a module other kernels share, re-lowers the kernels
    that read it alone."""
    pytest.importorskip("tilelang")
    from aot import lower
    from kernels_tl.folders import op_folders

    for folder in op_folders():
        read = []
        original = Path.read_bytes

        def recording(self):
            read.append(self.resolve())
            return original(self)

        monkeypatch.setattr(Path, "read_bytes", recording)
        lower.lowering_key(folder.kernel, {}, "sm_90a")
        monkeypatch.setattr(Path, "read_bytes", original)
        in_kernels = {p for p in read if (ROOT / "kernels_tl") in p.parents}
        own = (folder.path / "kernel.py").resolve()
        assert own in in_kernels
        others = in_kernels - {own}
        # only what the kernel imports (shared modules, a family's helpers, another kernel it
        # builds on), never a schema
        assert others <= set(lower.kernel_sources(own)), others
        assert not any(p.name == "schema.py" for p in others)


def test_dtype_and_leading_dim_parameters_in_the_stub_and_the_torch_schema():
    """A Dtype parameter: shown with its torch.dtype default (so the C function carries no
    text signature CPython would misread), parsed by dtype_arg into a DType with the default's
    enum, a ScalarType in torch.library; a Tensor with leading dims is checked for its least rank."""
    from aot import stubgen
    from kernels_tl.schema import Dtype, Op, Out, Param, Schema, Tensor, to_json
    from tile_kernels_aot import custom_ops

    op = Op(module="quant", name="f", params=[Param("x", Tensor(["int8"], 2, leading=True)),
                                              Param("out_dtype", Dtype(["float32", "bfloat16"]), "bfloat16")],
            outs=[Out("out", dtype="out_dtype", shape="list(x.shape)")], returns=["out"], reference="", samples=[],
            doc="doc")
    assert stubgen.text_signature(op) == "f(x, out_dtype=torch.bfloat16, *, out=None)"
    assert not stubgen.has_text_signature(op)
    schema = Schema(static=(), ops=[op])
    unit = stubgen.generate_kernel_unit("quant.f", schema, {"configs": []}, "quant/f", "schema.py")
    assert "a.out_dtype = BF16;" in unit
    assert 'dtype_arg(op, "out_dtype", v[1], {F32, BF16}, &a.out_dtype)' in unit
    assert 'check_min_ndim(op, "x", a.x, 2)' in unit
    method = unit.split("PyMethodDef", 1)[1]
    assert r'"f(x, out_dtype=torch.bfloat16, *, out=None)\n\ndoc"' in method
    assert "DType out_dtype;" in stubgen.generate_args_header("quant.f", schema, {"configs": []}, "schema.py")
    record = {"module": "quant", "name": "f", "params": to_json(op.params)}
    assert custom_ops.torch_params(record) == [("x", "Tensor", None), ("out_dtype", "ScalarType", "bfloat16")]
    with pytest.raises(ValueError, match="default 'float16' is not among its choices"):
        bad = Op(**{**op.__dict__, "params": [op.params[0], Param("out_dtype", Dtype(["float32"]), "float16")]})
        stubgen.generate_kernel_unit("quant.f", Schema(static=(), ops=[bad]), {"configs": []}, "quant/f", "schema.py")


def test_tensor_list_parameters_and_chained_launches_in_the_stub_and_the_torch_schema():
    """A TensorList parameter: parsed by tensor_list_arg into a TensorListArg of its maximum
    length, each tensor checked like a Tensor and for the call's device; a mutable one is
    ``Tensor(a!)[]`` in torch.library.  An op with ``launches`` loops over the host side's
    launch count, passing the launch index to kernel_args."""
    from aot import stubgen
    from kernels_tl.schema import Op, Param, Schema, Tensor, TensorList, to_json
    from tile_kernels_aot import custom_ops

    op = Op(module="mhc", name="f", params=[Param("x", Tensor(["bfloat16"], 2)),
                                            Param("xs", TensorList(["float32"], 1, 8, leading=True)),
                                            Param("ys", TensorList(["bfloat16"], 2, 8, mutable=True))],
            outs=[], returns=[], reference="", samples=[], doc="doc", launches=True)
    schema = Schema(static=(), ops=[op])
    # one config (no builds): a folder the table lists none of would only refuse calls
    prebuilt = {"configs": [{"config": {}, "key": "", "constants": {}, "builds": {}}]}
    unit = stubgen.generate_kernel_unit("mhc.f", schema, prebuilt, "mhc/f", "schema.py")
    assert 'tensor_list_arg(op, "xs", v[1], 8, a.xs.items, &a.xs.size)' in unit
    assert 'check_min_ndim(op, "xs", a.xs.items[k], 1)' in unit and 'check_ndim(op, "ys", a.ys.items[k], 2)' in unit
    assert 'check_dtype(op, "ys", a.ys.items[k], {BF16})' in unit
    assert 'check_same_device(op, "ys", a.ys.items[k], device)' in unit
    assert "const int64_t launches = F::launches(p);" in unit and ", ka, j)) return false;" in unit
    assert "TensorListArg<8> xs;" in stubgen.generate_args_header("mhc.f", schema, {"configs": []}, "schema.py")
    record = {"module": "mhc", "name": "f", "params": to_json(op.params), "outs": [], "returns": []}
    params = custom_ops.torch_params(record)
    assert params == [("x", "Tensor", None), ("xs", "Tensor[]", None), ("ys", "Tensor(a!)[]", None)]
    assert custom_ops.schemas(record, params) == ("f(Tensor x, Tensor[] xs, Tensor(a!)[] ys) -> ()", None)
    single = stubgen.generate_kernel_unit("mhc.f", Schema(static=(), ops=[Op(**{**op.__dict__, "launches": False})]),
                                          prebuilt, "mhc/f", "schema.py")
    assert "F::launches" not in single and ", ka)) return false;" in single


def test_a_prologue_launching_another_folders_op_and_scratch_buffers_in_the_stub(tmp_path):
    """An op with ``prologue`` and ``scratch`` (``mhc.mhc_pre_big_fuse``: ``mhc_pre_norm_fn``'s kernel
    into a scratch buffer, then its own): the scratch buffer is allocated with the outputs (no caller's
    tensor, no parameter), the host side's prologue runs after kernel_args and before the launch, and
    the other folder's generated ``run`` (declared in its args.h, defined in its unit) links them; both
    units compile warning-free."""
    from aot import stubgen
    from kernels_tl.folders import op_folder

    def unit(params, grid):
        build = {"arch": "sm_90a", "block": [256, 1, 1], "cluster": [1, 1, 1], "cubin": "sm_90a/x.cubin",
                 "dyn_smem": "0", "entry": "k", "grid": grid, "pdl": True, "sha256": "0" * 64, "size": 1,
                 "params": [{"name": n, "kind": k} for n, k in params]}
        return build

    ptr, i32, i64, f32 = "ptr", "int32", "int64", "float32"
    norm = op_folder("mhc.mhc_pre_norm_fn")
    fused = op_folder("mhc.mhc_pre_big_fuse")
    norm_build = unit([("mhc_fn", ptr), ("mhc_norm_weight", ptr), ("out", ptr), ("residual", ptr), ("chunks", i32),
                       ("eps", f32), ("features", f32), ("has_weight", i32), ("num_tokens", i64)],
                      ["floordiv((num_tokens + 63), 64)", "1", "1"])
    fused_build = unit([("comb_mix", ptr), ("layer_input", ptr), ("mhc_base", ptr), ("mhc_scale", ptr), ("mixes", ptr),
                        ("post_mix", ptr), ("residual", ptr), ("eps", f32), ("mhc_post_mult_value", f32),
                        ("mhc_pre_eps", f32), ("num_tokens", i32), ("pieces", i32), ("repeat", i32)],
                       ["(floordiv(((num_tokens * pieces) + 255), 256) + floordiv((num_tokens + 15), 16))", "1", "1"])
    units = [
        (norm.kernel, norm.schema, {"configs": [{"config": {"mhc_mult": 4, "cluster": c, "tile_tokens": t, "splits": 1},
                                                 "key": f"cluster={c},mhc_mult=4,splits=1,tile_tokens={t}",
                                                 "constants": {"span": 1024, "tokens_per_block": t},
                                                 "builds": {"sm_90a": norm_build}} for c in (1, 2, 4, 8) for t in (64, 128)]},
         norm.path),
        (fused.kernel, fused.schema, {"configs": [{"config": {"mhc_mult": 4}, "key": "mhc_mult=4",
                                                   "constants": {"mix_tokens_per_block": 16, "threads": 256},
                                                   "builds": {"sm_90a": fused_build}}]}, fused.path),
    ]
    paths = stubgen.write_stubs(tmp_path, units)
    text = (tmp_path / "mhc_mhc_pre_big_fuse.cc").read_text()
    assert "PyObject* given[4] = {v[10], v[11], v[12], nullptr};" in text
    assert 'out_names[] = {"post_mix", "comb_mix", "layer_input", "mixes"}' in text
    assert "check_no_overlap(op, 3, out_names" in text
    body = text[text.index("static bool launch_op_mhc_mhc_pre_big_fuse"):]
    assert body.index("F::kernel_args(") < body.index("F::prologue(") < body.index("return launcher(")
    args_h = (tmp_path / "include" / "mhc" / "mhc_pre_norm_fn" / "args.h").read_text()
    assert "bool run(const char* op, const Args& a, const Outs& o, int device, void* stream);" in args_h
    assert "bool tka::mhc_mhc_pre_norm_fn::mhc_pre_norm_fn::run(" in (tmp_path / "mhc_mhc_pre_norm_fn.cc").read_text()
    assert stubgen.text_signature(fused.schema.ops[0]).endswith("*, post_mix=None, comb_mix=None, layer_input=None)")
    _assert_stubs_compile([p for p in paths if p.name.startswith("mhc_")], tmp_path)
