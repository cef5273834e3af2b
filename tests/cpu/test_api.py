"""The installed package on a machine without a GPU: imports without a driver or
TileLang, keeps TileKernels' signatures, lists its contents, and rejects bad input
with an exception naming the op and the argument before anything is launched."""

import hashlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

tka = pytest.importorskip("tile_kernels_aot._C", reason="the extension is not installed")

from tile_kernels_aot import manifest, moe, quant, transpose  # noqa: E402

from aot.cubin import cubin_arch, has_ptx  # noqa: E402
from aot.table import load_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# TileKernels 1.0.0's public signatures (inspect.signature, annotations dropped).
UPSTREAM = {
    "moe.topk_gate": "(scores, num_topk)",
    "quant.per_token_cast": "(x, fmt, num_per_channels, x_block_size=None, use_tma_aligned_col_major_sf=False, round_sf=False, use_packed_ue8m0=False)",
    "quant.per_token_cast_with_sf_only": "(x, fmt, num_per_channels, x_block_size=None, use_tma_aligned_col_major_sf=False, round_sf=False, use_packed_ue8m0=False)",
    "quant.per_token_cast_with_precomputed_sf": "(x, fmt, num_per_channels, sf, x_block_size=None, use_tma_aligned_col_major_sf=False, round_sf=False, use_packed_ue8m0=False)",
    "quant.swiglu_forward_and_per_token_cast": "(x, fmt, num_per_channels, pos_to_token_topk=None, topk_weights=None, pos_to_expert=None, use_tma_aligned_col_major_sf=False, round_sf=False, use_packed_ue8m0=False, swiglu_clamp_value=None, clamped_count=None, sf_clamp_min=None)",
    "transpose.transpose": "(x)",
    "transpose.batched_transpose": "(x)",
}
MODULES = {"moe": moe, "quant": quant, "transpose": transpose}


@pytest.mark.parametrize("op", sorted(UPSTREAM))
def test_signature_starts_with_upstream_and_adds_keyword_only(op):
    module, name = op.split(".")
    sig = inspect.signature(getattr(MODULES[module], name))
    params = list(sig.parameters.values())
    upstream = inspect.signature(eval(f"lambda {UPSTREAM[op][1:-1]}: None"))
    n = len(upstream.parameters)
    ours = sig.replace(parameters=params[:n])
    assert str(ours) == str(upstream), f"{op}: {ours} != {upstream}"
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[n:]), f"{op}: extra params must be keyword-only"


def test_every_op_of_the_manifest_is_exported():
    for record in manifest.load()["ops"]:
        assert callable(getattr(MODULES[record["module"]], record["name"]))


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
    _raises(ValueError, r"moe.topk_gate: no prebuilt kernel for num_experts=100.*python -m aot build",
            moe.topk_gate, torch.randn(4, 100), 2)
    _raises(ValueError, r"moe.topk_gate: scores must be a CUDA tensor", moe.topk_gate, s, 2)
    x = torch.randn(4, 2048).bfloat16()
    _raises(ValueError, r"quant.per_token_cast: fmt must be one of", quant.per_token_cast, x, "e9m9", 128)
    _raises(ValueError, r"quant.per_token_cast: x_block_size is not supported", quant.per_token_cast, x, "e4m3", 128, (1, 128))
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
