"""quant.per_token_cast (and _with_sf_only, _with_precomputed_sf) against the reference, on
every prebuilt (in_dtype, fmt, group), every coverage hidden size, every sf form."""

import pytest
import torch

from tile_kernels_aot import quant
from tile_kernels_aot.torch import quant as ref

from checks import assert_bits_equal, poisoned, prebuilt_configs

ALL_CONFIGS = prebuilt_configs("quant.per_token_cast")
QUANTIZED_INPUTS = ("float8_e4m3fn", "int8")
CONFIGS = [c for c in ALL_CONFIGS if c["in_dtype"] not in QUANTIZED_INPUTS]
QUANTIZED_CONFIGS = [c for c in ALL_CONFIGS if c["in_dtype"] in QUANTIZED_INPUTS]
HIDDEN = [576, 2048, 2560, 3072, 4096, 6144, 7168]
# (use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
SF_FORMS = [(False, False, False), (False, True, False), (True, False, False), (True, True, False), (True, True, True)]


def _ids(c):
    return f"{c['in_dtype']}-{c['fmt']}-g{c['group']}"


def _input(n, hidden, dtype, gen, row_pad=0):
    base = torch.randn(n, hidden + row_pad, generator=gen, device="cuda") * 4
    base[:, ::97] *= 300  # a few large values per row: groups with very different scales
    return base.to(getattr(torch, dtype))[:, :hidden]


def _poisoned_like(t):
    return poisoned(tuple(t.shape), t.dtype, strides=tuple(t.stride()))


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
@pytest.mark.parametrize("sf_form", SF_FORMS, ids=lambda f: "col{:d}-round{:d}-ue8m0{:d}".format(*f))
def test_matches_reference(config, sf_form, gen):
    col, round_sf, packed = sf_form
    for hidden in HIDDEN:
        npc = hidden if config["group"] == 0 else config["group"]
        if config["fmt"] == "e2m1" and hidden % 2 or config["fmt"] == "e5m6" and hidden % 8:
            continue
        for n, pad in ((1, 0), (67, 64), (300, 0)):
            x = _input(n, hidden, config["in_dtype"], gen, row_pad=pad)
            kwargs = dict(use_tma_aligned_col_major_sf=col, round_sf=round_sf, use_packed_ue8m0=packed)
            try:
                expected, expected_sf = ref.per_token_cast(x, config["fmt"], npc, **kwargs)
            except ValueError:
                with pytest.raises(ValueError):  # the reference refuses the combination: so must we
                    quant.per_token_cast(x, config["fmt"], npc, **kwargs)
                continue
            what = f"{_ids(config)} hidden={hidden} n={n} pad={pad} {sf_form}"
            out, out_sf = _poisoned_like(expected), _poisoned_like(expected_sf)
            got, got_sf = quant.per_token_cast(x, config["fmt"], npc, **kwargs, out=out, out_sf=out_sf)
            assert got is out and got_sf is out_sf
            assert_bits_equal(out, expected, what + " out")
            assert_bits_equal(out_sf, expected_sf, what + " sf")
            got, got_sf = quant.per_token_cast(x, config["fmt"], npc, **kwargs)
            assert got_sf.stride() == expected_sf.stride() or min(expected_sf.shape) <= 1, what
            assert_bits_equal(got, expected, what + " out (allocated)")
            assert_bits_equal(got_sf, expected_sf, what + " sf (allocated)")
            if config["group"] != 0:
                sf_only = quant.per_token_cast_with_sf_only(x, config["fmt"], npc, **kwargs)
                assert_bits_equal(sf_only, expected_sf, what + " sf_only")
                if not col and not packed:
                    cast = quant.per_token_cast_with_precomputed_sf(x, config["fmt"], npc, expected_sf, round_sf=round_sf)
                    want = ref.per_token_cast_with_precomputed_sf(x, config["fmt"], npc, expected_sf, round_sf=round_sf)
                    assert_bits_equal(cast, want, what + " precomputed sf")


@pytest.mark.parametrize("config", QUANTIZED_CONFIGS, ids=_ids)
@pytest.mark.parametrize("sf_form", [(False, True, False), (True, True, True), (False, False, False), (True, False, False)],
                         ids=lambda f: "col{:d}-round{:d}-ue8m0{:d}".format(*f))
def test_pre_quantized_matches_reference(config, sf_form, gen):
    """(data, sf) inputs made by the reference per_block_cast in the same sf form (as upstream's
    test makes them), every group size, both x_block_size of upstream's test."""
    col, round_sf, packed = sf_form
    in_fmt = "e4m3" if config["in_dtype"] == "float8_e4m3fn" else "e2m1"
    kwargs = dict(use_tma_aligned_col_major_sf=col, round_sf=round_sf, use_packed_ue8m0=packed)
    for hidden in HIDDEN:
        for n in (1, 67, 300):
            for block in ((128, 128), (32, 32)):
                x = _input(n, hidden, "bfloat16", gen).contiguous()
                pair = ref.per_block_cast(x, in_fmt, block, **kwargs)
                for npc in (16, 32, 64, 128):
                    what = f"{_ids(config)} hidden={hidden} n={n} block={block} npc={npc} {sf_form}"
                    expected, expected_sf = ref.per_token_cast(pair, config["fmt"], npc, x_block_size=block, **kwargs)
                    got, got_sf = quant.per_token_cast(pair, config["fmt"], npc, x_block_size=block, **kwargs)
                    assert_bits_equal(got, expected, what + " out")
                    assert_bits_equal(got_sf, expected_sf, what + " sf")
