"""Our SwiGLU (+ FP8 cast) references against TileKernels 1.0.0's torch references.

The oracle is what TileKernels' own tests hold its kernels to: ``swiglu_forward``
/ ``swiglu_backward`` followed by ``cast`` (tile_kernels/torch).  Everything is
compared bit for bit (``torch.equal`` on the raw bytes), except:

* ``weight_grad``, a sum over ``hidden``: the oracle sums float32 products in
  float32, we accumulate in float64; compared with a tolerance.
* The oracle's ``elementwise_fma`` is ``torch.compile(a * b + c)``: on CUDA
  (Triton) that is a fused multiply-add, like the kernel (nvcc contracts
  ``1 + x * (1 - s)``), but on the CPU Inductor does not fuse it.  We replace it
  with our exact single-rounding FMA for the comparison (which also avoids a
  half-minute compile); ``tests/cpu/test_ref_swiglu.py`` checks that FMA
  against exact rational arithmetic.
* Rows skipped through ``pos_to_expert < 0`` are unwritten by the kernel and
  masked by TileKernels' test; they are compared only as the zero bytes our
  reference defines, and the oracle's clamp counts are taken over the
  computed rows only (its ``swiglu_forward`` counts every row).
"""

import zlib

import pytest
import torch

tile_kernels = pytest.importorskip("tile_kernels")
import tile_kernels.torch as tk_torch  # noqa: E402
import tile_kernels.torch.swiglu as tk_swiglu  # noqa: E402

from tile_kernels_aot.torch import swiglu as ref  # noqa: E402

# upstream's test shape lists: per-token forward uses hidden = H // 2 for H in
# its hidden sizes divisible by 256; backward hidden = those H; per-channel all H.
_HIDDENS = [576, 2048, 2560, 3072, 4096, 6144, 7168]
FWD_HIDDENS = [h // 2 for h in _HIDDENS if h % 256 == 0]
BWD_HIDDENS = [h for h in _HIDDENS if h % 256 == 0]
# (num_topk, num_experts on this rank) from upstream's MoE parameter grid
MOE = [(2, 9), (6, 32), (8, 4), (9, 32)]


@pytest.fixture(autouse=True)
def _exact_fma(monkeypatch):
    monkeypatch.setattr(tk_swiglu, "elementwise_fma", lambda a, b, c: ref._fma_f32(a, b, float(c)))


def _gen(key) -> torch.Generator:
    """A generator seeded deterministically from the test parameters."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor (so -0.0 != 0.0 and NaN patterns count)."""
    return t.contiguous().view(torch.uint8)


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    ba, bb = _bits(a), _bits(b)
    bad = (ba != bb).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"


def make_routing(num_tokens, num_topk, num_experts, alignment, gen):
    """A random MoE layout: rows grouped by expert, each group padded to `alignment`.

    Returns pos_to_expert, pos_to_token_topk (int32 [n], -1 on padding rows),
    token_topk_to_pos (int32 [T, K], -1 where the (token, k) is not routed here),
    and pos_to_token (int64 [n], -1 on padding) to expand token rows.
    """
    scores = torch.rand(num_tokens, max(num_experts, num_topk) + 3, generator=gen)
    topk_idx = scores.topk(num_topk, dim=1).indices  # experts >= num_experts are remote
    topk_idx[topk_idx >= num_experts] = -1
    flat = topk_idx.reshape(-1)
    pos_to_expert, pos_to_token_topk = [], []
    token_topk_to_pos = torch.full((num_tokens * num_topk,), -1, dtype=torch.int32)
    for e in range(num_experts):  # a loop over experts, test-side only
        ids = (flat == e).nonzero().flatten()
        padded = -(-ids.numel() // alignment) * alignment
        start = len(pos_to_expert)
        token_topk_to_pos[ids] = torch.arange(start, start + ids.numel(), dtype=torch.int32)
        pos_to_token_topk += ids.tolist() + [-1] * (padded - ids.numel())
        pos_to_expert += [e] * ids.numel() + [-1] * (padded - ids.numel())
    p2tt = torch.tensor(pos_to_token_topk, dtype=torch.int32)
    p2t = torch.where(p2tt >= 0, p2tt.long() // num_topk, -1)
    return (torch.tensor(pos_to_expert, dtype=torch.int32), p2tt,
            token_topk_to_pos.view(num_tokens, num_topk), p2t)


def expand(x_tokens, pos_to_token, gen, pad_fill):
    """Rows of x for each position; padding rows get random data (`pad_fill`)."""
    out = x_tokens[pos_to_token.clamp(min=0)]
    pad = pos_to_token < 0
    out[pad] = pad_fill(int(pad.sum()), x_tokens.shape[1]).to(out.dtype)
    return out


# ---------------------------------------------------------------------------
# swiglu_forward_and_per_token_cast
# ---------------------------------------------------------------------------

def _fwd_params():
    # every flag combination once; hidden sizes and MoE shapes rotate through them
    params = []
    i = 0
    for with_pte in (True, False):
        for with_w in (True, False):
            for npc in (128, "hidden"):
                for col, rnd, packed in ((False, True, False), (True, True, True),
                                         (False, False, False), (True, False, False)):
                    if col and npc == "hidden":
                        continue
                    for clamp in (None, 10.0, 0.5):
                        hidden = FWD_HIDDENS[i % len(FWD_HIDDENS)]
                        params.append((hidden, with_pte, with_w, hidden if npc == "hidden" else npc,
                                       col, rnd, packed, clamp, MOE[i % len(MOE)]))
                        i += 1
    return params


@pytest.mark.parametrize("hidden,with_pte,with_w,npc,col,rnd,packed,clamp,moe", _fwd_params())
def test_swiglu_forward_and_per_token_cast(hidden, with_pte, with_w, npc, col, rnd, packed, clamp, moe):
    num_topk, num_experts = moe
    gen = _gen((hidden, with_pte, with_w, npc, col, rnd, packed, clamp))
    num_tokens = 9
    pos_to_expert, p2tt, _, p2t = make_routing(num_tokens, num_topk, num_experts, 4, gen)
    x_dtype = torch.float32 if (hidden + npc) % 3 == 0 else torch.bfloat16
    x_tok = torch.randn(num_tokens, 2 * hidden, generator=gen) * 3
    x = expand(x_tok, p2t, gen, lambda r, c: torch.randn(r, c, generator=gen) * 50).to(x_dtype)
    weights = torch.randn(num_tokens, num_topk, generator=gen)
    n = x.shape[0]
    kept = pos_to_expert >= 0 if with_pte else torch.ones(n, dtype=torch.bool)

    count = torch.randint(0, 1000, (3,), generator=gen) if clamp is not None else None
    count_ours = None if count is None else count.clone()
    out, sf = ref.swiglu_forward_and_per_token_cast(
        x, "e4m3", npc,
        pos_to_token_topk=p2tt if with_w else None, topk_weights=weights if with_w else None,
        pos_to_expert=pos_to_expert if with_pte else None,
        use_tma_aligned_col_major_sf=col, round_sf=rnd, use_packed_ue8m0=packed,
        swiglu_clamp_value=clamp, clamped_count=count_ours)

    act = tk_torch.swiglu_forward(x, p2tt if with_w else None, weights if with_w else None, clamp, None)
    act = act.masked_fill(~kept.unsqueeze(1), 0)
    out_o, sf_o = tk_torch.cast(act, "e4m3", (1, npc), round_sf=rnd,
                                use_tma_aligned_col_major_sf=col, use_packed_ue8m0=packed)

    assert out.shape == (n, hidden) and out.dtype == torch.float8_e4m3fn
    assert sf.shape == sf_o.shape and sf.dtype == sf_o.dtype and sf.stride() == sf_o.stride()
    assert_bits_equal(out[kept], out_o[kept])
    assert_bits_equal(sf[kept], sf_o[kept])
    # skipped rows: zero bytes
    assert (_bits(out[~kept]) == 0).all() and (_bits(sf[~kept]) == 0).all()
    if count is not None:
        count_o = count.clone()
        tk_torch.swiglu_forward(x[kept], swiglu_clamp_value=clamp, clamped_count=count_o)
        assert torch.equal(count_ours, count_o)


# ---------------------------------------------------------------------------
# swiglu_backward_and_per_token_cast (and the plain swiglu_backward)
# ---------------------------------------------------------------------------

def _bwd_params():
    # every flag combination with two hidden sizes (rotating through the list)
    params = []
    i = 0
    for npc in (32, 128):
        for rnd in (False, True):
            for clamp in (None, 10.0, 0.5):
                for j in range(2):
                    hidden = BWD_HIDDENS[(i + 3 * j) % len(BWD_HIDDENS)]
                    params.append((hidden, npc, rnd, clamp, MOE[(i + j) % len(MOE)]))
                i += 1
    return params


@pytest.mark.parametrize("hidden,npc,rnd,clamp,moe", _bwd_params())
def test_swiglu_backward_and_per_token_cast(hidden, npc, rnd, clamp, moe):
    num_topk, num_experts = moe
    gen = _gen((hidden, npc, rnd, clamp, 7))
    num_tokens = 5
    # (upstream aligns expert groups to num_per_channels; a small alignment keeps
    # the row count, and the CPU time, small without changing the semantics)
    _, p2tt, t2p, p2t = make_routing(num_tokens, num_topk, num_experts, 4, gen)
    x_tok = torch.randn(num_tokens, 2 * hidden, generator=gen)
    x_exp = expand(x_tok, p2t, gen, lambda r, c: torch.randn(r, c, generator=gen)).bfloat16()
    x = tk_torch.cast(x_exp, "e4m3", (1, npc))
    n = x_exp.shape[0]
    grad_out = torch.randn(n, hidden, generator=gen).bfloat16()
    weight = torch.rand(num_tokens, num_topk, generator=gen)

    out, (gq, gsf), x_grad, w_grad = ref.swiglu_backward_and_per_token_cast(
        x, grad_out, weight, p2tt, t2p, npc, round_sf=rnd, swiglu_clamp_value=clamp)

    out_o, x_grad_o, w_grad_o = tk_torch.swiglu_backward(x, grad_out, weight, p2tt, t2p, npc, clamp)
    gq_o, gsf_o = tk_torch.cast(x_grad_o, "e4m3", (1, npc), round_sf=rnd)

    assert_bits_equal(out, out_o.bfloat16())
    assert_bits_equal(x_grad, x_grad_o.bfloat16())
    assert_bits_equal(gq, gq_o)
    assert_bits_equal(gsf, gsf_o)
    # float32 sum (oracle) vs float64 accumulation (ours): a few float32 ulps of
    # the sum of |terms|; 1e-4 relative is what TileKernels allows its kernel.
    torch.testing.assert_close(w_grad, w_grad_o, rtol=1e-4, atol=1e-4)
    assert (w_grad[t2p < 0] == 0).all()

    # the plain float32 reference
    out32, x_grad32, w_grad32 = ref.swiglu_backward(x, grad_out, weight, p2tt, t2p, npc, clamp)
    assert_bits_equal(out32, out_o)
    assert_bits_equal(x_grad32, x_grad_o)
    assert_bits_equal(w_grad32, w_grad)


# ---------------------------------------------------------------------------
# swiglu_forward_and_per_channel_cast_and_transpose (and the plain swiglu_forward)
# ---------------------------------------------------------------------------

def _chan_params():
    params = []
    i = 0
    for npt in (32, 128):
        for without_transpose in (True, False):
            for rnd in (True, False):
                for clamp in (None, 10.0, 0.5):
                    params.append((_HIDDENS[i % len(_HIDDENS)], npt, without_transpose, rnd, clamp))
                    i += 1
    return params


@pytest.mark.parametrize("hidden,npt,without_transpose,rnd,clamp", _chan_params())
def test_swiglu_forward_and_per_channel_cast_and_transpose(hidden, npt, without_transpose, rnd, clamp):
    gen = _gen((hidden, npt, without_transpose, rnd, clamp))
    n = 256
    x = (torch.randn(n, 2 * hidden, generator=gen) * 2).bfloat16()
    out, sf = ref.swiglu_forward_and_per_channel_cast_and_transpose(
        x, "e4m3", npt, round_sf=rnd, without_transpose=without_transpose, swiglu_clamp_value=clamp)

    act = tk_torch.swiglu_forward(x, swiglu_clamp_value=clamp).bfloat16()
    out_o, sf_o = tk_torch.cast(act, "e4m3", (npt, 1), round_sf=rnd)
    if not without_transpose:
        out_o = out_o.T.contiguous()
    assert out.is_contiguous() and sf.is_contiguous()
    assert_bits_equal(out, out_o)
    assert_bits_equal(sf, sf_o)


@pytest.mark.parametrize("with_w", [False, True])
@pytest.mark.parametrize("clamp", [None, 0.5, 3.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_forward(with_w, clamp, dtype):
    gen = _gen((with_w, clamp, str(dtype)))
    num_tokens, num_topk = 11, 6
    _, p2tt, _, p2t = make_routing(num_tokens, num_topk, 8, 16, gen)
    x = expand(torch.randn(num_tokens, 2 * 1536, generator=gen) * 4, p2t, gen,
               lambda r, c: torch.randn(r, c, generator=gen)).to(dtype)
    weights = torch.randn(num_tokens, num_topk, generator=gen)
    count = torch.randint(0, 50, (3,), generator=gen)
    args = (p2tt, weights) if with_w else (None, None)
    c_ours, c_o = count.clone(), count.clone()
    ours = ref.swiglu_forward(x, *args, clamp, c_ours)
    theirs = tk_torch.swiglu_forward(x, *args, clamp, c_o)
    assert ours.dtype == torch.float32
    assert_bits_equal(ours, theirs)
    assert torch.equal(c_ours, c_o)
    if clamp is not None:
        assert not torch.equal(c_ours, count)  # the counts moved
