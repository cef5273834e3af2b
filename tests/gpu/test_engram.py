"""engram_gate (the autograd Function on the kernels) against the reference-backed Function.

``EngramGateFn`` runs fused_weight -> engram_gate_fwd and engram_gate_bwd -> grad_w_reduce on
the prebuilt kernels; ``EngramGateRefFn`` runs the same composition on the PyTorch references
(on the same device).  The kernels reproduce the references bit for bit (the references fix
every rounding and summation order; docs/ops.md), so forward output and every gradient must be
equal bit for bit.  The kernels take bfloat16 only, so the gradient check is against the float64
reference: the kernel's gradients agree with float64 autograd within bfloat16 rounding.
"""

import pytest
import torch

from tile_kernels_aot import manifest
from tile_kernels_aot.modeling.engram import EngramGateFn, EngramGateRefFn, engram_gate, engram_gate_ref

from checks import assert_bits_equal, prebuilt_configs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EPS = 1e-20  # upstream's values
CLAMP = 1e-6


def _hidden_sizes():
    fwd = {c["hidden"] for c in prebuilt_configs("engram.engram_gate_fwd") if c["hc_mult"] == 4}
    bwd = {c["hidden"] for c in prebuilt_configs("engram.engram_gate_bwd") if c["hc_mult"] == 4}
    return sorted(fwd & bwd) or [2048]


def _leaves(lead, hidden, gen, dtype=torch.bfloat16):
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype).requires_grad_()

    return [randn(*lead, 4, hidden), randn(*lead, 4, hidden), randn(*lead, hidden), randn(4, hidden), randn(4, hidden)]


def _run(fn, leaves, grad, clamp):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves, clamp, EPS)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("hidden", _hidden_sizes())
@pytest.mark.parametrize("lead", [(128,), (2, 1000), (1,)], ids=["decode", "batched", "one"])
@pytest.mark.parametrize("clamp", [CLAMP, 0.01], ids=["clamp1e-6", "clamp0.01"])
def test_engram_gate_matches_reference_bit_for_bit(hidden, lead, clamp, gen):
    leaves = _leaves(lead, hidden, gen)
    grad = torch.randn(leaves[0].shape, generator=gen, device="cuda").bfloat16()
    out, grads = _run(engram_gate, leaves, grad, clamp)
    out_ref, grads_ref = _run(engram_gate_ref, leaves, grad, clamp)
    assert_bits_equal(out, out_ref, "output")
    for name, a, b in zip(["hidden_states", "k", "v", "weight_hidden", "weight_embed"], grads, grads_ref):
        assert_bits_equal(a, b, f"grad {name}")


def test_engram_gate_main_grad(gen):
    hidden = _hidden_sizes()[0]
    leaves = _leaves((300,), hidden, gen)
    grad = torch.randn(leaves[0].shape, generator=gen, device="cuda").bfloat16()
    results = []
    for fn in (engram_gate, engram_gate_ref):
        x, k, v, wh, we = [t.detach().clone().requires_grad_() for t in leaves]
        wh.main_grad = torch.ones(4, hidden, device="cuda")
        we.main_grad = torch.full((4, hidden), 2.0, device="cuda")
        fn(x, k, v, wh, we, CLAMP, EPS).backward(grad)
        assert wh.grad is None and we.grad is None
        results.append((wh.main_grad, we.main_grad))
    assert_bits_equal(results[0][0], results[1][0], "weight_hidden.main_grad")
    assert_bits_equal(results[0][1], results[1][1], "weight_embed.main_grad")


def _calc_diff(a, b):
    a, b = a.double(), b.double()
    return 1 - 2 * (a * b).sum() / (a * a + b * b).sum()


@pytest.mark.parametrize("clamp", [CLAMP, 0.3], ids=["clamp1e-6", "clamp0.3"])
def test_engram_gate_against_float64_reference(clamp, gen):
    """The kernels (bfloat16 in, float32 math) against autograd of the float64 reference
    Function: forward and every gradient within bfloat16 rounding (upstream's calc_diff)."""
    hidden = _hidden_sizes()[0]
    leaves = _leaves((256,), hidden, gen)
    grad = torch.randn(leaves[0].shape, generator=gen, device="cuda").bfloat16()
    out, grads = _run(engram_gate, leaves, grad, clamp)
    leaves64 = [t.detach().double() for t in leaves]
    out64, grads64 = _run(engram_gate_ref, leaves64, grad.double(), clamp)
    # the bf16 output's own rounding alone gives calc_diff of about 1.3e-6 on normal data
    # (relative error up to 2^-9): the bound is a few times that floor
    assert _calc_diff(out, out64) < 4e-6
    for name, a, b in zip(["hidden_states", "k", "v", "weight_hidden", "weight_embed"], grads, grads64):
        assert _calc_diff(a, b) < 1e-4, name


def test_reference_gradcheck_float64_on_cuda():
    """gradcheck of the reference-backed Function in float64 on the GPU (the CPU suite runs it
    on the CPU)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (2, 3, 4, 8)
    x, k = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 8, generator=gen, device="cuda", dtype=torch.float64, requires_grad=True)
    wh, we = (torch.randn(4, 8, generator=gen, device="cuda", dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda *a: EngramGateRefFn.apply(*a, 0.3, 1e-6), (x, k, v, wh, we))


def test_kernel_function_is_upstream_shaped():
    assert engram_gate == EngramGateFn.apply
    assert manifest.ops()  # the build holds ops
