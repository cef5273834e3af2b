"""The installed package on a machine without a GPU: imports without a driver or
TileLang, keeps TileKernels' signatures, lists its contents, and rejects bad input
with an exception naming the op and the argument before anything is launched."""

import hashlib
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

tka = pytest.importorskip("tile_kernels_aot._C", reason="the extension is not installed")

from tile_kernels_aot import manifest, moe, quant, samples, transpose  # noqa: E402

from aot.cubin import cubin_arch, has_ptx  # noqa: E402
from aot.table import load_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

OPS = manifest.ops()
IDS = [f"{r['module']}.{r['name']}" for r in OPS]


@pytest.mark.parametrize("record", OPS, ids=IDS)
def test_signature_is_the_references_plus_keyword_only_outputs(record):
    """The public function takes its reference's parameters (upstream's: tests/oracle checks
    the references against TileKernels 1.0.0), in order, with their defaults, then only
    keyword-only additions (the out= tensors; an output upstream takes positionally, like
    reduce_fused's ``out``, is among the reference's parameters)."""
    ours = list(inspect.signature(samples.function(record)).parameters.values())
    ref = list(inspect.signature(samples.reference(record)).parameters.values())
    strip = lambda ps: [(p.name, p.kind, p.default) for p in ps]  # noqa: E731
    assert strip(ours[: len(ref)]) == strip(ref), f"{ours} != {ref}"
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(ref):])
    positional = [o["name"] for o in record["outs"] if o.get("positional", False)]
    assert [p.name for p in ref[len(record["params"]):]] == positional
    assert [p.name for p in ours[len(ref):]] == [o["name"] for o in record["outs"] if o["name"] not in positional]


@pytest.mark.parametrize("record", OPS, ids=IDS)
def test_every_op_has_samples_a_reference_and_a_prebuilt_config(record):
    """A schema without samples or reference, or an op no config of this build serves, fails
    here: every table this package ships builds at least one config each op's samples use, and
    the shipped (default) table serves every sample."""
    assert record["samples"], "no samples"
    assert callable(samples.reference(record))
    assert any(s["name"] == "decode" and s["tokens"] == 128 for s in record["samples"]) or record["token_dim"] is None, \
        "no decode sample (128 tokens)"
    served = [s["name"] for s in record["samples"] if samples.is_prebuilt(record, s)]
    assert served, "no sample is served by this build"
    if manifest.load()["table"] == "default.toml":
        assert len(served) == len(record["samples"]), f"samples the default table does not build: {served}"


def test_every_family_with_ops_is_public_and_imports():
    import tile_kernels_aot

    families = sorted({r["module"] for r in OPS})
    assert [f for f in tile_kernels_aot.__all__ if f != "torch"] == families
    for family in tile_kernels_aot.__all__:
        module = importlib.import_module(f"tile_kernels_aot.{family}")
        if family != "torch":
            assert sorted(module.__all__) == sorted(r["name"] for r in OPS if r["module"] == family)
    for missing in {"engram", "mhc"} - set(families):
        with pytest.raises(ImportError):
            importlib.import_module(f"tile_kernels_aot.{missing}")


def test_manifest_is_complete_and_cubins_are_sass_only():
    m = manifest.load()
    table = ROOT / "aot" / "shapes" / m["table"]
    assert table.exists(), f"the bundle was built from {m['table']}, which is not in aot/shapes"
    expected = load_table(table)
    kernel_dir = manifest.MANIFEST_PATH.parent / "kernels"
    assert set(m["archs"]) == {"sm_90a", "sm_100a"}
    assert manifest.configs("moe.no_such_kernel") == []
    for kernel, configs in expected.items():
        assert manifest.configs(kernel) == configs, f"{kernel}: manifest configs differ from {table.name}"
        for c in m["kernels"][kernel]["configs"]:
            assert set(c["builds"]) == set(m["archs"]), f"{kernel} {c['key']}: archs {set(c['builds'])}"
            for arch, b in c["builds"].items():
                assert b["pdl"], f"{kernel} {c['key']} {arch}: every kernel waits for the previous grid (PDL)"
                data = (kernel_dir / b["cubin"]).read_bytes()
                assert hashlib.sha256(data).hexdigest() == b["sha256"]
                assert cubin_arch(data) == arch and not has_ptx(data), b["cubin"]


def test_import_needs_no_gpu_driver_or_tilelang():
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('tilelang', 'tvm', 'tvm_ffi'): raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import tile_kernels_aot as tk\n"
        "for m in ('moe', 'quant', 'transpose', 'torch', 'modeling'): getattr(tk, m)\n"
        "import torch\n"
        "try:\n"
        "    tk.moe.topk_gate(torch.randn(2, 256), 2)\n"
        "except ValueError as e:\n"
        "    assert 'CUDA' in str(e), e\n"
        "tk.empty_cache()  # nothing kept, no driver needed\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                            env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_info_lists_ops_configs_and_toolchain():
    out = subprocess.run([sys.executable, "-m", "tile_kernels_aot", "info"], capture_output=True, text=True, check=True).stdout
    assert "moe.topk_gate(scores, num_topk, *, out=None)" in out
    assert "nvcc" in out and "sm_90a" in out and "sm_100a" in out


def _raises(exc, pattern, fn, *args, **kwargs):
    with pytest.raises(exc, match=pattern):
        fn(*args, **kwargs)


def test_bad_input_is_rejected_before_launch():
    s = torch.randn(4, 256)
    _raises(TypeError, r"moe.topk_gate: scores must have dtype torch.float32", moe.topk_gate, s.double(), 2)
    _raises(ValueError, r"moe.topk_gate: scores must be 2-D", moe.topk_gate, s[0], 2)
    _raises(ValueError, r"moe.topk_gate: scores must be contiguous", moe.topk_gate, s[:, ::2], 2)
    _raises(ValueError, r"moe.topk_gate: num_topk", moe.topk_gate, s, 0)
    _raises(TypeError, r"moe.topk_gate: scores must be a torch.Tensor", moe.topk_gate, [1.0], 2)
    _raises(TypeError, r"moe.topk_gate: num_topk must be an int", moe.topk_gate, s, 2.5)
    _raises(TypeError, r"moe.topk_gate: got an unexpected keyword argument 'k'", moe.topk_gate, s, k=2)
    _raises(TypeError, r"moe.topk_gate: missing required argument 'num_topk'", moe.topk_gate, s)
    # topk_gate's size classes: an expert count past the largest is refused by name; one in a
    # class this build lacks (the default wheel has them all) reports the missing class
    _raises(ValueError, r"moe.topk_gate: scores must have 1 to 512 experts \(scores.shape\[1\]\), got 513",
            moe.topk_gate, torch.randn(4, 513), 2)
    # (strides (0, 1): the runtime's layout check takes torch's (1, 1) for a [4, 0] tensor as not contiguous)
    _raises(ValueError, r"moe.topk_gate: scores must have 1 to 512 experts", moe.topk_gate,
            torch.empty_strided((4, 0), (0, 1)), 1)
    built = {c["max_experts"] for c in manifest.configs("moe.topk_gate")}
    missing = [m for m in range(32, 513, 32) if m not in built]
    if missing:
        _raises(ValueError, rf"moe.topk_gate: no prebuilt kernel for max_experts={missing[0]}.*python -m aot build",
                moe.topk_gate, torch.randn(4, missing[0] - 5), 2)
    _raises(ValueError, r"moe.topk_gate: scores must be a CUDA tensor", moe.topk_gate, s, 2)
    x = torch.randn(4, 2048).bfloat16()
    _raises(ValueError, r"quant.per_token_cast: fmt must be one of", quant.per_token_cast, x, "e9m9", 128)
    _raises(ValueError, r"quant.per_token_cast: x_block_size is only meaningful for a pre-quantized", quant.per_token_cast, x, "e4m3", 128, (1, 128))
    _raises(TypeError, r"quant.per_token_cast: x must have dtype", quant.per_token_cast, x.half(), "e4m3", 128)
    _raises(ValueError, r"transpose.transpose: x must be 2-D", transpose.transpose, torch.randn(64, 64, 64))


def test_keywords_match_by_name_whatever_string_object_spells_them():
    """Keywords are matched by identity with the interned names first, then by text: a
    keyword string built at run time (not interned) names the same parameter."""
    s = torch.randn(4, 256)
    runtime_name = "".join(["num_", "topk"])
    assert runtime_name == "num_topk" and runtime_name is not sys.intern("num_topk")
    # accepted: the call gets as far as the device check
    for kwargs in ({"num_topk": 2}, {runtime_name: 2}):
        _raises(ValueError, r"moe.topk_gate: scores must be a CUDA tensor", moe.topk_gate, s, **kwargs)
    _raises(ValueError, r"moe.topk_gate: scores must be a CUDA tensor", moe.topk_gate,
            **{"".join(["sco", "res"]): s, "num_topk": 2})
    _raises(TypeError, r"moe.topk_gate: got multiple values for argument 'scores'", moe.topk_gate, s, 2, scores=s)
    _raises(TypeError, r"moe.topk_gate: got multiple values for argument 'num_topk'", moe.topk_gate, s, 2,
            **{runtime_name: 2})
    _raises(TypeError, r"moe.topk_gate: got an unexpected keyword argument 'num_top'", moe.topk_gate, s,
            **{runtime_name[:-1]: 2})
    x = torch.randn(4, 2048).bfloat16()
    for out in ("out", "".join(["o", "ut"])):  # a keyword-only output, by either spelling
        _raises(ValueError, r"quant.per_token_cast: x must be a CUDA tensor", quant.per_token_cast, x, "e4m3", 128,
                **{out: torch.empty(4, 2048)})
    _raises(TypeError, r"quant.per_token_cast: got an unexpected keyword argument 'outs'", quant.per_token_cast, x,
            "e4m3", 128, outs=None)


def test_a_wrapped_op_is_exported_as_its_wrapper_over_the_kernel_op():
    """moe.get_fused_mapping's public function is the Python wrapper its schema names; the kernel
    op (the C function, the custom op's) keeps the same signature and checks the arguments."""
    if "moe.get_fused_mapping" not in IDS:
        pytest.skip("no get_fused_mapping in this build")
    from tile_kernels_aot import _C, wrappers

    record = manifest.op("moe.get_fused_mapping")
    assert record["wrapper"] == "tile_kernels_aot.wrappers.get_fused_mapping"
    assert moe.get_fused_mapping is wrappers.get_fused_mapping
    assert samples.kernel_function(record) is _C.moe.get_fused_mapping
    assert inspect.signature(moe.get_fused_mapping) == inspect.signature(_C.moe.get_fused_mapping)
    assert "get_fused_mapping" in moe.__all__
    idx = torch.zeros(4, 8, dtype=torch.int64)
    op = "moe.get_fused_mapping"
    # every mode reaches the C function's checks (on CPU tensors: the device check last)
    for rows, force in ((0, False), (0, True), (64, False)):
        _raises(ValueError, rf"{op}: topk_idx must be a CUDA tensor", moe.get_fused_mapping, idx, 8, rows, 16, force)
    _raises(ValueError, rf"{op}: num_experts must be in \[0, 1024\]", moe.get_fused_mapping, idx, 1025, 0, 16)
    _raises(ValueError, rf"{op}: alignment must be in \[1, ", moe.get_fused_mapping, idx, 8, 0, 0)
    _raises(ValueError, rf"{op}: num_expanded_tokens must be in \[0, ", moe.get_fused_mapping, idx, 8, -1, 16)
    _raises(ValueError, rf"{op}: num_expanded_tokens must be in \[0, ", moe.get_fused_mapping, idx, 8, 2**31, 16)
    _raises(ValueError, rf"{op}: alignment is too large", moe.get_fused_mapping, idx, 8, 0, 2**30)
    _raises(TypeError, rf"{op}: num_expanded_tokens must be an int", moe.get_fused_mapping, idx, 8, 1.5, 16)
    _raises(TypeError, rf"{op}: got multiple values for argument 'alignment'", moe.get_fused_mapping, idx, 8, 0, 16,
            alignment=16)


def test_get_fused_mapping_wrapper_modes(monkeypatch):
    """The wrapper's result per mode, over a stand-in kernel op (the device is not needed):
    without a sync (rows given, or force_no_sync) the kernel op's seven tensors and an empty
    list, for rows passed by position or keyword; in sync mode the row outputs trimmed to the
    sum of the aligned counts and the counts as a list; given row outputs are returned whole."""
    if "moe.get_fused_mapping" not in IDS:
        pytest.skip("no get_fused_mapping in this build")
    from tile_kernels_aot import _C, wrappers

    calls = []

    def kernel_op(*args, **kwargs):
        calls.append((args, kwargs))
        rows = args[2] if len(args) > 2 else kwargs.get("num_expanded_tokens", 0)
        rows = rows or 12  # sync mode: the most rows the layout can need
        return (torch.arange(rows), torch.arange(rows), torch.arange(rows), torch.zeros(2, 2),
                torch.zeros(3), torch.zeros(3), torch.tensor([4, 0, 4]))

    monkeypatch.setattr(_C.moe, "get_fused_mapping", kernel_op)
    idx = torch.zeros(2, 2, dtype=torch.int64)
    for args, kwargs, rows in (((idx, 3, 10, 4), {}, 10), ((idx, 3), {"num_expanded_tokens": 10, "alignment": 4}, 10),
                               ((idx, 3, 0, 4, True), {}, 12), ((idx, 3, 0, 4), {"force_no_sync": True}, 12)):
        calls.clear()
        result = wrappers.get_fused_mapping(*args, **kwargs)
        assert isinstance(result, tuple) and len(result) == 8 and result[7] == []
        assert len(calls) == 1 and calls[0][0] is not None and len(calls[0][0]) == len(args)
        assert calls[0][1] == kwargs  # the arguments reach the kernel op unchanged
        assert result[0].shape[0] == rows
    result = wrappers.get_fused_mapping(idx, 3, 0, 4)
    assert len(result) == 8 and result[7] == [4, 0, 4]
    assert [t.shape[0] for t in result[:3]] == [8, 8, 8]
    given = torch.empty(9)
    result = wrappers.get_fused_mapping(idx, 3, 0, 4, pos_to_expert=given)
    assert calls[-1][1]["force_no_sync"] is True and calls[-1][0][2] == 9  # a no-sync launch over the given rows
    assert result[0].shape[0] == 9 and result[7] == [4, 0, 4]


def test_unpack_from_e2m1fn_x2_takes_leading_dims_and_a_torch_dtype():
    """quant.unpack_from_e2m1fn_x2: the public function is a thin wrapper carrying the
    reference's signature (a torch.dtype default) over the kernel op; any rank >= 1 and
    leading dims that flatten into rows pass every check up to the device's."""
    if "quant.unpack_from_e2m1fn_x2" not in IDS:
        pytest.skip("no unpack_from_e2m1fn_x2 in this build")
    from tile_kernels_aot import _C

    op = "quant.unpack_from_e2m1fn_x2"
    fn = quant.unpack_from_e2m1fn_x2
    kernel_op = samples.kernel_function(manifest.op(op))
    assert kernel_op is _C.quant.unpack_from_e2m1fn_x2 and fn is not kernel_op
    assert str(inspect.signature(fn)) == "(x, out_dtype=torch.float32, *, out=None)"
    x = torch.zeros(4, 6, 8, dtype=torch.int8)
    for call in (lambda: fn(x), lambda: fn(x[0, 0]), lambda: fn(x.view(torch.uint8), torch.bfloat16),
                 lambda: fn(x, out_dtype=torch.float16), lambda: fn(x[:, ::2]), lambda: fn(x[:, :, :5]),
                 lambda: fn(x[0, 0].expand(5, 8)), lambda: kernel_op(x), lambda: fn(x, torch.float32, out=None)):
        _raises(ValueError, rf"{op}: x must be a CUDA tensor", call)
    _raises(ValueError, rf"{op}: x must be at least 1-D, got 0-D", fn, x[0, 0, 0])
    for view in (x.transpose(0, 1), x.expand(3, 4, 6, 8)):
        _raises(ValueError, rf"{op}: x must have leading dims that flatten into rows of one stride", fn, view)
    _raises(ValueError, rf"{op}: x must have a unit stride in its last dim", fn, x[:, :, ::2])
    _raises(TypeError, rf"{op}: x must have dtype torch.int8 or torch.uint8, got torch.int32", fn, x.int())
    _raises(TypeError, rf"{op}: out_dtype must be a torch.dtype .*, got str", fn, x, "float32")
    _raises(TypeError, rf"{op}: out_dtype must be a torch.dtype .*, got int", fn, x, out_dtype=6)
    _raises(ValueError, rf"{op}: out_dtype must be one of torch.float32, torch.bfloat16, torch.float16, got torch.float64",
            fn, x, torch.float64)
    _raises(TypeError, rf"{op}: got multiple values for argument 'out_dtype'", fn, x, torch.float32,
            out_dtype=torch.float32)
    _raises(TypeError, rf"{op}: got an unexpected keyword argument 'dtype'", fn, x, dtype=torch.float32)
