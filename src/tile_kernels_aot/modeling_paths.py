"""The modeling paths a training or serving step runs, timed over this package's modeling functions
and over TileKernels' (``python -m tile_kernels_aot bench --modeling``):

* one training step of the Engram gate: ``modeling.engram.engram_gate`` forward and backward, at
  upstream's benchmark shape (8001 tokens, hc 4, hidden 7168, bf16);
* one decoder layer's mHC path, ``modeling.mhc.functional.mhc_pre`` -> a stand-in sublayer (an
  elementwise scale, the same on both paths) -> ``modeling.mhc.ops.mhc_post``, with mult 4 and
  hidden 2560: inference (gradients disabled, so ``mhc_pre`` takes its fused path) captured in one
  CUDA graph at 128 and 8192 tokens, and training forward + backward at 8192 tokens.

Inference is timed as graph replays; training steps (autograd, allocating) eagerly between CUDA
events, the median over rounds.  Both libraries get the same inputs and the same code around
their calls.
"""

from __future__ import annotations

import importlib
import statistics

import torch

from tile_kernels_aot.bench import capture_graph, event_us, graph_replay_us, in_worker_processes

ENGRAM_TOKENS, ENGRAM_HC, ENGRAM_HIDDEN = 8001, 4, 7168
MHC_MULT, MHC_HIDDEN = 4, 2560


def _libraries() -> dict:
    """``{label: package name}``: this package, and TileKernels when importable."""
    libs = {"ours": "tile_kernels_aot"}
    try:
        import tile_kernels  # noqa: F401
    except ImportError:
        pass
    else:
        libs["TileKernels"] = "tile_kernels"
    return libs


def _step_us(step, rounds: int = 5, iters: int = 10) -> float:
    """Device-and-host time of one eager ``step()``: CUDA events around ``iters`` steps, median
    over ``rounds`` (after a warm-up step)."""

    def steps():
        for _ in range(iters):
            step()

    return event_us(steps, reps=rounds) / iters


def engram_inputs(tokens: int = ENGRAM_TOKENS, seed: int = 0) -> list:
    """``hidden_states, k, v, weight_hidden, weight_embed`` (bf16, requiring grad) and the output
    gradient."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").bfloat16().requires_grad_()

    leaves = [leaf(tokens, ENGRAM_HC, ENGRAM_HIDDEN), leaf(tokens, ENGRAM_HC, ENGRAM_HIDDEN),
              leaf(tokens, ENGRAM_HIDDEN), leaf(ENGRAM_HC, ENGRAM_HIDDEN), leaf(ENGRAM_HC, ENGRAM_HIDDEN)]
    grad = torch.randn(tokens, ENGRAM_HC, ENGRAM_HIDDEN, generator=gen, device="cuda").bfloat16()
    return leaves + [grad]


def engram_step(package: str, inputs: list):
    """One training step of the gate over ``package``'s modeling function."""
    engram_gate = importlib.import_module(f"{package}.modeling.engram").engram_gate
    x, k, v, wh, we, grad = inputs

    def step():
        for t in (x, k, v, wh, we):
            t.grad = None
        engram_gate(x, k, v, wh, we, 0.0, 1e-20).backward(grad)

    return step


def mhc_inputs(tokens: int, seed: int = 0, grad: bool = False) -> dict:
    """The residual ``(1, tokens, M, H)`` bf16, the pre path's fp32 parameters (``fn``, ``scale``,
    ``base``), the stand-in sublayer's scale and, for training, the output gradient."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m3 = MHC_MULT * (MHC_MULT + 2)
    residual = torch.randn(1, tokens, MHC_MULT, MHC_HIDDEN, generator=gen, device="cuda").bfloat16()
    params = {
        "fn": torch.randn(m3, MHC_MULT * MHC_HIDDEN, generator=gen, device="cuda") * 1e-2,
        "scale": torch.rand(3, generator=gen, device="cuda"),
        "base": torch.randn(m3, generator=gen, device="cuda") * 1e-1,
        "sublayer": 1 + torch.rand(MHC_HIDDEN, generator=gen, device="cuda").bfloat16(),
    }
    if grad:
        residual.requires_grad_()
        for t in params.values():
            t.requires_grad_()
    params["residual"] = residual
    params["grad"] = torch.randn(residual.shape, generator=gen, device="cuda").bfloat16()
    return params


def mhc_layer(package: str, p: dict) -> torch.Tensor:
    """``mhc_pre`` -> stand-in sublayer -> ``mhc_post`` over ``package``'s modeling functions."""
    functional = importlib.import_module(f"{package}.modeling.mhc.functional")
    ops = importlib.import_module(f"{package}.modeling.mhc.ops")
    layer_input, (post_mix, comb_mix) = functional.mhc_pre(p["residual"], p["fn"], p["scale"], p["base"],
                                                           mhc_mult=MHC_MULT)
    return ops.mhc_post(layer_input * p["sublayer"], p["residual"], post_mix, comb_mix)


def mhc_training_step(package: str, p: dict):
    def step():
        for name in ("residual", "fn", "scale", "base", "sublayer"):
            p[name].grad = None
        mhc_layer(package, p).backward(p["grad"])

    return step


def _run_once(job):
    """One pass of a path over TileKernels, in a worker process: its first calls JIT-compile the
    kernels into TileLang's on-disk cache, where the bench's own calls then find them.  A
    failure is left to the bench's call to report."""
    path, tokens = job
    try:
        if path == "engram":
            engram_step("tile_kernels", engram_inputs(tokens))()
        else:
            p = mhc_inputs(tokens, grad=path == "mhc training")
            if path == "mhc training":
                mhc_training_step("tile_kernels", p)()
            else:
                with torch.no_grad():
                    mhc_layer("tile_kernels", p)
        torch.cuda.synchronize()
    except Exception:
        pass


def bench(mhc_tokens=(128, 8192), iters: int = 50) -> list:
    """Rows ``{variant, num_tokens, us}`` (or ``error``) for every path and library."""
    rows = []

    def row(variant, tokens, measure):
        try:
            rows.append({"variant": variant, "num_tokens": tokens, "us": measure()})
        except Exception as e:  # report it, keep the rest of the run
            rows.append({"variant": variant, "num_tokens": tokens, "error": f"{type(e).__name__}: {e}"[:300]})

    libs = _libraries()
    if "TileKernels" in libs:  # its modeling functions JIT-compile a dozen kernels on first calls
        jobs = [("engram", ENGRAM_TOKENS), ("mhc training", mhc_tokens[-1])] + [("mhc", t) for t in mhc_tokens]
        in_worker_processes(_run_once, jobs)
    inputs = engram_inputs()
    for label, package in libs.items():
        row(f"Engram gate training step (forward + backward), {label}", ENGRAM_TOKENS,
            lambda: _step_us(engram_step(package, inputs)))
    del inputs
    for tokens in mhc_tokens:
        p = mhc_inputs(tokens)
        for label, package in libs.items():
            def replay(package=package):
                with torch.no_grad():
                    graph, _ = capture_graph(lambda: mhc_layer(package, p))
                return statistics.median(graph_replay_us(graph, iters) for _ in range(5))

            row(f"mHC layer path, inference, one CUDA graph, {label}", tokens, replay)
    p = mhc_inputs(mhc_tokens[-1], grad=True)
    for label, package in libs.items():
        row(f"mHC layer path, training forward + backward, {label}", mhc_tokens[-1],
            lambda: _step_us(mhc_training_step(package, p)))
    return rows
