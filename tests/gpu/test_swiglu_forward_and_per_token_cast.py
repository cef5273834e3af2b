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
    return f"{c['in_dtype']}-{c['sf_format']}-row{c['max_row_hidden']}-plain{c['plain']}"


def _poisoned_like(t):
    return poisoned(tuple(t.shape), t.dtype, strides=tuple(t.stride()))


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
@pytest.mark.parametrize("options", ["plain", "weights", "skips", "clamp", "clamp+count", "skips+clamp+count", "all"])
@pytest.mark.parametrize("round_sf", [False, True])
def test_matches_reference(config, options, round_sf, gen):
    col, packed = FORMS[config["sf_format"]]
    if packed and not round_sf:
        pytest.skip("packed UE8M0 scale factors are powers of two: round_sf is required")
    if config["plain"] != (options == "plain"):
        # (counted clamps of bf16 run plain = 2, pos_to_expert alone with packed factors plain = 3,
        # and counted, plain = 4: those calls are made here under the plain = 0 configs)
        pytest.skip("the call picks another `plain` config")
    per_row = config["max_row_hidden"] != 0
    # 640 and 1408: the last 512-channel block is partly past the row (1 and 3 groups)
    for hidden in ([640, 1408, 2048, 7168] if not per_row else [1024, 4096]):
        npc = hidden if per_row else 128
        for n in (1, 77, 513):
            x = (torch.randn(n, 2 * hidden, generator=gen, device="cuda") * 3).to(getattr(torch, config["in_dtype"]))
            kwargs = dict(use_tma_aligned_col_major_sf=col, round_sf=round_sf, use_packed_ue8m0=packed)
            if options in ("weights", "all"):
                num_topk = 4
                weights = torch.rand(n, num_topk, generator=gen, device="cuda")
                pos = torch.randint(-1, n * num_topk, (n,), generator=gen, device="cuda", dtype=torch.int32)
                kwargs.update(pos_to_token_topk=pos, topk_weights=weights)
            if options in ("skips", "skips+clamp+count", "all"):
                kwargs["pos_to_expert"] = torch.randint(-1, 3, (n,), generator=gen, device="cuda", dtype=torch.int32)
            if "clamp" in options or options == "all":
                kwargs["swiglu_clamp_value"] = 2.5
                kwargs["sf_clamp_min"] = 1e-3
            counts = {}
            if options in ("clamp+count", "skips+clamp+count", "all"):
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


def _grouped_bf16_format(kernel="plain"):
    """An sf format of a bf16 grouped config that a call with no option (``plain``) or with
    pos_to_expert alone runs: the kernel with the option flags (``options``; packed UE8M0 calls
    of this form take the routed kernel) or the routed kernel (``routed``, plain = 3; with a
    counted clamp ``counted``, plain = 4)."""
    formats = [c["sf_format"] for c in CONFIGS if c["in_dtype"] == "bfloat16" and c["max_row_hidden"] == 0
               and c["plain"] == {"plain": 1, "options": 0, "routed": 3, "counted": 4}[kernel]
               and (kernel != "options" or c["sf_format"] != "ue8m0_col")]
    if not formats:
        pytest.skip(f"no bf16 grouped config prebuilt for the {kernel} kernel")
    return formats[0]


@pytest.mark.parametrize("sf_clamp_min", [None, 1e-30])
@pytest.mark.parametrize("kernel", ["plain", "options", "routed", "counted"])
def test_every_bf16_gate_value(sf_clamp_min, kernel, gen):
    """Every bf16 bit pattern as the SiLU input: the kernel's divide must round exactly like
    the reference's on each, give -0 at and below -87.5 (-inf included), +inf for +inf and
    NaN for NaN (whose groups get NaN factors).  |l| >= 2^100 (whose product with the right
    half could overflow to inf) is replaced by 0.  ``options`` takes the kernel with the
    option flags, ``routed`` the routed kernel (every row kept through ``pos_to_expert``),
    ``counted`` the counted routed kernel with the largest bf16 as the clamp (every finite gate
    unclamped, +inf clamped to it and counted)."""
    col, packed = FORMS[_grouped_bf16_format(kernel)]
    left = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    keep = (left.float().abs() < 2.0**100) | torch.isinf(left) | torch.isnan(left)
    left = torch.where(keep, left, torch.zeros_like(left)).view(64, 1024)
    right = (torch.randn(64, 1024, generator=gen, device="cuda")).to(torch.bfloat16)
    x = torch.cat([left, right], dim=1).contiguous()
    kwargs = dict(use_tma_aligned_col_major_sf=col, round_sf=packed, use_packed_ue8m0=packed, sf_clamp_min=sf_clamp_min)
    if kernel != "plain":
        kwargs["pos_to_expert"] = torch.zeros(64, dtype=torch.int32, device="cuda")
    counts = {}
    if kernel == "counted":
        kwargs["swiglu_clamp_value"] = torch.finfo(torch.bfloat16).max
        counts = {k: torch.zeros(3, dtype=torch.int64, device="cuda") for k in ("ours", "ref")}
    expected, expected_sf = ref.swiglu_forward_and_per_token_cast(
        x, "e4m3", 128, **kwargs, **({"clamped_count": counts["ref"]} if counts else {}))
    got, got_sf = quant.swiglu_forward_and_per_token_cast(
        x, "e4m3", 128, **kwargs, **({"clamped_count": counts["ours"]} if counts else {}))
    assert_bits_equal(got, expected, f"all bf16 gate values, sf_clamp_min={sf_clamp_min}")
    assert_bits_equal(got_sf, expected_sf, "sf")
    if counts:
        assert torch.equal(counts["ours"], counts["ref"]), f"counts {counts}"


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_gate_values_around_the_flush(config, gen):
    """Gates at and below -87.5 give a -0 quotient, just above the IEEE one, through every
    path: the fast divide (bf16), the lane check and the IEEE divide (fp32 values such as
    -87.49 and -87.51), and a clamp c <= -64 (the IEEE copy for bf16 too).  The right half
    is 2^100 so that the flushed quotients (~1e-36) would show in the output."""
    col, packed = FORMS[config["sf_format"]]
    per_row = config["max_row_hidden"] != 0
    hidden = 1024
    gates = torch.tensor([-87.5, -87.51, -87.49, -88.0, -88.5, -88.75, -89.0, -100.0, -1e30, -87.0, -86.5, -64.5,
                          -63.9, -3.0, -0.0, 0.0, 1.5, 70.0], device="cuda")
    n = 8
    left = gates[torch.randint(0, gates.numel(), (n, hidden), generator=gen, device="cuda")]
    right = torch.full((n, hidden), 2.0**100, device="cuda") * torch.randn(n, hidden, generator=gen, device="cuda").sign()
    x = torch.cat([left, right], dim=1).to(getattr(torch, config["in_dtype"])).contiguous()
    npc = hidden if per_row else 128
    for clamp in ([None, -70.0] if config["plain"] == 0 else [None]):
        kwargs = dict(use_tma_aligned_col_major_sf=col, round_sf=packed, use_packed_ue8m0=packed,
                      swiglu_clamp_value=clamp, sf_clamp_min=1e-30)
        if config["plain"] in (0, 3) and clamp is None:
            kwargs["pos_to_expert"] = torch.zeros(n, dtype=torch.int32, device="cuda")
        expected, expected_sf = ref.swiglu_forward_and_per_token_cast(x, "e4m3", npc, **kwargs)
        got, got_sf = quant.swiglu_forward_and_per_token_cast(x, "e4m3", npc, **kwargs)
        assert_bits_equal(got, expected, f"{_ids(config)} clamp={clamp} out")
        assert_bits_equal(got_sf, expected_sf, f"{_ids(config)} clamp={clamp} sf")


@pytest.mark.parametrize("kernel", ["plain", "options", "routed", "counted"])
def test_more_than_65535_row_blocks(kernel, gen):
    """262145 rows: 65537 blocks of 4 rows, past one grid column (they go to blockIdx.z).  The
    counted routed kernel with hidden 1024: 524290 words of counts, more than one step of its
    summing launch (4 blocks per SM, 512 words each)."""
    col, packed = FORMS[_grouped_bf16_format(kernel)]
    n, hidden = 4 * 65536 + 1, 1024 if kernel == "counted" else 128
    x = (torch.randn(n, 2 * hidden, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    kwargs = dict(use_tma_aligned_col_major_sf=col, round_sf=packed, use_packed_ue8m0=packed)
    if kernel != "plain":
        kwargs["pos_to_expert"] = torch.randint(-1, 2, (n,), generator=gen, device="cuda", dtype=torch.int32)
    counts = {}
    if kernel == "counted":
        kwargs["swiglu_clamp_value"] = 2.0
        counts = {k: torch.tensor([3, 0, 2**40], dtype=torch.int64, device="cuda") for k in ("ours", "ref")}
    expected, expected_sf = ref.swiglu_forward_and_per_token_cast(
        x, "e4m3", 128, **kwargs, **({"clamped_count": counts["ref"]} if counts else {}))
    out, out_sf = _poisoned_like(expected), _poisoned_like(expected_sf)
    quant.swiglu_forward_and_per_token_cast(
        x, "e4m3", 128, **kwargs, **({"clamped_count": counts["ours"]} if counts else {}), out=out, out_sf=out_sf)
    assert_bits_equal(out, expected, f"n={n} out")
    assert_bits_equal(out_sf, expected_sf, f"n={n} sf")
    if counts:
        assert torch.equal(counts["ours"], counts["ref"]), f"n={n}: counts {counts}"


@pytest.mark.parametrize("clamp", [0.5, 2.0, 448.0, 2.0**-130])
def test_counted_routed_special_values(clamp, gen):
    """The counted routed kernel (plain = 4: pos_to_expert alone, packed UE8M0, a positive bf16
    clamp value, subnormal included) on NaN, +-inf, +-0, +-c and the bf16 values next to them,
    gates at and below the -88.5 floor, in both halves: counts (from non-zero counters), codes and
    factors bit for bit; skipped rows, padding lanes (hidden 640) and a partial last row block."""
    _grouped_bf16_format("counted")
    n, hidden = 4 * 37 + 3, 640
    bits = torch.tensor([clamp], dtype=torch.bfloat16).view(torch.int16)
    near = torch.cat([bits - 1, bits, bits + 1]).view(torch.bfloat16).float()  # c and the bf16 values beside it
    specials = torch.cat([near, -near]).tolist() + [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -87.5,
                                                    -88.5, -89.0, -1e30, 70.0]
    x = (torch.randn(n, 2 * hidden, generator=gen, device="cuda") * 2 * max(clamp, 1e-3))
    pick = torch.randint(0, 4, x.shape, generator=gen, device="cuda") == 0
    values = torch.tensor(specials, device="cuda")
    x = torch.where(pick, values[torch.randint(0, len(specials), x.shape, generator=gen, device="cuda")], x)
    x = x.to(torch.bfloat16)
    kwargs = dict(use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True, swiglu_clamp_value=clamp,
                  pos_to_expert=torch.randint(-1, 3, (n,), generator=gen, device="cuda", dtype=torch.int32))
    counts = {k: torch.tensor([5, 7, 11], dtype=torch.int64, device="cuda") for k in ("ours", "ref")}
    expected, expected_sf = ref.swiglu_forward_and_per_token_cast(x, "e4m3", 128, **kwargs, clamped_count=counts["ref"])
    out, out_sf = _poisoned_like(expected), _poisoned_like(expected_sf)
    quant.swiglu_forward_and_per_token_cast(
        x, "e4m3", 128, **kwargs, clamped_count=counts["ours"], out=out, out_sf=out_sf)
    assert_bits_equal(out, expected, f"clamp={clamp} out")
    assert_bits_equal(out_sf, expected_sf, f"clamp={clamp} sf")
    assert torch.equal(counts["ours"], counts["ref"]), f"clamp={clamp}: counts {counts}"
