"""Samples and tolerances the mHC stream ops share (plain data: no TileLang import).

Every op runs at decode (128 tokens) and prefill (8192) with hidden 7168, at the other
hidden sizes the default table promises (2048, 2560, 4096), at TileKernels' test shapes
(``n0 x n1`` tokens flattened), and on a row whose pieces do not fill the last block
(hidden 1000, 77 tokens)."""

from kernels_tl.schema import Rand, Randn, Sample

M = 4  # mhc_mult of every sample (TileKernels' tests use 4 only)

# TileKernels 1.0.0's test shapes: tests/mhc/test_post.py (n0 in {1, 2}, n1 = 4096, hidden 1280, 2560, 7168),
# tests/mhc/test_pre_apply_mix.py (n0 in {1, 2}, n1 in {1024, 4096}, hidden 1280, 2560, 7680)
UPSTREAM_POST = [(4096, 1280), (8192, 1280), (4096, 2560), (8192, 2560), (4096, 7168), (8192, 7168)]
UPSTREAM_PRE_APPLY_MIX = [(1024, 1280), (8192, 1280), (2048, 2560), (8192, 2560), (4096, 7680), (8192, 7680)]

# Outputs whose reference order the kernel cannot follow (a cuBLAS GEMM or a PyTorch reduction
# over the hidden size): (rtol, atol of the largest |value|), see Op.tolerance and docs/ops.md.
BF16_GEMM = (2.0 ** -7, 2.0 ** -20)  # one bf16 step, plus float32 cancellation
HIDDEN_SUM = (1e-5, 1e-5)  # float32 sums over the hidden size


def hidden(h: int):
    return Randn(["T", h], "bfloat16")


def streams(h: int):
    return Randn(["T", M, h], "bfloat16")


def stream_mix():
    """A pre or post mix ``[T, M, 1]`` (positive, like the sigmoids it comes from)."""
    return Rand(["T", M, 1], "float32", 0.0, 2.0)


def comb_mix():
    return Rand(["T", M, M], "float32", 0.0, 1.0)


def samples(make, upstream=(), extra=()) -> list:
    """``make(hidden)``: the sample's positional arguments; ``upstream``: (tokens, hidden) pairs;
    ``extra``: further samples (options)."""
    out = [Sample("decode", 128, make(7168)), Sample("prefill", 8192, make(7168))]
    out += [Sample(f"hidden {h}", 1000, make(h)) for h in (2048, 2560, 4096)]
    out += [Sample(f"upstream: {t} tokens, hidden {h}", t, make(h)) for t, h in upstream]
    out += [Sample("tails: hidden 1000, 77 tokens", 77, make(1000))]
    return out + list(extra)
