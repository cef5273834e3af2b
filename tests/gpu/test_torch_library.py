"""The ops as torch custom ops on the GPU: ``torch.library.opcheck`` of every op over its samples
(both forms), the custom ops' outputs against the C functions' (layout and bits), and the MoE
block of ``tile_kernels_aot.serving_block`` under ``torch.compile`` (fullgraph, inductor),
``mode="reduce-overhead"`` (CUDA graphs) and ``torch.export``: bit-identical to eager, one
compile for every token count."""

import pytest
import torch

import tile_kernels_aot as tk
from tile_kernels_aot import custom_ops, samples, serving_block

from checks import assert_bits_equal
from ops import OPS, clone_arg, in_place, kernel_function, mutable_names, outputs_by_name, qualname

BLOCK_OPS = {"moe.topk_gate", "moe.normalize_weight", "quant.per_token_cast",
             "quant.swiglu_forward_and_per_token_cast", "transpose.transpose"}
# every token count the block is compiled for once: decode batch sizes to a prefill chunk
TOKEN_COUNTS = (1, 2, 3, 64, 100, 257, 1000, 4096, 8192)


def _prebuilt():
    return [pytest.param(r, s, id=f"{qualname(r)}[{s['name']}]")
            for r in OPS for s in r["samples"] if samples.is_prebuilt(r, s)]


def _call(record, sample, gen):
    tokens = samples.token_counts(record, min(sample["tokens"], 256))[0]
    args, kwargs = samples.make_args(sample, tokens, gen)
    values, _ = custom_ops.custom_op_arguments(qualname(record), args, kwargs)
    return args, kwargs, values


def _as_list(result):
    return [] if result is None else list(result) if isinstance(result, tuple) else [result]


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _produces_nan(op, values, outs) -> bool:
    result = op(*values, **outs)
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() and bool(t.isnan().any())
               for t in results + list(outs.values()))


def _aot_dispatch_bits(op, values):
    """What opcheck's AOT-dispatch test checks, compared bit for bit (NaN == NaN): the op
    compiled through AOTAutograd with dynamic shapes gives the eager op's outputs."""
    torch._dynamo.reset()
    compiled = torch.compile(op, backend="aot_eager", dynamic=True, fullgraph=True)
    expected, got = _as_list(op(*values)), _as_list(compiled(*values))
    for e, g in zip(expected, got):
        if isinstance(e, torch.Tensor):
            assert_bits_equal(g, e, f"{op} under AOT dispatch")


def _opcheck(op, values, outs, record):
    """opcheck, except for two of its tests.  Its schema test (SchemaCheckMode) cannot compare
    float8 tensors (it multiplies them): with a float8 tensor in the call, that test is
    replaced by a direct check that the op writes no tensor but the mutable ones and the
    outputs, bit for bit.  Its AOT-dispatch test compares outputs with NaN != NaN: for a call
    whose outputs hold NaN (NaN codes decoded, as the reference does), it is replaced by the
    same comparison bit for bit (functional form; the out= form keeps the other tests)."""
    utils = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    tensors = [v for v in values if isinstance(v, torch.Tensor)] + list(outs.values())
    float8 = any(t.dtype in FLOAT8 for t in tensors)
    if float8:
        utils.remove("test_schema")
    if _produces_nan(op, values, outs):
        utils.remove("test_aot_dispatch_dynamic")
        if not outs:
            _aot_dispatch_bits(op, values)
    torch.library.opcheck(op, tuple(values), outs, test_utils=tuple(utils))
    if not float8:
        return
    mutable = {n for n, text, _ in custom_ops.torch_params(record) if "!" in text}
    names = [n for n, _, _ in custom_ops.torch_params(record)]
    before = {n: v.clone() for n, v in zip(names, values) if isinstance(v, torch.Tensor) and n not in mutable}
    op(*values, **outs)
    for n, v in zip(names, values):
        if n in before:
            assert_bits_equal(v, before[n], f"{op}: input {n} was written")


@pytest.mark.parametrize("record,sample", _prebuilt())
def test_opcheck(record, sample, gen):
    """Schema (mutations and aliasing as declared), fake tensors against the real kernel,
    autograd registration, and AOT dispatch with dynamic shapes, for both forms."""
    _, _, values = _call(record, sample, gen)
    ops = torch.ops.tile_kernels_aot
    functional = getattr(ops, record["name"]).default
    _opcheck(functional, values, {}, record)
    made = _as_list(functional(*values))
    by_name = dict(zip(custom_ops.flat_returns(record["returns"]), made))  # the op returns them flat
    if record["outs"] and all(by_name.get(o["name"]) is not None for o in record["outs"]):
        # (a call that leaves an optional output out has no out= form to check)
        outs = {o["name"]: torch.empty_strided(by_name[o["name"]].shape, by_name[o["name"]].stride(),
                                               dtype=by_name[o["name"]].dtype, device="cuda")
                for o in record["outs"]}
        _opcheck(getattr(ops, record["name"] + "_out").default, values, outs, record)


@pytest.mark.parametrize("record,sample", _prebuilt())
def test_custom_op_matches_the_c_function(record, sample, gen):
    """The custom op allocates from the schema's declarations; the C function from host.h's
    outputs(): the same shapes, strides and dtypes, and the same bits."""
    args, kwargs, values = _call(record, sample, gen)
    op = getattr(torch.ops.tile_kernels_aot, record["name"])
    direct = outputs_by_name(record, kernel_function(record)(*args, **kwargs))
    if in_place(record):  # the effect on clones of the mutable tensors
        mutable = mutable_names(record)
        names = [n for n, _, _ in custom_ops.torch_params(record)]
        values = [clone_arg(v) if n in mutable else v for n, v in zip(names, values)]
        op(*values)
        # named as the C function's side names them (a tensor list's tensors as name[k])
        through = outputs_by_name(record, tuple(v for n, v in zip(names, values) if n in mutable))
    else:
        # the custom op returns its outputs flat (a nested pair of the C function's result
        # is two of them); an optional output left out is None on both sides
        flat = dict(zip(custom_ops.flat_returns(record["returns"]), _as_list(op(*values))))
        through = {n: t for n, t in flat.items() if t is not None}
    assert set(direct) == set(through)
    for name, tensor in direct.items():
        assert (through[name].shape, through[name].dtype) == (tensor.shape, tensor.dtype)
        if tensor.numel() > 1:
            assert through[name].stride() == tensor.stride(), f"{qualname(record)} {name}"
        assert_bits_equal(through[name], tensor, f"{qualname(record)} {name}")


def _block_or_skip():
    missing = BLOCK_OPS - {qualname(r) for r in OPS}
    if missing:
        pytest.skip(f"the block needs {sorted(missing)}")
    w_gate, w_up = serving_block.weights()
    try:
        serving_block.moe_block(tk, serving_block.tokens(64), w_gate, w_up)
    except ValueError as e:
        if "no prebuilt kernel" in str(e):
            pytest.skip(f"the block's configs are not in this build: {e}")
        raise
    return w_gate, w_up


def _assert_block_equal(got, expected, what):
    assert len(got) == len(expected)
    for k, (g, e) in enumerate(zip(got, expected)):
        assert_bits_equal(g, e, f"{what}: output {k}")


def _unbacked(num_tokens):
    """Tokens whose count the compiler treats as unknown (no 0/1 specialization), as servers
    mark their batch dim."""
    from torch._dynamo.decorators import mark_unbacked

    x = serving_block.tokens(num_tokens, seed=num_tokens)
    mark_unbacked(x, 0)
    return x


def test_compiled_block_is_bit_identical_with_one_compile_for_all_token_counts():
    from torch._dynamo.testing import CompileCounterWithBackend

    w_gate, w_up = _block_or_skip()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda x: serving_block.moe_block(tk, x, w_gate, w_up), fullgraph=True, backend=counter)
    for n in TOKEN_COUNTS:
        x = _unbacked(n)
        _assert_block_equal(compiled(x), serving_block.moe_block(tk, x, w_gate, w_up), f"compiled, {n} tokens")
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for token counts {TOKEN_COUNTS}"
    called = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {f"tile_kernels_aot.{q.split('.')[1]}.default" for q in BLOCK_OPS} <= called


def test_reduce_overhead_replays_cuda_graphs_bit_identical():
    from torch._dynamo.utils import counters

    w_gate, w_up = _block_or_skip()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x: serving_block.moe_block(tk, x, w_gate, w_up), fullgraph=True,
                             mode="reduce-overhead")
    for n in (64, 256, 1000, 64, 4096):
        x = _unbacked(n)
        expected = serving_block.moe_block(tk, x, w_gate, w_up)
        for replay in range(3):  # warm-up, record, replays
            got = [t.clone() for t in compiled(x)]
            _assert_block_equal(got, expected, f"reduce-overhead, {n} tokens, call {replay}")
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_out_tensors_under_compile():
    """out= buffers given inside a compiled function are written in place (the out form)."""
    if "quant.per_token_cast" not in {qualname(r) for r in OPS}:
        pytest.skip("needs quant.per_token_cast")
    torch._dynamo.reset()

    def cast_into(x, out, out_sf):
        return tk.quant.per_token_cast(x, "e4m3", 128, out=out, out_sf=out_sf)

    compiled = torch.compile(cast_into, fullgraph=True)
    x = serving_block.tokens(300)
    expected = tk.quant.per_token_cast(x, "e4m3", 128)
    out, out_sf = torch.empty_like(expected[0]), torch.full_like(expected[1], float("nan"))
    result = compiled(x, out, out_sf)
    assert result[0] is out and result[1] is out_sf
    _assert_block_equal([out, out_sf], list(expected), "out= under torch.compile")


def test_wrapped_public_functions_compile_fullgraph():
    """A public function that wraps its kernel op (a dtype default's signature, the no-sync
    mapping) traces under torch.compile into one graph and gives the eager bits."""
    ids = {qualname(r) for r in OPS}
    cases = []
    if "quant.unpack_from_e2m1fn_x2" in ids:
        packed = torch.randint(-128, 128, (300, 512), dtype=torch.int8, device="cuda")
        cases.append((lambda x: tk.quant.unpack_from_e2m1fn_x2(x, torch.bfloat16), packed))
    if "moe.get_fused_mapping" in ids:
        topk_idx = torch.randint(-1, 64, (200, 6), dtype=torch.int64, device="cuda")
        cases.append((lambda i: tk.moe.get_fused_mapping(i, 64, 200 * 6 + 64 * 15, 16)[:7], topk_idx))
    if not cases:
        pytest.skip("no wrapped op in this build")
    for fn, x in cases:
        torch._dynamo.reset()
        expected, got = _as_list(fn(x)), _as_list(torch.compile(fn, fullgraph=True, backend="aot_eager")(x))
        _assert_block_equal(got, expected, "a wrapped public function under torch.compile")


def test_export_runs_bit_identical():
    w_gate, w_up = _block_or_skip()

    class Block(torch.nn.Module):
        def forward(self, x):
            return serving_block.moe_block(tk, x, w_gate, w_up)

    exported = torch.export.export(Block(), (serving_block.tokens(128),),
                                   dynamic_shapes=({0: torch.export.Dim("T", min=1, max=16384)},))
    called = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert {f"tile_kernels_aot.{q.split('.')[1]}.default" for q in BLOCK_OPS} <= called
    module = exported.module()
    for n in (1, 77, 640):
        x = serving_block.tokens(n, seed=n)
        _assert_block_equal(module(x), serving_block.moe_block(tk, x, w_gate, w_up), f"exported, {n} tokens")


def test_readme_server_example_runs():
    """The README's "Using it in a server" example, as written."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Using it in a server", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    if "quant.per_token_cast" not in {qualname(r) for r in OPS}:
        pytest.skip("needs quant.per_token_cast")
    torch._dynamo.reset()
    scope = {}
    exec(compile(code, "README.md (Using it in a server)", "exec"), scope)
    idx, x_q, x_sf = scope["idx"], scope["x_q"], scope["x_sf"]
    x = scope["x"]
    assert_bits_equal(idx, tk.moe.topk_gate(x.float() @ scope["w_gate"], 8), "README example: idx")
    expected = tk.quant.per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True, round_sf=True,
                                       use_packed_ue8m0=True)
    assert_bits_equal(x_q, expected[0], "README example: x_q")
    assert_bits_equal(x_sf, expected[1], "README example: x_sf")
