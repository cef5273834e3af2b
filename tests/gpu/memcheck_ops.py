"""One call of every op (first prebuilt config, and every transpose dtype; odd token counts
so the last block is partial, strided inputs where allowed), plus the paths that use shared
memory and barriers (one group per row; the clamp counters with their atomics) and outputs
in reused memory (freed outputs back smaller calls), for
``compute-sanitizer`` (``--tool memcheck`` and ``--tool racecheck``)."""

import torch

from tile_kernels_aot import manifest, moe, quant, transpose

g = torch.Generator(device="cuda").manual_seed(0)


def x(n, h, dtype=torch.bfloat16):
    return torch.randn(n, h, generator=g, device="cuda").to(dtype)


if manifest.configs("moe.topk_gate"):
    e = manifest.configs("moe.topk_gate")[0]["num_experts"]
    moe.topk_gate(torch.randn(1001, e, generator=g, device="cuda"), min(9, e))
if manifest.configs("quant.per_token_cast"):
    quant.per_token_cast(x(1001, 2048), "e4m3", 128)
    quant.per_token_cast(x(1001, 7168), "e4m3", 128, use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
if manifest.configs("quant.swiglu_forward_and_per_token_cast"):
    quant.swiglu_forward_and_per_token_cast(x(1001, 4096), "e4m3", 128)
    # hidden 640: the last 512-channel block has one group; its other lanes read the row's
    # last chunk again and store nothing
    quant.swiglu_forward_and_per_token_cast(x(1001, 1280), "e4m3", 128)
    # weights, skipped rows, clamp and counters (shared-memory block sums, int64 atomics)
    pos = torch.randint(-1, 1001 * 4, (1001,), generator=g, device="cuda", dtype=torch.int32)
    quant.swiglu_forward_and_per_token_cast(
        x(1001, 1280), "e4m3", 128, pos_to_token_topk=pos, topk_weights=torch.rand(1001, 4, generator=g, device="cuda"),
        pos_to_expert=torch.randint(-1, 3, (1001,), generator=g, device="cuda", dtype=torch.int32),
        swiglu_clamp_value=1.5, clamped_count=torch.zeros(3, dtype=torch.int64, device="cuda"))
if any(c["max_row_hidden"] > 0 and c["in_dtype"] == "bfloat16"
       for c in manifest.configs("quant.swiglu_forward_and_per_token_cast")):
    # one group per row: the block max goes through shared memory
    quant.swiglu_forward_and_per_token_cast(x(301, 2 * 7168), "e4m3", 7168, swiglu_clamp_value=1.5,
                                            clamped_count=torch.zeros(3, dtype=torch.int64, device="cuda"))
if {"fmt": "e4m3", "group": 0, "in_dtype": "bfloat16"} in manifest.configs("quant.per_token_cast"):
    quant.per_token_cast(x(301, 7168), "e4m3", 7168)  # one group per row: warp maxima in shared memory
for cfg in manifest.configs("transpose.batched_transpose"):
    # every dtype (each has its own tile shape); edge tiles in both dims, padded rows
    dtype = getattr(torch, cfg["dtype"])
    transpose.batched_transpose(x(3 * 448, 384, dtype).view(3, 448, 384)[:, :, :320])
    # back to back, the second reading the first's output: its first blocks may start early
    # and prefetch while they wait
    transpose.transpose(transpose.transpose(x(2048, 1024, dtype)))
if manifest.configs("quant.per_token_cast"):
    # each call's outputs are freed at once and back the next, smaller call (kept memory is
    # reused for requests down to half its size)
    for n in (256, 200, 131, 129, 7):
        quant.per_token_cast(x(n, 2048), "e4m3", 128)
torch.cuda.synchronize()
print("memcheck_ops: done")
