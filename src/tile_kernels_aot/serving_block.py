"""A small MoE layer front built from the package's ops, as a server compiles it: routing
(gate scores, ``moe.topk_gate``, ``moe.normalize_weight``), activation quantization
(``quant.per_token_cast``), the up projection's SwiGLU + quantization
(``quant.swiglu_forward_and_per_token_cast``) and a transposed copy for a weight-gradient GEMM
(``transpose.transpose``).

The same block runs over this package (eager, ``torch.compile``, CUDA graphs), over the
PyTorch references (``tile_kernels_aot.torch``) and over TileKernels; the tests check the
compiled block bit for bit against eager, and ``python -m tile_kernels_aot bench --block``
times it.
"""

from __future__ import annotations

import statistics

import torch

HIDDEN = 2048
EXPERTS = 256
TOP_K = 8
INTERMEDIATE = 1024


def weights(device="cuda", seed=0) -> tuple:
    """``(w_gate [HIDDEN, EXPERTS] fp32, w_up [HIDDEN, 2 * INTERMEDIATE] bf16)``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w_gate = torch.randn(HIDDEN, EXPERTS, generator=gen, device=device) / HIDDEN ** 0.5
    w_up = (torch.randn(HIDDEN, 2 * INTERMEDIATE, generator=gen, device=device) / HIDDEN ** 0.5).to(torch.bfloat16)
    return w_gate, w_up


def tokens(num_tokens: int, device="cuda", seed=1) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(num_tokens, HIDDEN, generator=gen, device=device).to(torch.bfloat16)


def moe_block(lib, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> tuple:
    """The block over ``lib`` (a module with ``moe``, ``quant`` and ``transpose``): x [T, HIDDEN]
    bf16 -> (topk_idx, denominator, weights, x_q, x_sf, h_q, h_sf, x_t).  The torch glue is
    exact arithmetic (matmuls, gather, abs, add, pad), so compiled and eager agree bit for bit."""
    scores = x.float() @ w_gate
    topk_idx = lib.moe.topk_gate(scores, TOP_K)
    denominator, topk_weights = lib.moe.normalize_weight(scores.gather(1, topk_idx).abs() + 1)
    x_q, x_sf = lib.quant.per_token_cast(x, "e4m3", 128, use_tma_aligned_col_major_sf=True, round_sf=True,
                                         use_packed_ue8m0=True)
    h_q, h_sf = lib.quant.swiglu_forward_and_per_token_cast(x @ w_up, "e4m3", 128, round_sf=True)
    # the transpose takes rows in multiples of 64: pad the token dim
    x_t = lib.transpose.transpose(torch.nn.functional.pad(x, (0, 0, 0, (-x.shape[0]) % 64)))
    return topk_idx, denominator, topk_weights, x_q, x_sf, h_q, h_sf, x_t


def references():
    """The PyTorch references arranged as the package's families (``moe``, ``quant``, ``transpose``),
    as the block and ``tile_kernels_aot.moe_layer`` call them."""
    from types import SimpleNamespace

    from tile_kernels_aot.torch import moe, quant, swiglu, transpose

    return SimpleNamespace(moe=moe, transpose=transpose, quant=SimpleNamespace(
        per_token_cast=quant.per_token_cast, swiglu_forward_and_per_token_cast=swiglu.swiglu_forward_and_per_token_cast))


def _per_call_us(fn, x, iters: int) -> float:
    """Wall time per call of a loop of ``iters`` calls, after 3 warm-up calls, synchronized at
    both ends: what a server's step sees (host work and device work, whichever bounds)."""
    from tile_kernels_aot.bench import loop_us

    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    return loop_us(lambda: fn(x), iters)


def bench(token_counts=(128, 4096), rounds: int = 5, iters: int = 200) -> list:
    """Rows ``{variant, num_tokens, us}``: the block per call, eager and compiled, over this
    package, the references, and TileKernels when importable (its ops break the graph)."""
    import tile_kernels_aot

    w_gate, w_up = weights()
    variants = {
        "ours, eager": lambda x: moe_block(tile_kernels_aot, x, w_gate, w_up),
        "ours, torch.compile": torch.compile(lambda x: moe_block(tile_kernels_aot, x, w_gate, w_up), fullgraph=True),
        "ours, torch.compile reduce-overhead": torch.compile(
            lambda x: moe_block(tile_kernels_aot, x, w_gate, w_up), fullgraph=True, mode="reduce-overhead"),
        "references, torch.compile": torch.compile(lambda x: moe_block(references(), x, w_gate, w_up)),
    }
    try:
        import tile_kernels
    except ImportError:
        pass
    else:
        variants["TileKernels, eager"] = lambda x: moe_block(tile_kernels, x, w_gate, w_up)
        variants["TileKernels, torch.compile (graph breaks)"] = torch.compile(
            lambda x: moe_block(tile_kernels, x, w_gate, w_up))
    rows = []
    for num_tokens in token_counts:
        x = tokens(num_tokens)
        for name, fn in variants.items():
            try:
                times = [_per_call_us(fn, x, iters) for _ in range(rounds)]
                rows.append({"variant": name, "num_tokens": num_tokens, "us": statistics.median(times)})
            except Exception as e:  # report it, keep the rest of the run
                rows.append({"variant": name, "num_tokens": num_tokens, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows
