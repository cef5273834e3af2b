"""Calls of the ops as their schemas' samples describe them (bench, tests, sanitizer script).

A sample is plain data from the op folder's ``schema.py`` (recorded in the manifest): positional
and keyword arguments where tensors are described by kind (``randn``, ``randint``, ``rand``),
shape (``"T"`` standing for the token count, ``"T/<n>"`` for ``ceil(T / n)``, ``"P"`` for the rows
of the sample's fused MoE layout), dtype and layout (``"row"``, or ``"tma_col"``: TMA-aligned
column-major), ``randint`` bits optionally viewed as another dtype, ``exp2`` powers of two, or as one
tensor of the sample's routing (``routed``); a list of tensors (``tensors``); a pre-quantized
``(data, sf)`` pair as a list of two tensor specs or as ``quantized`` (the reference ``per_block_cast`` of a normal tensor), and sizes
that follow the token count as expressions over ``T`` and ``P`` (``extent``).
"""

from __future__ import annotations

import importlib

import torch


def resolve(dotted: str):
    """``'tile_kernels_aot.torch.moe.topk_gate'`` -> the function."""
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def function(record: dict):
    """The public function of an op record."""
    return resolve(f"tile_kernels_aot.{record['module']}.{record['name']}")


def kernel_function(record: dict):
    """The generated C function of an op record: the public function itself, or for an op whose
    public function is a Python wrapper (``wrapper`` in its schema) the kernel op it wraps."""
    from tile_kernels_aot import _C

    return getattr(getattr(_C, record["module"]), record["name"])


def reference(record: dict):
    return resolve(record["reference"])


def _is_tensor_spec(value) -> bool:
    return isinstance(value, dict) and value.get("kind") in ("randn", "randint", "rand", "exp2", "routed",
                                                              "quantized")


def fused_rows(routing: dict, tokens: int) -> int:
    """The most rows a routing's fused layout can need at ``tokens`` tokens."""
    return tokens * routing["num_topk"] + routing["num_experts"] * (routing["alignment"] - 1)


_MAPPING_FIELDS = ("pos_to_expert", "pos_to_token", "pos_to_token_topk", "token_topk_to_pos",
                   "expert_start", "expert_end", "num_tokens_per_expert")


def _routing_tensors(routing: dict, tokens: int, gen, device, empty: bool) -> dict:
    """``{field: tensor}`` of one draw of ``routing`` (schema ``Routing``) at ``tokens`` tokens."""
    k, experts, rows = routing["num_topk"], routing["num_experts"], fused_rows(routing, tokens)
    if empty:
        shapes = {"topk_idx": ([tokens, k], torch.int64), "token_topk_to_pos": ([tokens, k], torch.int32),
                  **{f: ([rows], torch.int32) for f in _MAPPING_FIELDS[:3]},
                  **{f: ([experts], torch.int32) for f in _MAPPING_FIELDS[4:]}}
        return {**{f: torch.empty(shape, dtype=dtype, device=device) for f, (shape, dtype) in shapes.items()},
                "rows": rows}
    from tile_kernels_aot.torch.moe import get_fused_mapping

    # distinct experts per token: the k smallest of uniform draws over every rank's experts
    drawn = experts * routing.get("ep_ranks", 1)
    topk_idx = torch.rand(tokens, drawn, generator=gen, device=device).topk(k, dim=1, largest=False).indices
    dropped = topk_idx >= experts
    if routing["unrouted"] > 0:
        dropped |= torch.rand(tokens, k, generator=gen, device=device) < routing["unrouted"]
    topk_idx = topk_idx.masked_fill(dropped, -1)
    topk_idx = topk_idx.contiguous()
    mapping = get_fused_mapping(topk_idx, experts, 0 if routing.get("exact") else rows, routing["alignment"])
    return {"topk_idx": topk_idx, **dict(zip(_MAPPING_FIELDS, mapping)), "rows": mapping[0].shape[0]}


def _quantized_pair(spec: dict, shape: list, gen, device, empty: bool) -> tuple:
    """``(data, sf)``: the reference per_block_cast of a normal bf16 tensor (of zeros when
    only shapes matter)."""
    from tile_kernels_aot.torch.quant import per_block_cast

    x = torch.zeros(shape, device=device) if empty else torch.randn(shape, generator=gen, device=device)
    return per_block_cast(x.to(torch.bfloat16), spec["fmt"], tuple(spec["block"]),
                          use_tma_aligned_col_major_sf=spec["use_tma_aligned_col_major_sf"],
                          round_sf=spec["round_sf"], use_packed_ue8m0=spec["use_packed_ue8m0"])


def _extent(d, tokens: int, routed: dict) -> int:
    """A shape entry: an int, ``"T"`` (tokens), ``"P"`` (fused rows), or ``"T/<n>"``: ``ceil(tokens / n)``
    (e.g. the rows of a per-block factor grid)."""
    if d == "T":
        return tokens
    if d == "P":
        return routed.get("rows")
    if isinstance(d, str) and d.startswith("T/"):
        return -(-tokens // int(d[2:]))
    return int(d)


def _empty(shape, dtype, device, layout):
    """An uninitialised tensor of ``shape`` in ``layout`` (``"row"`` or ``"tma_col"``)."""
    if layout == "tma_col":  # column-major, the row dim padded to 4 (strides (1, align(rows, 4)))
        rows, cols = shape
        return torch.empty((cols, -(-rows // 4) * 4), dtype=dtype, device=device).t()[:rows]
    return torch.empty(shape, dtype=dtype, device=device)


def _tensor(spec: dict, tokens: int, gen, device, empty: bool, routed: dict):
    if spec["kind"] == "routed":
        return routed[spec["field"]].clone()
    shape = [_extent(d, tokens, routed) for d in spec["shape"]]
    if spec["kind"] == "quantized":
        return _quantized_pair(spec, shape, gen, device, empty)
    dtype = getattr(torch, spec["dtype"])
    view = getattr(torch, spec["view"]) if spec.get("view") else dtype  # randint: the bits reinterpreted
    out_shape = shape[:-1] + [shape[-1] * dtype.itemsize // view.itemsize] if shape else shape
    layout = spec.get("layout", "row")
    out = _empty(out_shape, view, device, layout)
    if empty:  # shapes, dtypes and strides only (argument checks, config lookup)
        return out
    if spec["kind"] == "randint":
        values = torch.randint(spec["low"], spec["high"], shape, generator=gen, device=device, dtype=dtype).view(view)
    elif spec["kind"] == "exp2":
        n = torch.randint(spec["low"], spec["high"], shape, generator=gen, device=device, dtype=torch.int32)
        values = torch.exp2(n.to(torch.float32)).to(dtype)
    else:
        base = torch.randn(shape, generator=gen, device=device) if spec["kind"] == "randn" else \
            torch.rand(shape, generator=gen, device=device) * (spec["high"] - spec["low"]) + spec["low"]
        values = base.to(dtype)
    if layout == "row":
        return values
    return out.copy_(values)


def make_args(sample: dict, tokens: int = None, gen=None, device="cuda", empty: bool = False):
    """``(args, kwargs)`` of one call of ``sample`` at ``tokens`` tokens (default: the sample's),
    drawn from ``gen`` (a generator on ``device``)."""
    tokens = sample["tokens"] if tokens is None else tokens
    routed = {}
    if sample.get("routing"):
        routed = _routing_tensors(sample["routing"], tokens, gen, device, empty)

    def value(v):
        if isinstance(v, dict) and v.get("kind") == "extent":
            return int(eval(v["expr"], {"__builtins__": {}}, {"T": tokens, "P": routed.get("rows")}))
        if isinstance(v, dict) and v.get("kind") == "torch_dtype":
            return getattr(torch, v["name"])
        if isinstance(v, dict) and v.get("kind") == "tensors":
            return [value(e) for e in v["items"]]  # a tensor list
        if isinstance(v, (list, tuple)) and v and all(_is_tensor_spec(e) for e in v):
            return tuple(value(e) for e in v)  # a (data, sf) pair
        if isinstance(v, list) and all(isinstance(e, int) for e in v):
            return tuple(v)  # an int tuple (block sizes): the manifest's JSON stores it as a list
        return _tensor(v, tokens, gen, device, empty, routed) if _is_tensor_spec(v) else v

    return [value(v) for v in sample["args"]], {k: value(v) for k, v in sample["kwargs"].items()}


def _flatten(returns, returned) -> list:
    pairs = []
    for r, v in zip(returns, returned):
        pairs += _flatten(r, v) if isinstance(r, (list, tuple)) else [(r, v)]
    return pairs


def outputs_by_name(record: dict, result) -> dict:
    """``{out name: tensor}`` of a call's result (a tensor, a tuple, or None; a list entry of
    ``returns`` is a nested tuple, e.g. a ``(data, sf)`` pair)."""
    returned = result if isinstance(result, tuple) else (result,) if result is not None else ()
    return dict(_flatten(record["returns"], returned))


def bytes_moved(record: dict, args: list, kwargs: dict, outs: dict) -> int:
    """The bytes one launch must move: the schema's formula over the call's tensors by name (a
    tensor list as a list), or every tensor argument (each tensor of a list) read once and every
    output written once."""
    names = [p["name"] for p in record["params"]]
    # every tensor parameter by name (None when not given); a (data, sf) pair as <name>, <name>_sf
    scope = {}
    for p in record["params"]:
        if p["type"]["kind"] in ("tensor", "quantized"):
            scope[p["name"]] = None
        if p["type"]["kind"] == "quantized":
            scope[p["name"] + "_sf"] = None
    for name, v in list(zip(names, args)) + list(kwargs.items()):
        if isinstance(v, tuple) and len(v) == 2 and all(isinstance(t, torch.Tensor) for t in v):
            scope[name], scope[name + "_sf"] = v
        elif isinstance(v, torch.Tensor):
            scope[name] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in v):
            scope[name] = list(v)  # a tensor list
    scope.update(outs)
    if record["bytes"]:
        return int(eval(record["bytes"], {"__builtins__": {}}, scope))
    tensors = [t for v in scope.values() for t in (v if isinstance(v, list) else [v])]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def token_counts(record: dict, *wanted: int) -> list:
    """Token counts near ``wanted`` that the op accepts (multiples of its ``token_multiple``)."""
    m = record.get("token_multiple", 1)
    return [max(m, -(-n // m) * m) if n > 0 else 0 for n in wanted]


def is_prebuilt(record: dict, sample: dict) -> bool:
    """Whether this build has the kernel config ``sample`` needs.  Asked without a GPU: the
    stub looks the config up before it looks at devices, so a call on empty CPU tensors
    stops either at the lookup or at the device check."""
    args, kwargs = make_args(sample, token_counts(record, 64)[0], device="cpu", empty=True)
    try:
        function(record)(*args, **kwargs)
    except ValueError as e:
        return "no prebuilt kernel" not in str(e)
    return True
