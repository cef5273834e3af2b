"""The routed path of one MoE layer with DeepSeek-V3-like dims (256 experts in 8 groups, top-4
groups, top-8, hidden 7168), built from the package's routing and quantization ops:

``moe.top2_sum_gate`` -> ``moe.get_fused_mapping`` (sized from the arguments, so it never
synchronizes) -> ``quant.per_token_cast`` -> ``moe.expand_to_fused_with_sf`` -> up-projection
stand-in -> ``quant.swiglu_forward_and_per_token_cast`` (routing weights applied, padding rows
skipped) -> down-projection stand-in -> ``moe.reduce_fused``.

The expert GEMMs are stand-ins: a dequantization of the fused rows through the reference
``cast_back``, the same on every path, so the layer's output depends only on the ops above.  The
path runs over this package, over the PyTorch references and over TileKernels; the GPU tests
check ours, captured in one CUDA graph, bit for bit against the references, and
``python -m tile_kernels_aot bench --layer`` times the graph beside TileKernels' ops.
"""

from __future__ import annotations

import functools
import statistics

import torch

from tile_kernels_aot.bench import capture_graph, graph_replay_us
# the PyTorch references arranged as the package's modules (moe, quant), as the layer calls them
from tile_kernels_aot.serving_block import references  # noqa: F401  (moe_layer.references())

HIDDEN = 7168
EXPERTS = 256
GROUPS = 8
TOPK_GROUPS = 4
TOP_K = 8
ALIGNMENT = 16  # rows per expert block of the fused layout
ROUTED_SCALING = 2.5


def fused_rows(num_tokens: int) -> int:
    """Rows of the fused layout sized from the arguments alone: the most the routing can need."""
    return num_tokens * TOP_K + EXPERTS * (ALIGNMENT - 1)


def weights(device="cuda", seed=0) -> tuple:
    """``(w_gate [HIDDEN, EXPERTS] fp32, bias [EXPERTS] fp32)``: the router."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w_gate = torch.randn(HIDDEN, EXPERTS, generator=gen, device=device) / HIDDEN ** 0.5
    bias = torch.randn(EXPERTS, generator=gen, device=device) * 0.1
    return w_gate, bias


def tokens(num_tokens: int, device="cuda", seed=1) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(num_tokens, HIDDEN, generator=gen, device=device).to(torch.bfloat16)


def _dequantize(data: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """The expert GEMM stand-in: per-token e4m3 rows (128-channel factors) back to bf16."""
    from tile_kernels_aot.torch.quant import cast_back

    return cast_back((data, sf), "bf16", (1, 128))


def routed_layer(lib, x: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, torch_work=None) -> dict:
    """The routed path over ``lib`` (a module with ``moe`` and ``quant``): x [T, HIDDEN] bf16 ->
    ``{name: tensor}`` of the routing, the fused activations, the torch work's results (``logits``,
    ``up``, ``down``) and the layer output ``out`` [T, HIDDEN // 2] bf16.  ``torch_work``: those
    three tensors of an earlier call, used instead of the router matmul and the two stand-ins (the
    ops alone)."""
    logits = x.float() @ w_gate if torch_work is None else torch_work["logits"]
    topk_idx, topk_weights = lib.moe.top2_sum_gate(
        logits, bias, TOP_K, TOPK_GROUPS, GROUPS, False, 0, ROUTED_SCALING, 0, 1, 0, 1, "sigmoid")
    pos_to_expert, _, pos_to_token_topk, token_topk_to_pos, *_ = lib.moe.get_fused_mapping(
        topk_idx, EXPERTS, fused_rows(x.shape[0]), ALIGNMENT)
    x_q, x_sf = lib.quant.per_token_cast(x, "e4m3", 128)
    fused_q, fused_sf = lib.moe.expand_to_fused_with_sf((x_q, x_sf), 128, token_topk_to_pos, pos_to_expert)
    up = _dequantize(fused_q, fused_sf) if torch_work is None else torch_work["up"]
    act_q, act_sf = lib.quant.swiglu_forward_and_per_token_cast(
        up, "e4m3", 128, pos_to_token_topk=pos_to_token_topk, topk_weights=topk_weights, pos_to_expert=pos_to_expert)
    down = _dequantize(act_q, act_sf) if torch_work is None else torch_work["down"]
    out = lib.moe.reduce_fused(down, None, token_topk_to_pos)
    return {"topk_idx": topk_idx, "topk_weights": topk_weights, "pos_to_expert": pos_to_expert,
            "token_topk_to_pos": token_topk_to_pos, "fused_q": fused_q, "fused_sf": fused_sf,
            "act_q": act_q, "act_sf": act_sf, "logits": logits, "up": up, "down": down, "out": out}


def captured(lib, x: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor):
    """``(graph, outputs)``: the layer over ``lib`` captured in one CUDA graph on static ``x``."""
    return capture_graph(lambda: routed_layer(lib, x, w_gate, bias))


def _shared_work(outputs: dict, x: torch.Tensor, w_gate: torch.Tensor):
    """The torch work every path runs alike (router matmul, the two GEMM stand-ins)."""
    x.float() @ w_gate
    _dequantize(outputs["fused_q"], outputs["fused_sf"])
    _dequantize(outputs["act_q"], outputs["act_sf"])


def bench(token_counts=(128, 8192), rounds: int = 5, iters: int = 50) -> list:
    """Rows ``{variant, num_tokens, us}``: one replay of the layer's graph, over this package and
    over TileKernels' ops when importable (their JIT compiled by a first call), the torch work both
    paths share (router matmul and GEMM stand-ins) alone, and each library's ops alone (a graph of
    the six ops on the torch work's results of one earlier call)."""
    import tile_kernels_aot

    libs = {"ours": tile_kernels_aot}
    try:
        import tile_kernels
    except ImportError:
        pass
    else:
        libs["TileKernels"] = tile_kernels
    w_gate, bias = weights()
    rows = []
    for num_tokens in token_counts:
        x = tokens(num_tokens)
        work = routed_layer(tile_kernels_aot, x, w_gate, bias)
        graphs = {f"{name}, one CUDA graph": (lambda lib=lib: captured(lib, x, w_gate, bias)[0])
                  for name, lib in libs.items()}
        graphs["shared torch work alone (in every row)"] = lambda: capture_graph(
            functools.partial(_shared_work, work, x, w_gate))[0]
        graphs.update({f"{name}, the ops alone, one CUDA graph": (
            lambda lib=lib: capture_graph(lambda: routed_layer(lib, x, w_gate, bias, torch_work=work))[0])
            for name, lib in libs.items()})
        for name, make_graph in graphs.items():
            try:
                graph = make_graph()
                times = [graph_replay_us(graph, iters) for _ in range(rounds)]
                rows.append({"variant": name, "num_tokens": num_tokens, "us": statistics.median(times)})
            except Exception as e:  # report it, keep the rest of the run
                rows.append({"variant": name, "num_tokens": num_tokens, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows
