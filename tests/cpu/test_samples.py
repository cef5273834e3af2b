"""Sample inputs as the tests and the bench draw them: (data, sf) pairs, and a routed sample's tensors that agree with
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


def test_exact_rows_and_expert_parallel_draws():
    sample = to_json(Sample("ep", 400, [Routed("topk_idx"), Randn(["P", 4], "float32")],
                            routing=Routing(num_topk=8, num_experts=9, alignment=16, ep_ranks=8, exact=True)))
    (topk_idx, rows), _ = samples.make_args(sample, 400, torch.Generator().manual_seed(2), "cpu")
    routed = topk_idx[topk_idx >= 0]
    assert (routed < 9).all() and 0 < routed.numel() < 400 * 8 // 2  # about one in eight entries is local
    counts = torch.bincount(routed, minlength=9)
    assert rows.shape[0] == int(((counts + 15) // 16 * 16).sum())  # exactly the rows the layout needs


def test_routed_shapes_without_data():
    (x, topk_idx, token_topk_to_pos), kwargs = samples.make_args(_routed_sample(4, 0.0), 7, device="cpu", empty=True)
    assert topk_idx.shape == (7, 6) and topk_idx.dtype == torch.int64
    assert token_topk_to_pos.shape == (7, 6) and token_topk_to_pos.dtype == torch.int32
    assert kwargs["pos_to_expert"].shape == (7 * 6 + 32 * 3,) and kwargs["rows"].shape == (7 * 6 + 32 * 3, 8)


def test_quantized_pair_sample():
    """A Quantized spec gives a (data, sf) pair from the reference per_block_cast, in the sf
    form asked for, and bytes_moved counts both tensors."""
    from kernels_tl.schema import Quantized, Sample, to_json

    spec = Quantized(["T", 256], "e2m1", (32, 32), True, True, True)
    sample = to_json(Sample("pair", 5, [spec, "e4m3", 32], {"x_block_size": (32, 32)}))
    (pair, fmt, npc), kwargs = samples.make_args(sample, 70, torch.Generator().manual_seed(0), "cpu")
    data, sf = pair
    assert data.dtype == torch.int8 and data.shape == (70, 128)
    assert sf.dtype == torch.int32 and sf.shape == (3, 2) and sf.stride() == (1, 4)
    record = {"params": [{"name": "x", "type": {"kind": "quantized"}}, {"name": "fmt", "type": {"kind": "str"}},
                         {"name": "num_per_channels", "type": {"kind": "int"}}], "bytes": None}
    assert samples.bytes_moved(record, [pair, fmt, npc], {}, {}) == data.nbytes + sf.nbytes
    (empty_pair, _, _), _ = samples.make_args(sample, 1, device="cpu", empty=True)
    assert empty_pair[0].shape == (1, 128) and empty_pair[1].shape == (1, 2)


def test_a_list_of_tensor_specs_is_a_pair_and_nested_returns_flatten():
    from kernels_tl.schema import Rand

    sample = to_json(Sample("pair", 10, [(Randn(["T", 64], "float8_e4m3fn"), Rand(["T", 2], "float32", 0.5, 1.0)), 3]))
    (x, n), _ = samples.make_args(sample, 10, torch.Generator().manual_seed(0), "cpu")
    assert isinstance(x, tuple) and x[0].shape == (10, 64) and x[0].dtype == torch.float8_e4m3fn
    assert x[1].shape == (10, 2) and bool((x[1] >= 0.5).all()) and n == 3
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    record = {"returns": ["out", ["q", "sf"]]}
    assert samples.outputs_by_name(record, (a, (b, c))) == {"out": a, "q": b, "sf": c}


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


def test_extents_follow_the_token_count():
    from kernels_tl.schema import Extent, Randint

    sample = to_json(Sample("sized", 10, [Routed("topk_idx"), Extent("P"), Extent("T * 3 + 1")],
                            {"rows": Extent("P + 5")}, routing=Routing(num_topk=4, num_experts=8, alignment=16)))
    for empty in (False, True):
        (topk_idx, rows, other), kwargs = samples.make_args(sample, 50, torch.Generator().manual_seed(0), "cpu", empty)
        assert topk_idx.shape == (50, 4) and rows == 50 * 4 + 8 * 15 and other == 151 and kwargs["rows"] == rows + 5
    plain = to_json(Sample("plain", 10, [Randint(["T", 2], "int64", 0, 4), Extent("T * 2")]))
    assert samples.make_args(plain, 7, torch.Generator().manual_seed(0), "cpu")[0][1] == 14


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
    record = {"params": [{"name": "x", "type": {"kind": "quantized"}}, {"name": "fmt", "type": {"kind": "str"}}],
              "bytes": None}
    assert samples.bytes_moved(record, [x, fmt], {}, {}) == data.nbytes + sf.nbytes


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
    record = {"params": [{"name": "x", "type": {"kind": "quantized"}}, {"name": "fmt", "type": {"kind": "str"}}],
              "bytes": None}
    pair = (torch.empty(4, 64, dtype=torch.uint8), torch.empty(4, 2))
    outs = {"out": torch.empty(4, 64, dtype=torch.bfloat16)}
    assert samples.bytes_moved(record, [pair, "bf16"], {}, outs) == 256 + 32 + 512


def test_optional_str_parameters():
    """Str(optional=True) (e.g. cast_back's x_special_fmt=None): the torch schema takes ``str?``
    defaulting to None, and the stub parses None into an empty string and ``<name>_is_none``."""
    from aot import stubgen
    from kernels_tl.schema import Op, Param, Str
    from tile_kernels_aot import custom_ops

    param = Param("x_special_fmt", Str(["e5m6"], optional=True), None)
    record = {"module": "quant", "name": "demo", "params": [to_json(param)]}
    assert custom_ops.torch_params(record) == [("x_special_fmt", "str?", "None")]
    op = Op("quant", "demo", [param], [], None, "ref", [], "")
    assert "bool x_special_fmt_is_none;" in stubgen._arg_fields(op)
    parse = "".join(stubgen._parse_param(0, param, "quant.demo"))
    assert "a.x_special_fmt_is_none = true;" in parse and "v[0] == Py_None" in parse


def test_powers_of_two_in_the_tma_aligned_layout():
    from kernels_tl.schema import Exp2

    sample = to_json(Sample("exp2", 10, [Exp2(["T", 3], "float32", -2, 3, layout="tma_col")]))
    (sf,), _ = samples.make_args(sample, 6, torch.Generator().manual_seed(4), "cpu")
    assert sf.shape == (6, 3) and sf.stride() == (1, 8)
    exponents = torch.log2(sf)
    assert torch.equal(exponents, exponents.round()) and exponents.min() >= -2 and exponents.max() <= 2


def test_tensor_lists_are_drawn_as_lists_and_counted_in_the_bytes():
    """A Tensors spec is drawn as a list of tensors (each as its spec says); the default bytes
    count every tensor of a list once, and a formula sees the list by name."""
    from kernels_tl.schema import Rand, Tensors

    sample = to_json(Sample("list", 10, [Randn(["T", 8], "bfloat16"),
                                         Tensors([Rand(["T", 4], "float32"), Rand(["T", 4], "float32")])]))
    args, _ = samples.make_args(sample, 10, torch.Generator().manual_seed(0), "cpu")
    assert isinstance(args[1], list) and len(args[1]) == 2 and args[1][0].shape == (10, 4)
    assert not torch.equal(args[1][0], args[1][1])
    record = {"params": [{"name": "x", "type": {"kind": "tensor"}}, {"name": "xs", "type": {"kind": "tensor_list"}}],
              "bytes": None}
    assert samples.bytes_moved(record, args, {}, {}) == 160 + 2 * 160
    assert samples.bytes_moved({**record, "bytes": "xs[1].nbytes"}, args, {}, {}) == 160
