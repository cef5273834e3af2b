"""quant.swiglu_forward_and_per_token_cast against the reference (run on the GPU, so both use
the same expf): every prebuilt config, hidden sizes, weights, skipped rows, clamping and counts."""

import pytest
import torch

from tile_kernels_aot import quant
from tile_kernels_aot.torch import swiglu as ref

from checks import assert_bits_equal, poisoned, prebuilt_configs

CONFIGS = prebuilt_configs("quant.swiglu_forward_and_per_token_cast")
FORMS = {"fp32": (False, False), "fp32_col": (True, False), "ue8m0_col": (True, True)}


def _ids(c):
    return f"{c['in_dtype']}-{c['sf_format']}-row{c['max_row_hidden']}"


def _poisoned_like(t):
    return poisoned(tuple(t.shape), t.dtype, strides=tuple(t.stride()))


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
@pytest.mark.parametrize("options", ["plain", "weights", "skips", "clamp", "clamp+count", "all"])
@pytest.mark.parametrize("round_sf", [False, True])
def test_matches_reference(config, options, round_sf, gen):
    col, packed = FORMS[config["sf_format"]]
    if packed and not round_sf:
        pytest.skip("packed UE8M0 scale factors are powers of two: round_sf is required")
    per_row = config["max_row_hidden"] != 0
    for hidden in ([1024, 2048, 7168] if not per_row else [1024, 4096]):
        npc = hidden if per_row else 128
        for n in (1, 77, 513):
            x = (torch.randn(n, 2 * hidden, generator=gen, device="cuda") * 3).to(getattr(torch, config["in_dtype"]))
            kwargs = dict(use_tma_aligned_col_major_sf=col, round_sf=round_sf, use_packed_ue8m0=packed)
            if options in ("weights", "all"):
                num_topk = 4
                weights = torch.rand(n, num_topk, generator=gen, device="cuda")
                pos = torch.randint(-1, n * num_topk, (n,), generator=gen, device="cuda", dtype=torch.int32)
                kwargs.update(pos_to_token_topk=pos, topk_weights=weights)
            if options in ("skips", "all"):
                kwargs["pos_to_expert"] = torch.randint(-1, 3, (n,), generator=gen, device="cuda", dtype=torch.int32)
            if "clamp" in options or options == "all":
                kwargs["swiglu_clamp_value"] = 2.5
                kwargs["sf_clamp_min"] = 1e-3
            counts = {}
            if options in ("clamp+count", "all"):
                counts = {"ours": torch.full((3,), 5, dtype=torch.int64, device="cuda"),
                          "ref": torch.full((3,), 5, dtype=torch.int64, device="cuda")}
            what = f"{_ids(config)} {options} round={round_sf} hidden={hidden} n={n}"
            expected, expected_sf = ref.swiglu_forward_and_per_token_cast(
                x, "e4m3", npc, **kwargs, **({"clamped_count": counts["ref"]} if counts else {}))
            out, out_sf = _poisoned_like(expected), _poisoned_like(expected_sf)
            got, got_sf = quant.swiglu_forward_and_per_token_cast(
                x, "e4m3", npc, **kwargs, **({"clamped_count": counts["ours"]} if counts else {}), out=out, out_sf=out_sf)
            assert got is out and got_sf is out_sf
            assert_bits_equal(out, expected, what + " out")
            assert_bits_equal(out_sf, expected_sf, what + " sf")
            if counts:
                assert torch.equal(counts["ours"], counts["ref"]), f"{what}: counts {counts}"


@pytest.mark.parametrize("sf_clamp_min", [None, 1e-30])
def test_every_bf16_gate_value(sf_clamp_min, gen):
    """Every bf16 bit pattern as the SiLU input: the kernel's divide must round exactly like
    the reference's on each.  Non-finite values and |l| >= 2^100 (whose product with the
    right half could overflow to inf, outside the op's contract) are replaced by 0."""
    if not any(c["in_dtype"] == "bfloat16" and c["max_row_hidden"] == 0 for c in CONFIGS):
        pytest.skip("no bf16 grouped config prebuilt")
    sf_format = next(c["sf_format"] for c in CONFIGS if c["in_dtype"] == "bfloat16" and c["max_row_hidden"] == 0)
    col, packed = FORMS[sf_format]
    left = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    keep = torch.isfinite(left) & (left.float().abs() < 2.0**100)
    left = torch.where(keep, left, torch.zeros_like(left)).view(64, 1024)
    right = (torch.randn(64, 1024, generator=gen, device="cuda")).to(torch.bfloat16)
    x = torch.cat([left, right], dim=1).contiguous()
    kwargs = dict(use_tma_aligned_col_major_sf=col, round_sf=packed, use_packed_ue8m0=packed, sf_clamp_min=sf_clamp_min)
    expected, expected_sf = ref.swiglu_forward_and_per_token_cast(x, "e4m3", 128, **kwargs)
    got, got_sf = quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, **kwargs)
    assert_bits_equal(got, expected, f"all bf16 gate values, sf_clamp_min={sf_clamp_min}")
    assert_bits_equal(got_sf, expected_sf, "sf")
