"""One call of every op (first prebuilt config, and every transpose dtype; odd token counts
so the last block is partial, strided inputs where allowed), for ``compute-sanitizer
--tool memcheck``."""

import torch

from tile_kernels_aot import manifest, moe, quant, transpose

kernels = manifest.load()["kernels"]
g = torch.Generator(device="cuda").manual_seed(0)


def x(n, h, dtype=torch.bfloat16):
    return torch.randn(n, h, generator=g, device="cuda").to(dtype)


if kernels.get("moe.topk_gate", {}).get("configs"):
    e = kernels["moe.topk_gate"]["configs"][0]["config"]["num_experts"]
    moe.topk_gate(torch.randn(1001, e, generator=g, device="cuda"), min(9, e))
if kernels.get("quant.per_token_cast", {}).get("configs"):
    quant.per_token_cast(x(1001, 2048), "e4m3", 128)
    quant.per_token_cast(x(1001, 7168), "e4m3", 128, use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)
if kernels.get("quant.swiglu_forward_and_per_token_cast", {}).get("configs"):
    quant.swiglu_forward_and_per_token_cast(x(1001, 4096), "e4m3", 128)
for cfg in kernels.get("transpose.batched_transpose", {}).get("configs", []):
    # every dtype (each has its own tile shape); edge tiles in both dims, padded rows
    dtype = getattr(torch, cfg["config"]["dtype"])
    transpose.batched_transpose(x(3 * 448, 384, dtype).view(3, 448, 384)[:, :, :320])
torch.cuda.synchronize()
print("memcheck_ops: done")
