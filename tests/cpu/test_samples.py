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


def test_exact_rows_routing_has_the_rows_the_draw_needs():
    sample = to_json(Sample("exact", 100, [Routed("token_topk_to_pos"), Randn(["P", 8], "float32")],
                            {"pos_to_expert": Routed("pos_to_expert")},
                            routing=Routing(num_topk=6, num_experts=9, alignment=4, unrouted=0.7, exact_rows=True)))
    (token_topk_to_pos, rows), kwargs = samples.make_args(sample, 100, torch.Generator().manual_seed(2), "cpu")
    counts = torch.bincount(kwargs["pos_to_expert"][kwargs["pos_to_expert"] >= 0].long(), minlength=9)
    needed = int(((counts + 3) // 4 * 4).sum())
    assert rows.shape == (needed, 8) and kwargs["pos_to_expert"].shape == (needed,)
    assert needed < 100 * 6 and int((token_topk_to_pos >= 0).sum()) == int(counts.sum())
    # shapes without data: the upper bound
    (_, rows), _ = samples.make_args(sample, 7, device="cpu", empty=True)
    assert rows.shape == (7 * 6 + 9 * 3, 8)


def test_pairs_and_bytes_of_quantized_and_optional_tensors():
    """A (data, sf) pair in a sample is drawn as a tuple; the bytes formula sees it as <name> and
    <name>_sf, and an optional tensor not given as None."""
    sample = to_json(Sample("pair", 10, [(Randn(["T", 64], "bfloat16"), Randn(["T"], "float32")), None]))
    record = {"params": [{"name": "x", "type": {"kind": "quantized"}}, {"name": "w", "type": {"kind": "tensor"}}],
              "bytes": "x.nbytes + x_sf.nbytes + (0 if w is None else 1000) + out.nbytes"}
    args, _ = samples.make_args(sample, 10, torch.Generator().manual_seed(3), "cpu")
    assert isinstance(args[0], tuple) and args[0][0].shape == (10, 64) and args[0][1].shape == (10,)
    out = torch.empty(10, 64, dtype=torch.bfloat16)
    assert samples.bytes_moved(record, args, {}, {"out": out}) == 1280 + 40 + 1280
    assert samples.bytes_moved({**record, "bytes": None}, args, {}, {"out": out}) == 1280 + 40 + 1280
