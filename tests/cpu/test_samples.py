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


def test_per_block_grid_extents():
    sample = to_json(Sample("grid", 100, [Randn(["T", 64], "float32"), Randn(["T/128", "T/32"], "float32")]))
    for tokens, rows in ((1, 1), (128, 1), (129, 2), (8001, 63), (0, 0)):
        (x, grid), _ = samples.make_args(sample, tokens, device="cpu", empty=True)
        assert x.shape == (tokens, 64) and grid.shape == (rows, -(-tokens // 32))


def test_pairs_and_powers_of_two():
    from kernels_tl.schema import Exp2, Randint

    pair = (Randint(["T", 16], "int8", -128, 128), Exp2(["T", 1], "float32", -3, 4))
    sample = to_json(Sample("pair", 10, [pair, "e4m3"]))
    (x, fmt), _ = samples.make_args(sample, 10, torch.Generator().manual_seed(2), "cpu")
    data, sf = x
    assert isinstance(x, tuple) and data.shape == (10, 16) and data.dtype == torch.int8 and fmt == "e4m3"
    exponents = torch.log2(sf)
    assert sf.dtype == torch.float32 and torch.equal(exponents, exponents.round())
    assert exponents.min() >= -3 and exponents.max() <= 3
    record = {"params": [{"name": "x"}, {"name": "fmt"}], "bytes": None}
    assert samples.bytes_moved(record, [x, fmt], {}, {}) == data.nbytes + sf.nbytes
