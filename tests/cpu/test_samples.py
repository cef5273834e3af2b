"""Sample inputs as the tests and the bench draw them: a routed sample's tensors agree with
each other and with the reference mapping of its ``topk_idx``."""

import torch

from kernels_tl.schema import Randn, Routed, Routing, Sample, to_json
from tile_kernels_aot import samples
from tile_kernels_aot.torch.moe import get_fused_mapping


def _routed_sample(alignment: int, unrouted: float) -> dict:
    return to_json(Sample("routed", 100, [Randn(["T", 64], "bfloat16"), Routed("topk_idx"), Routed("token_topk_to_pos")],
                          {"rows": Randn(["P", 8], "float32"), "pos_to_expert": Routed("pos_to_expert")},
                          routing=Routing(num_topk=6, num_experts=32, alignment=alignment, unrouted=unrouted)))


def test_routed_tensors_come_from_one_mapping():
    for alignment, unrouted in ((1, 0.0), (16, 0.2)):
        sample = _routed_sample(alignment, unrouted)
        (x, topk_idx, token_topk_to_pos), kwargs = samples.make_args(sample, 100, torch.Generator().manual_seed(1), "cpu")
        rows = 100 * 6 + 32 * (alignment - 1)
        assert x.shape == (100, 64) and kwargs["rows"].shape == (rows, 8)
        routed = topk_idx[topk_idx >= 0]
        assert (routed < 32).all() and (routed.numel() < 600) == (unrouted > 0)
        for t in range(100):  # distinct experts per token
            assert len(set(topk_idx[t][topk_idx[t] >= 0].tolist())) == int((topk_idx[t] >= 0).sum())
        expected = get_fused_mapping(topk_idx, 32, rows, alignment, force_no_sync=True)
        assert torch.equal(token_topk_to_pos, expected[3]) and torch.equal(kwargs["pos_to_expert"], expected[0])


def test_routed_shapes_without_data():
    (x, topk_idx, token_topk_to_pos), kwargs = samples.make_args(_routed_sample(4, 0.0), 7, device="cpu", empty=True)
    assert topk_idx.shape == (7, 6) and topk_idx.dtype == torch.int64
    assert token_topk_to_pos.shape == (7, 6) and token_topk_to_pos.dtype == torch.int32
    assert kwargs["pos_to_expert"].shape == (7 * 6 + 32 * 3,) and kwargs["rows"].shape == (7 * 6 + 32 * 3, 8)


def test_pairs_layouts_views_and_block_extents():
    """A quantized (data, sf) pair: codes as uint8 bits viewed as e4m3, factors over blocks of
    32 tokens ("T/32") as packed words (four uint8 draws per int32) in the TMA-aligned
    column-major layout."""
    from kernels_tl.schema import Rand, Randint

    sample = to_json(Sample("pair", 70, [(Randint(["T", 64], "uint8", 0, 256, view="float8_e4m3fn"),
                                          Randint(["T/32", 8], "uint8", 112, 143, layout="tma_col", view="int32")),
                                         Rand(["T/128", 3], "float32", 1.0, 2.0, layout="tma_col")]))
    for empty in (False, True):
        (pair, sf), _ = samples.make_args(sample, 70, torch.Generator().manual_seed(2), "cpu", empty=empty)
        data, words = pair
        assert isinstance(pair, tuple) and data.dtype == torch.float8_e4m3fn and data.shape == (70, 64)
        assert words.dtype == torch.int32 and words.shape == (3, 2) and words.stride() == (1, 4)
        assert sf.shape == (1, 3) and sf.stride() == (1, 4)
        if not empty:
            exponents = words.contiguous().view(torch.uint8)
            assert bool(((exponents >= 112) & (exponents < 143)).all())
            assert bool(((sf >= 1) & (sf < 2)).all())


def test_bytes_moved_counts_both_tensors_of_a_pair():
    record = {"params": [{"name": "x"}, {"name": "fmt"}], "bytes": None}
    pair = (torch.empty(4, 64, dtype=torch.uint8), torch.empty(4, 2))
    outs = {"out": torch.empty(4, 64, dtype=torch.bfloat16)}
    assert samples.bytes_moved(record, [pair, "bf16"], {}, outs) == 256 + 32 + 512
