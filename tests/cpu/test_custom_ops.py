"""The torch.library registration without a GPU: every op of the build is a custom op with the
schema its parameters declare; its fake tensors agree with the PyTorch reference run on CPU
tensors (shapes, dtypes, strides), with the token dim symbolic; torch.compile and torch.export
trace the public functions into the custom ops; the dynamo rules arrive with torch._dynamo."""

import subprocess
import sys
import textwrap

import pytest
import torch

from tile_kernels_aot import samples

try:
    from tile_kernels_aot import _C, custom_ops, manifest
    OPS = manifest.ops()
except ImportError:  # no extension in this environment
    OPS = []

pytestmark = pytest.mark.skipif(not OPS, reason="needs the installed extension")


def qualname(record) -> str:
    return f"{record['module']}.{record['name']}"


def _op_params():
    return [pytest.param(r, id=qualname(r)) for r in OPS]


def _sample_params():
    return [pytest.param(r, s, id=f"{qualname(r)}[{s['name']}]") for r in OPS for s in r["samples"]]


def _cpu_call(record, sample, tokens=None):
    """Arguments of ``sample`` as CPU tensors at a small token count."""
    tokens = samples.token_counts(record, min(sample["tokens"], 96) if tokens is None else tokens)[0]
    return samples.make_args(sample, tokens, torch.Generator().manual_seed(0), device="cpu")


def _meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, tuple):
        return tuple(_meta(v) for v in value)
    if isinstance(value, list):  # a tensor list
        return [_meta(v) for v in value]
    return value


def _layout(t):
    return (tuple(t.shape), tuple(t.stride()) if t.numel() > 1 else None, t.dtype)


@pytest.mark.parametrize("record", _op_params())
def test_every_op_is_a_custom_op_with_its_declared_schema(record):
    ops = torch.ops.tile_kernels_aot
    functional = getattr(ops, record["name"]).default._schema
    expected = [n for n, _, _ in custom_ops.torch_params(record)]
    assert [a.name for a in functional.arguments] == expected
    # a Dtype parameter is a ScalarType; where the dispatcher leaves its default out, the
    # kernel gets the torch.dtype
    defaults = dict(zip(expected, custom_ops._defaults(record)))
    for p in record["params"]:
        if p["type"]["kind"] == "dtype":
            assert f"ScalarType {p['name']}" in str(functional)
            assert p["default"] == "<required>" or defaults[p["name"]] is getattr(torch, p["default"])
    assert len(functional.returns) == len(custom_ops.flat_returns(record["returns"]))
    if not record["outs"]:  # an in-place op has no out form
        assert not hasattr(ops, record["name"] + "_out")
        forms = [functional]
    else:
        out_form = getattr(ops, record["name"] + "_out").default._schema
        forms = [functional, out_form]
        # out= tensors are keyword-only, and the out form returns nothing
        assert [a.name for a in out_form.arguments if a.kwarg_only] == [o["name"] for o in record["outs"]]
        assert len(out_form.returns) == 0
    # tensors the op updates in place are annotated as written, in both forms
    mutable = {p["name"] for p in record["params"]
               if p["type"]["kind"] in ("tensor", "tensor_list") and p["type"]["mutable"]}
    for schema in forms:
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        outs = {o["name"] for o in record["outs"]} if schema is not functional else set()
        assert written == mutable | outs, str(schema)


@pytest.mark.parametrize("record,sample", _sample_params())
def test_fake_outputs_match_the_reference_on_cpu(record, sample):
    """The Meta kernel (the schema's output declarations) against the reference's outputs."""
    if sample["host_sync"]:
        pytest.skip("the call waits for the device: its output sizes depend on the data")
    args, kwargs = _cpu_call(record, sample)
    expected = samples.outputs_by_name(record, samples.reference(record)(*args, **kwargs))
    fake = samples.outputs_by_name(record, custom_ops.torch_call(qualname(record))(
        *[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()}))
    assert set(fake) == set(expected)
    for name, tensor in fake.items():
        if tensor is None:  # an optional output the call leaves out
            assert expected[name] is None, f"{qualname(record)} {name}"
            continue
        assert tensor.device.type == "meta"
        assert _layout(tensor) == _layout(expected[name]), f"{qualname(record)} {name}"


@pytest.mark.parametrize("record,sample", _sample_params())
def test_tracing_keeps_the_token_dim_symbolic(record, sample):
    """make_fx with symbolic shapes hands fake tensors to the C function, which passes the call
    to the custom op: one graph node, outputs sized by the symbolic token count."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if sample["host_sync"]:
        pytest.skip("the call waits for the device: its output sizes depend on the data")
    args, kwargs = _cpu_call(record, sample)
    # tensor arguments, a (data, sf) pair's two tensors and a tensor list's tensors each traced
    # too: (position, index in the pair or list)
    positions = [(i, j) for i, a in enumerate(args)
                 for j in ([None] if isinstance(a, torch.Tensor) else range(len(a)) if isinstance(a, (tuple, list))
                           else [])]
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]

    def call(*tensors):
        full, named = list(args), dict(kwargs)
        for (i, j), t in zip(positions, tensors):
            full[i] = t if j is None else type(full[i])(t if k == j else v for k, v in enumerate(full[i]))
        named.update(zip(keys, tensors[len(positions):]))
        return samples.function(record)(*full, **named)

    traced = [args[i] if j is None else args[i][j] for i, j in positions]
    graph = make_fx(call, tracing_mode="symbolic")(*traced, *[kwargs[k] for k in keys])
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert getattr(torch.ops.tile_kernels_aot, record["name"]).default in targets, graph.code
    if record["token_dim"] is None or not positions or not record["returns"]:
        return
    outputs = [n for n in graph.graph.nodes if n.op == "output"][0].args[0]
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    outputs = [n for o in outputs for n in (o if isinstance(o, (tuple, list)) else [o])]  # nested pairs
    token_sized = [o.meta["val"] for o in outputs if o is not None and o.meta["val"].dim() > 0]
    assert any(isinstance(v.shape[0], torch.SymInt) and not v.shape[0].node.is_constant() for v in token_sized)


def test_out_tensors_through_the_torch_path():
    """Given out= tensors reach the out form (all given) or are filled by a copy (some given)."""
    record = next((r for r in OPS if len(r["outs"]) == 2), None)
    if record is None:
        pytest.skip("no op with two outputs in this build")
    sample = record["samples"][0]
    args, kwargs = _cpu_call(record, sample)
    args, kwargs = [_meta(a) for a in args], {k: _meta(v) for k, v in kwargs.items()}
    call = custom_ops.torch_call(qualname(record))
    made = call(*args, **kwargs)
    given = {o["name"]: torch.empty_like(t) for o, t in zip(record["outs"], made)}
    result = call(*args, **kwargs, **given)
    assert all(r is given[n] for r, n in zip(result, custom_ops.flat_returns(record["returns"])))
    first = record["outs"][0]["name"]
    result = call(*args, **kwargs, **{first: given[first]})
    assert result[0] is given[first] and _layout(result[1]) == _layout(made[1])


def test_out_form_stages_outputs_whose_padded_layout_a_clone_compacted():
    """Functionalization (torch.compile of a call with out=) hands the out form clones of the
    given outputs, and a clone of TMA-aligned column-major factors (rows padded to 4) is dense:
    the out form then lets the op write a temporary of its own layout and copies it over. A
    given output of the op's layout, or of another shape (the C function's error), is not."""
    record = next((r for r in OPS if qualname(r) == "quant.per_block_cast"), None)
    if record is None:
        pytest.skip("no quant.per_block_cast in this build")
    sample = next(s for s in record["samples"] if s["kwargs"].get("use_tma_aligned_col_major_sf")
                  or "TMA" in s["name"] or "packed" in s["name"])
    args, kwargs = _cpu_call(record, sample, tokens=200)  # 2 rows of 128-token blocks: padded to 4
    names = [n for n, _, _ in custom_ops.torch_params(record)]
    values = dict(zip(names, custom_ops.custom_op_arguments(qualname(record), args, kwargs)[0]))
    declarations = custom_ops.OutputDeclarations(record)
    layout = {name: (dtype, shape, strides) for name, dtype, shape, strides in declarations.evaluate(values)}
    dtype, shape, strides = layout["out_sf"]
    assert strides is not None and strides[1] > shape[0], "the sample's factors are not padded"
    own = torch.empty_strided(shape, strides, dtype=dtype)
    compacted = own.clone()
    assert compacted.stride() != own.stride()
    staged = custom_ops._staged_outputs(declarations, values, {"out_sf": compacted})
    assert set(staged) == {"out_sf"} and staged["out_sf"][0] is compacted
    assert staged["out_sf"][1].stride() == own.stride() and staged["out_sf"][1].shape == own.shape
    assert custom_ops._staged_outputs(declarations, values, {"out_sf": own}) == {}
    wrong = torch.empty(shape[0] + 1, shape[1], dtype=dtype)
    assert custom_ops._staged_outputs(declarations, values, {"out_sf": wrong}) == {}


def test_compile_puts_the_ops_in_one_graph_for_every_token_count():
    """torch.compile(fullgraph=True) over meta tensors: no graph break, one compile for token
    counts 1..8192 (the token dim unbacked, as servers mark it)."""
    from torch._dynamo.decorators import mark_unbacked

    needed = {"moe.topk_gate", "moe.normalize_weight", "quant.per_token_cast"}
    if not needed <= {qualname(r) for r in OPS}:
        pytest.skip("needs topk_gate, normalize_weight and per_token_cast")
    import tile_kernels_aot as tk

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, w):
        scores = x.float() @ w
        idx = tk.moe.topk_gate(scores, 8)
        denominator, weights = tk.moe.normalize_weight(scores.gather(1, idx).abs() + 1)
        q, sf = tk.quant.per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True, round_sf=True,
                                        use_packed_ue8m0=True)
        return idx, denominator, weights, q, sf

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    w = torch.empty(7168, 256, device="meta")
    for tokens in (1, 2, 3, 64, 1000, 8192):
        x = torch.empty(tokens, 7168, device="meta", dtype=torch.bfloat16)
        mark_unbacked(x, 0)
        idx, denominator, weights, q, sf = compiled(x, w)
        assert idx.shape == (tokens, 8) and q.shape == (tokens, 7168) and q.dtype == torch.float8_e4m3fn
        assert sf.shape == (tokens, 14) and sf.stride() == (1, max(-(-tokens // 4) * 4, 1)) and sf.dtype == torch.int32
    assert len(graphs) == 1
    called = {n.target for n in graphs[0].graph.nodes if n.op == "call_function"}
    ops = torch.ops.tile_kernels_aot
    assert {ops.topk_gate.default, ops.normalize_weight.default, ops.per_token_cast.default} <= called


def test_export_records_the_custom_ops():
    if "moe.topk_gate" not in {qualname(r) for r in OPS}:
        pytest.skip("needs topk_gate")
    import tile_kernels_aot as tk

    class Gate(torch.nn.Module):
        def forward(self, scores):
            return tk.moe.topk_gate(scores * 2, 8)

    exported = torch.export.export(Gate(), (torch.randn(33, 256),), dynamic_shapes=({0: torch.export.Dim("T")},))
    called = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert torch.ops.tile_kernels_aot.topk_gate.default in called


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("dynamo_first", [False, True], ids=["package-first", "dynamo-first"])
def test_dynamo_rules_arrive_with_dynamo_and_the_import_stays_light(dynamo_first):
    out = _run(f"""
        import sys
        import torch
        {'import torch._dynamo' if dynamo_first else ''}
        import tile_kernels_aot as tk
        print("dynamo imported by the package:", {not dynamo_first} and "torch._dynamo" in sys.modules)
        import torch._dynamo
        from torch._dynamo.variables import PolyfilledFunctionVariable
        handlers = PolyfilledFunctionVariable._get_polyfill_handlers()
        from tile_kernels_aot import manifest, samples
        missing = [r["name"] for r in manifest.ops() if samples.kernel_function(r) not in handlers]
        print("missing rules:", missing)
    """)
    assert "dynamo imported by the package: False" in out
    assert "missing rules: []" in out


def test_a_subclass_tensor_takes_the_torch_path_and_plain_tensors_do_not():
    """A C function given a tensor subclass calls the custom op (here on meta tensors inside
    a subclass); a plain CPU tensor stops at the C function's device check."""
    if "moe.topk_gate" not in {qualname(r) for r in OPS}:
        pytest.skip("needs topk_gate")
    import tile_kernels_aot as tk

    class Tagged(torch.Tensor):
        pass

    scores = torch.randn(5, 256, device="meta").as_subclass(Tagged)
    assert tk.moe.topk_gate(scores, 4).shape == (5, 4)
    with pytest.raises(ValueError, match="moe.topk_gate"):
        tk.moe.topk_gate(torch.randn(5, 256), 4)
