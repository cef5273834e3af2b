"""Calls of the ops as their schemas' samples describe them (bench, tests, sanitizer script).

A sample is plain data from the op folder's ``schema.py`` (recorded in the manifest): positional
and keyword arguments where tensors are described by kind (``randn``, ``randint``, ``rand``),
shape (``"T"`` standing for the token count, ``"T/n"`` for ``ceil(T / n)``, ``"P"`` for the
rows of the sample's fused MoE layout), dtype and layout, or as one tensor of the sample's routing
(``routed``); a list holding tensors is drawn as a tuple (a quantized ``(data, sf)`` pair).
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


def reference(record: dict):
    return resolve(record["reference"])


def _is_tensor_spec(value) -> bool:
    return isinstance(value, dict) and value.get("kind") in ("randn", "randint", "rand", "routed")


def fused_rows(routing: dict, tokens: int) -> int:
    """Rows of a routing's fused layout at ``tokens`` tokens: the most it can need."""
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
        return {f: torch.empty(shape, dtype=dtype, device=device) for f, (shape, dtype) in shapes.items()}
    from tile_kernels_aot.torch.moe import get_fused_mapping

    # distinct experts per token: the k smallest of uniform draws
    topk_idx = torch.rand(tokens, experts, generator=gen, device=device).topk(k, dim=1, largest=False).indices
    if routing["unrouted"] > 0:
        dropped = torch.rand(tokens, k, generator=gen, device=device) < routing["unrouted"]
        topk_idx = topk_idx.masked_fill(dropped, -1)
    topk_idx = topk_idx.contiguous()
    mapping = get_fused_mapping(topk_idx, experts, rows, routing["alignment"], force_no_sync=True)
    return {"topk_idx": topk_idx, **dict(zip(_MAPPING_FIELDS, mapping))}


def _extent(d, extents: dict) -> int:
    """One extent of a sample shape: an int, ``"T"``, ``"P"``, or ``"T/n"`` (``ceil(T / n)``)."""
    if isinstance(d, str) and "/" in d:
        name, n = d.split("/")
        return -(-extents[name] // int(n))
    return extents[d] if d in extents else int(d)


def _empty(shape, dtype, device, layout):
    """An uninitialised tensor of ``shape`` in ``layout`` (``"row"`` or ``"tma_col"``)."""
    if layout == "tma_col":  # column-major, the row dim padded to 4 (strides (1, align(rows, 4)))
        rows, cols = shape
        return torch.empty((cols, -(-rows // 4) * 4), dtype=dtype, device=device).t()[:rows]
    return torch.empty(shape, dtype=dtype, device=device)


def _tensor(spec: dict, tokens: int, gen, device, empty: bool, routed: dict):
    if spec["kind"] == "routed":
        return routed[spec["field"]].clone()
    extents = {"T": tokens, "P": routed.get("rows")}
    shape = [_extent(d, extents) for d in spec["shape"]]
    dtype = getattr(torch, spec["dtype"])
    view = getattr(torch, spec["view"]) if spec.get("view") else dtype  # randint: the bits reinterpreted
    out_shape = shape[:-1] + [shape[-1] * dtype.itemsize // view.itemsize] if shape else shape
    layout = spec.get("layout", "row")
    out = _empty(out_shape, view, device, layout)
    if empty:  # shapes, dtypes and strides only (argument checks, config lookup)
        return out
    if spec["kind"] == "randint":
        values = torch.randint(spec["low"], spec["high"], shape, generator=gen, device=device, dtype=dtype).view(view)
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
        routed["rows"] = fused_rows(sample["routing"], tokens)

    def value(v):
        if isinstance(v, (list, tuple)) and any(_is_tensor_spec(e) for e in v):  # a (data, sf) pair
            return tuple(value(e) for e in v)
        return _tensor(v, tokens, gen, device, empty, routed) if _is_tensor_spec(v) else v

    return [value(v) for v in sample["args"]], {k: value(v) for k, v in sample["kwargs"].items()}


def outputs_by_name(record: dict, result) -> dict:
    """``{out name: tensor}`` of a call's result (a tensor, a tuple, or None)."""
    returned = result if isinstance(result, tuple) else (result,) if result is not None else ()
    return dict(zip(record["returns"], returned))


def bytes_moved(record: dict, args: list, kwargs: dict, outs: dict) -> int:
    """The bytes one launch must move: the schema's formula over the call's tensors by name,
    or every tensor argument read once and every output written once."""
    names = [p["name"] for p in record["params"]]
    tensors = {}
    for name, v in list(zip(names, args)) + list(kwargs.items()):
        if isinstance(v, torch.Tensor):
            tensors[name] = v
        elif isinstance(v, tuple) and len(v) == 2 and all(isinstance(t, torch.Tensor) for t in v):
            tensors[name], tensors[name + "_sf"] = v  # a quantized (data, sf) pair
    tensors.update(outs)
    if record["bytes"]:
        return int(eval(record["bytes"], {"__builtins__": {}}, {k: v for k, v in tensors.items()}))
    return sum(t.nbytes for t in tensors.values() if t is not None)


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
