"""The bench: device time, eager time per call and host overhead of every op.

For each sample of each op (its schema's decode, prefill and upstream shapes, as the manifest
records them):

* device time: CUDA-graph replay of ``GRAPH_LAUNCHES`` launches that rotate
  over input sets larger than L2, so the time is DRAM time, not cache time,
  and the graph's own launch cost is spread over many kernels;
* kernel time: the CUPTI duration of the same launches (``torch.profiler``),
  i.e. the kernels alone, without the gaps between them (issued one at a time:
  a kernel launched as a programmatic dependent of a running one would start
  early and count its wait for it);
* at decode sizes (up to ``HOST_LOOP_TOKENS``), eager time per call, outputs passed in
  (``out=``) and allocated by the call,
  from a pipelined loop whose call site spells the arguments out (what a caller on
  the hot path sees), best of 10 rounds interleaved with the bare-launch loops;
* the bare launch cost of the same kernel with the same arguments, measured in
  the same run (``_C._replay_last_launch``), as the faster of a plain
  ``cuLaunchKernel`` loop and a loop of the op's own launch (``cuLaunchKernelEx``
  as a programmatic dependent), and the host overhead of our launch path above it:
  the median over rounds of the op loop minus the faster bare loop of the same round
  ("paired"), and, for reference, best op loop minus best bare loop ("best-of").  The
  paired figure is the one reported as the overhead: a tight loop of bare launches can
  hit rounds in which the driver's launch call itself is faster than whenever any host
  work separates the launches (seen for swiglu's 128-token kernel: up to 0.5 us), and a
  best-of baseline picks exactly those rounds, which no caller's loop reaches;
* bytes moved (the schema's formula, by default every tensor argument and output once), TB/s, and the
  share of the device-to-device copy bandwidth measured in the same run;
* the PyTorch reference and, when importable, TileKernels' JIT kernels (device
  time, kernel time and eager time per call, measured the same way as ours).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
import warnings

import torch

from tile_kernels_aot import manifest, samples

L2_BYTES = 60 * 1024 * 1024
# Launches per captured graph.  With only the 2-3 input sets a prefill shape needs
# to exceed L2, the graph's own launch latency (several us) divided by 2 would be
# counted as device time; 64 launches spread it to a few percent of a microsecond.
GRAPH_LAUNCHES = 64
# Host-time loops (eager time, bare launch, overhead) run for samples up to this many tokens:
# at larger ones the GPU, not the host, bounds a loop of calls.
HOST_LOOP_TOKENS = 1024


def _cases(only=None, sample_prefixes=None) -> list:
    """(op record, sample) for every sample of every op of this build (``only``: op names;
    ``sample_prefixes``: keep the samples whose name starts with one of them)."""
    cases = []
    for record in manifest.ops():
        qualname = f"{record['module']}.{record['name']}"
        if only and qualname not in only:
            continue
        cases += [(record, sample) for sample in record["samples"]
                  if not sample_prefixes or sample["name"].startswith(tuple(sample_prefixes))]
    return cases


def _cycle(calls, n):
    """At least ``n`` launches taken in turn from ``calls`` (one per input set)."""
    return [calls[i % len(calls)] for i in range(max(n, len(calls)))]


def _graph_time_us(calls, reps=20):
    """Device time of one call: CUDA-graph replays of ``GRAPH_LAUNCHES`` launches
    cycling over ``calls`` (one per input set), median over replays."""
    launches = _cycle(calls, GRAPH_LAUNCHES)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for c in launches:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(launches))
    del graph
    return statistics.median(times)


def _kernel_time_us(calls, rounds=4):
    """GPU kernel time of one call from CUPTI (``torch.profiler``): the summed
    durations of every kernel the calls launched, over the number of calls.  The
    calls are issued eagerly, cycling over the input sets, each after the previous
    one has finished (our kernels start as programmatic dependents of a running
    predecessor, and their duration would then include the wait for it)."""
    from torch.profiler import ProfilerActivity, profile

    launches = _cycle(calls, 16)
    for c in launches:
        c()
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # torch's notice that events are per profiling cycle
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(rounds):
                for c in launches:
                    c()
                    torch.cuda.synchronize()
    total = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total / (rounds * len(launches))


def _direct_call(fn, args, kwargs):
    """A closure calling ``fn(*args, **kwargs)`` with the arguments spelled out at its call
    site (positional, then keywords), as a caller's code calls an op: no dict is built and
    unpacked on every call, which a generic ``lambda: fn(*args, **kwargs)`` would time too."""
    names = [f"a{i}" for i in range(len(args))] + [f"k_{k}" for k in kwargs]
    call = ", ".join([f"a{i}" for i in range(len(args))] + [f"{k}=k_{k}" for k in kwargs])
    env = {}
    exec(f"def make(fn, {', '.join(names)}):\n    return lambda: fn({call})\n", env)
    return env["make"](fn, *args, *kwargs.values())


def capture_graph(fn):
    """One CUDA graph of ``fn()`` (warmed up once on a side stream, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def graph_replay_us(graph, iters: int) -> float:
    """Device time per replay: CUDA events around ``iters`` back-to-back replays."""
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1000 / iters


def variant_table(rows: list, subject: str, unit: str) -> str:
    """A markdown table of ``{variant, num_tokens, us}`` rows (or ``error`` in place of ``us``)."""
    lines = [f"| {subject} | tokens | {unit} |", "| --- | ---: | ---: |"]
    for r in rows:
        value = f"{r['us']:.1f}" if "us" in r else f"failed: {r['error']}"
        lines.append(f"| {r['variant']} | {r['num_tokens']} | {value} |")
    return "\n".join(lines)


def loop_us(fn, n):
    """Host time per call of one pipelined loop of ``n`` calls (synchronized at its end)."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def _rounds_us(loops, n=2500, rounds=10):
    """Host time per call of pipelined loops of ``n`` calls (after 100 warm-up calls each),
    run interleaved: each round runs every loop once, in turn, so that a passing
    disturbance of the host (they last longer than one loop) does not fall on one loop
    alone.  (H200 cloud hosts are virtual machines whose speed drifts over tens of
    milliseconds.)  ``loops``: name -> (fn, before), where ``before`` (or None) runs ahead
    of each of the loop's rounds.  Returns name -> the loop's time in each round."""
    for fn, before in loops.values():
        if before is not None:
            before()
        for _ in range(100):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in loops}
    for _ in range(rounds):
        for name, (fn, before) in loops.items():
            if before is not None:
                before()
            times[name].append(loop_us(fn, n))
    return times


def event_us(fn, reps=20):
    """Device-and-host time of one ``fn()`` between CUDA events, median over ``reps`` (after
    one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth_tbs() -> float:
    """Device-to-device copy of 1 GiB (bytes read + written over time), timed eagerly with
    events (captured in a CUDA graph it becomes a memcpy node, which runs at about 2.7 TB/s
    here), after ~0.5 s of copies so the clocks have ramped up; the best of several rounds."""
    src = torch.randn(256 * 1024 * 1024, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    for _ in range(1000):
        dst.copy_(src)
    best = min(event_us(lambda: dst.copy_(src), reps=20) for _ in range(3))
    del src, dst
    return 2 * 4 * 256 * 1024 * 1024 / best / 1e6


def first_call_ms():
    """A fresh process: torch imported and CUDA initialised first (not counted), then
    the package imported and one op called and synchronized: ``moe.topk_gate`` on 128
    tokens with the largest expert count of the first prebuilt class.  None when this build has no
    topk_gate."""
    configs = manifest.configs("moe.topk_gate")
    if not configs:
        return None
    experts = configs[0]["max_experts"]  # the class's largest expert count: a count it serves
    code = (
        "import time, torch\n"
        f"x = torch.randn(128, {experts}, device='cuda'); torch.cuda.synchronize()\n"
        "t = time.perf_counter()\n"
        "from tile_kernels_aot import moe\n"
        f"moe.topk_gate(x, {min(8, experts)}); torch.cuda.synchronize()\n"
        "print((time.perf_counter() - t) * 1e3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def bench_op(record, sample, copy_tbs):
    """One row: device time, eager and bare-launch host times (at decode sizes), the reference.
    Returns the row and what the later passes (kernel time, TileKernels) need: the rotating
    calls and the inputs."""
    from tile_kernels_aot import _C

    op = f"{record['module']}.{record['name']}"
    fn = samples.function(record)
    n = sample["tokens"]
    gen = torch.Generator(device="cuda").manual_seed(n)
    args, kwargs = samples.make_args(sample, n, gen)

    def produced(result):  # outputs by name, less the optional ones this call does not produce
        return {k: v for k, v in samples.outputs_by_name(record, result).items() if v is not None}

    first = produced(fn(*args, **kwargs))
    flat = [t for v in list(args) + list(kwargs.values()) for t in (v if isinstance(v, (tuple, list)) else (v,))]
    per_call = sum(t.nbytes for t in flat if isinstance(t, torch.Tensor))  # (data, sf) pairs, tensor lists included
    per_call += sum(t.untyped_storage().nbytes() for t in first.values())
    sets = max(2, min(64, math.ceil(3 * L2_BYTES / max(per_call, 1))))
    inputs = [samples.make_args(sample, n, gen) for _ in range(sets)]
    out_sets = [produced(fn(*a, **k)) for a, k in inputs]
    calls = [lambda a=a, k=k, o=o: fn(*a, **k, **o) for (a, k), o in zip(inputs, out_sets)]
    device_us = _graph_time_us(calls)
    bytes_moved = samples.bytes_moved(record, args, kwargs, first)
    row = {
        "op": op, "sample": sample["name"], "num_tokens": n, "device_us": device_us, "bytes": bytes_moved,
        "tbs": bytes_moved / device_us / 1e6, "copy_share": bytes_moved / device_us / 1e6 / copy_tbs,
        "input_sets": sets,
    }
    if n <= HOST_LOOP_TOKENS:
        # the outputs of input set 0 with that set's arguments: a sample whose output shapes follow
        # its drawn data (a routing's exact rows) does not fit another draw's outputs
        args0, kwargs0 = inputs[0]
        call_out = _direct_call(fn, args0, {**kwargs0, **out_sets[0]})
        # Two baselines: plain cuLaunchKernel, and the op's own launch (cuLaunchKernelEx as a
        # programmatic dependent), which also overlaps the previous kernel's tail on the GPU;
        # at small shapes a loop of either can be bound by the GPU rather than the host.  The
        # overhead is taken over the faster of the two.  Both replay the launch of a call with
        # out= (made right before them), never one into freed outputs.
        rounds = _rounds_us({
            "out": (call_out, None),
            "alloc": (_direct_call(fn, args0, kwargs0), None),
            "bare_plain": (lambda: _C._replay_last_launch(1), call_out),
            "bare_dependent": (lambda: _C._replay_last_launch(1, True), call_out),
        })
        host = {name: min(t) for name, t in rounds.items()}
        bare = min(host["bare_plain"], host["bare_dependent"])
        bare_rounds = [min(p, d) for p, d in zip(rounds["bare_plain"], rounds["bare_dependent"])]
        row.update({
            "eager_out_us": host["out"], "eager_alloc_us": host["alloc"], "bare_launch_us": bare,
            "bare_plain_us": host["bare_plain"], "bare_dependent_us": host["bare_dependent"],
            "overhead_out_us": host["out"] - bare, "overhead_alloc_us": host["alloc"] - bare,
            "overhead_out_paired_us": statistics.median(o - b for o, b in zip(rounds["out"], bare_rounds)),
            "overhead_alloc_paired_us": statistics.median(a - b for a, b in zip(rounds["alloc"], bare_rounds)),
        })
    ref = samples.reference(record)
    row["reference_us"] = event_us(lambda: ref(*args, **kwargs), reps=5)
    return row, calls, (args, inputs, kwargs)


def _tilekernels_norm_fn_bwd_mul(out_mul_grad, sqrsum_grad, residual, mhc_fn, x_grad=None):
    """What TileKernels' ``MHCPreNormFn.backward`` runs for our ``mhc.mhc_pre_norm_fn_bwd_mul``:
    its ``_mhc_pre_norm_fn_bwd_mul`` kernel (TF32 tensor cores), which adds into ``x_grad`` (a
    zero one when none is given, as that backward allocates without fused accumulation) and
    writes ``fn_grad``."""
    from tile_kernels.mhc.norm_fn_kernel import _mhc_pre_norm_fn_bwd_mul

    m3, k = mhc_fn.shape
    x = residual.reshape(-1, k)
    x_grad = torch.zeros_like(x) if x_grad is None else x_grad.view(-1, k)
    fn_grad = torch.empty_like(mhc_fn)
    _mhc_pre_norm_fn_bwd_mul(m3, 1, k)(out_mul_grad.view(-1, 1, m3), sqrsum_grad.view(-1, 1), x, mhc_fn, x_grad,
                                       fn_grad)
    return x_grad, fn_grad


def _tilekernels_expand_to_mhc_bwd(out_grad):
    """What TileKernels' ``ExpandToMHCFn.backward`` runs for our ``mhc.expand_to_mhc_bwd``: its
    ``expand_to_mhc_bwd_tl`` kernel, summing the stream gradients into a new ``hidden_grad``."""
    from tile_kernels.mhc.expand_kernel import expand_to_mhc_bwd_tl

    mhc_mult, hidden = out_grad.shape[-2:]
    out_grad = out_grad.flatten(0, -3)
    hidden_grad = out_grad.new_empty(out_grad.shape[0], hidden)
    expand_to_mhc_bwd_tl(hidden, mhc_mult)(out_grad, hidden_grad)
    return hidden_grad


def _tilekernels_head_compute_mix_bwd(output_mix_grad, input_mix, mhc_scale, mhc_base):
    """What TileKernels' ``MHCHeadComputeMix.backward`` runs for our ``mhc.mhc_head_compute_mix_bwd``:
    its ``_mhc_head_compute_mix_bwd`` kernel (one block per SM, per-SM partial scale and base
    gradients), then the sums of the partials over the SMs."""
    from tile_kernels.config import get_num_sms
    from tile_kernels.mhc.head_compute_mix_kernel import _mhc_head_compute_mix_bwd

    # the flat views: upstream_args gives the token-leading tensors a leading 1, and, at one
    # token, the [1] scale too
    mhc_mult = input_mix.shape[-1]
    input_mix = input_mix.view(-1, mhc_mult)
    mhc_scale, mhc_base = mhc_scale.view(-1), mhc_base.view(-1)
    num_sms = get_num_sms()
    input_mix_grad = torch.empty_like(input_mix)
    mhc_scale_grad_partial = torch.empty(num_sms, *mhc_scale.shape, dtype=mhc_scale.dtype, device=mhc_scale.device)
    mhc_base_grad_partial = torch.empty(num_sms, *mhc_base.shape, dtype=mhc_base.dtype, device=mhc_base.device)
    _mhc_head_compute_mix_bwd(mhc_mult, token_block_size=32, num_sms=num_sms)(
        output_mix_grad.view(-1, mhc_mult), input_mix, mhc_scale, mhc_base, input_mix_grad,
        mhc_scale_grad_partial, mhc_base_grad_partial)
    return input_mix_grad, mhc_scale_grad_partial.sum(0), mhc_base_grad_partial.sum(0)


def _tilekernels_pre_apply_mix_bwd(o_grad, x, mix, x_grad=None):
    """What TileKernels' ``MHCPreApplyMix.backward`` runs for our ``mhc.mhc_pre_apply_mix_bwd``: its
    ``_mhc_pre_apply_mix_bwd`` kernel, which adds into ``x_grad`` (in place: the fused accumulation's
    buffer; a zero one when none is given, as that backward allocates without it) and allocates
    ``mix_grad``."""
    from tile_kernels.mhc.pre_apply_mix_kernel import _mhc_pre_apply_mix_bwd

    mhc_mult, hidden = x.shape[-2:]
    x = x.view(-1, mhc_mult, hidden)
    x_grad = torch.zeros_like(x) if x_grad is None else x_grad.view(-1, mhc_mult, hidden)
    mix_grad = _mhc_pre_apply_mix_bwd(mhc_mult, hidden)(o_grad.view(-1, hidden), x,
                                                         mix.view(-1, mhc_mult), x_grad)
    return x_grad, mix_grad.view(-1, mhc_mult, 1)


def _tilekernels_saved_post_layer_mix(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value):
    """The ``post_layer_mix`` that TileKernels' ``MHCPreSplitMixes.forward`` saves for its backward
    (``sigmoid(input_mixes[:, M:2M] * mhc_scale[1] + mhc_base[M:2M]) * mhc_post_mult_value``, [N, M]),
    which our op recomputes and does not receive.  Computed on the first call with an input tensor
    and kept on that tensor object (the bench passes the same objects on every call), so that the
    timed calls run only what the backward runs."""
    key = (mhc_scale.data_ptr(), mhc_base.data_ptr(), mhc_mult, mhc_post_mult_value)
    saved = getattr(input_mixes, "_tilekernels_post_layer_mix", None)
    if saved is None or saved[0] != key:
        mixes = input_mixes.view(-1, input_mixes.shape[-1])
        z = mixes[:, mhc_mult:2 * mhc_mult] * mhc_scale.view(-1)[1] + mhc_base.view(-1)[mhc_mult:2 * mhc_mult]
        saved = key, torch.sigmoid(z) * mhc_post_mult_value
        input_mixes._tilekernels_post_layer_mix = saved
    return saved[1]


def _tilekernels_pre_split_mixes_bwd(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes,
                                     mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value):
    """What TileKernels' ``MHCPreSplitMixes.backward`` runs for our ``mhc.mhc_pre_split_mixes_bwd``:
    its ``_mhc_pre_split_mixes_bwd`` kernel (one block per SM, reading the forward's saved
    ``post_layer_mix``), then the sums of the per-SM partial scale and base gradients."""
    from tile_kernels.config import get_num_sms
    from tile_kernels.mhc.pre_split_mixes_kernel import _mhc_pre_split_mixes_bwd

    post_layer_mix = _tilekernels_saved_post_layer_mix(input_mixes, mhc_scale, mhc_base, mhc_mult,
                                                       mhc_post_mult_value)
    input_mixes = input_mixes.view(-1, input_mixes.shape[-1])
    mhc_scale, mhc_base = mhc_scale.view(-1), mhc_base.view(-1)
    num_tokens, num_sms = input_mixes.shape[0], get_num_sms()
    input_mixes_grad = torch.empty_like(input_mixes)
    mhc_scale_grad_partial = torch.empty(num_sms, *mhc_scale.shape, dtype=mhc_scale.dtype, device=mhc_scale.device)
    mhc_base_grad_partial = torch.empty(num_sms, *mhc_base.shape, dtype=mhc_base.dtype, device=mhc_base.device)
    _mhc_pre_split_mixes_bwd(mhc_mult, mhc_post_mult_value, token_block_size=32, num_sms=num_sms)(
        pre_layer_mix_grad.view(num_tokens, mhc_mult), post_layer_mix_grad.view(num_tokens, mhc_mult),
        comb_res_mix_grad.view(num_tokens, mhc_mult * mhc_mult), input_mixes, post_layer_mix, mhc_scale, mhc_base,
        input_mixes_grad, mhc_scale_grad_partial, mhc_base_grad_partial)
    return input_mixes_grad, mhc_scale_grad_partial.sum(0), mhc_base_grad_partial.sum(0)


def _tilekernels_sinkhorn_normalize_bwd(grad_output, x, repeat=10, eps=1e-6):
    """What TileKernels' ``_SinkhornNormalize.backward`` runs for our ``mhc.sinkhorn_normalize_bwd``:
    its ``_mhc_sinkhorn_bwd`` kernel (32 tokens a block; repeat and eps fixed at its build, taken
    from our arguments) into a new ``grad_input``."""
    from tile_kernels.mhc.sinkhorn_kernel import _mhc_sinkhorn_bwd

    n = x.shape[-1]
    x = x.view(-1, n, n)
    grad_input = torch.empty_like(x)
    _mhc_sinkhorn_bwd(n, 32, repeat, eps)(grad_output.view(-1, n, n), x, grad_input)
    return grad_input


# ops whose TileKernels counterpart is a kernel without a public function (run inside one of
# its autograd Functions): the call that runs it on our op's arguments.  (mhc.mhc_post_bwd needs
# none: tile_kernels.modeling.mhc.ops.post exports TileKernels' mhc_post_bwd.)
_UPSTREAM_KERNELS = {
    "mhc.expand_to_mhc_bwd": _tilekernels_expand_to_mhc_bwd,
    "mhc.mhc_head_compute_mix_bwd": _tilekernels_head_compute_mix_bwd,
    "mhc.mhc_pre_apply_mix_bwd": _tilekernels_pre_apply_mix_bwd,
    "mhc.mhc_pre_norm_fn_bwd_mul": _tilekernels_norm_fn_bwd_mul,
    "mhc.mhc_pre_split_mixes_bwd": _tilekernels_pre_split_mixes_bwd,
    "mhc.sinkhorn_normalize_bwd": _tilekernels_sinkhorn_normalize_bwd,
}


def upstream_function(op: str):
    """TileKernels' function for our op ``module.name``: at the same path under ``tile_kernels``,
    or, for a family whose package exports no functions (mHC), in a module of
    ``tile_kernels.modeling.<family>.ops`` or of ``tile_kernels.<family>`` that defines it, or
    the call of its kernel in ``_UPSTREAM_KERNELS``."""
    import importlib
    import pkgutil

    if op in _UPSTREAM_KERNELS:
        return _UPSTREAM_KERNELS[op]
    module, name = op.split(".")
    family = importlib.import_module(f"tile_kernels.{module}")
    if callable(getattr(family, name, None)):
        return getattr(family, name)
    for package in (f"tile_kernels.modeling.{module}.ops", f"tile_kernels.{module}"):
        try:
            path = importlib.import_module(package).__path__
        except ImportError:
            continue
        for info in pkgutil.iter_modules(path):
            candidate = getattr(importlib.import_module(f"{package}.{info.name}"), name, None)
            if callable(candidate):
                return candidate
    raise AttributeError(f"TileKernels has no function for {op}")


def upstream_args(op: str, args, kwargs, tokens: int):
    """The arguments of TileKernels' function for ``op``: ours, except that integer pairs are
    tuples (a sample's ``x_block_size`` comes back from the manifest's JSON as a list, which
    upstream's asserts refuse) and that upstream's mHC ops take a leading sequence dimension
    (``(num_seqs, num_tokens, ...)``), which ours flatten, so each token-leading tensor gets a
    leading dimension of 1 there."""
    mhc = op.startswith("mhc.")

    def seq(v):
        if isinstance(v, list) and v and all(isinstance(i, int) for i in v):
            return tuple(v)
        if isinstance(v, list):  # a tensor list
            return [seq(t) for t in v]
        return v.unsqueeze(0) if mhc and isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == tokens else v

    return [seq(v) for v in args], {k: seq(v) for k, v in kwargs.items()}


def _compile_tilekernels(job):
    """One TileKernels call on a sample's inputs, in a worker process: its first call JIT-compiles
    the kernel and stores it in TileLang's on-disk kernel cache, where the bench's own first call
    then finds it.  A failure is left to that call to report."""
    op, sample = job
    try:
        gen = torch.Generator(device="cuda").manual_seed(sample["tokens"])
        args, kwargs = samples.make_args(sample, sample["tokens"], gen)
        args, kwargs = upstream_args(op, args, kwargs, sample["tokens"])
        upstream_function(op)(*args, **kwargs)
        torch.cuda.synchronize()
    except Exception:
        pass


def in_worker_processes(fn, jobs, workers=None) -> None:
    """``fn(job)`` for every job, in parallel spawned worker processes (at most ``workers``,
    default the host's cores less two, up to 12).  Used to JIT-compile TileKernels' kernels ahead
    of the timed calls: each compile takes ~7 s of host time, almost all of it outside the GPU,
    and TileLang's on-disk cache hands the result to this process."""
    import concurrent.futures
    import multiprocessing
    import os

    workers = workers or max(1, min(12, (os.cpu_count() or 2) - 2, len(jobs)))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        list(pool.map(fn, jobs))


def bench_tilekernels(row, args, inputs, kwargs):
    """TileKernels' JIT kernel for the same op and inputs, measured as ours (it allocates
    its outputs on every call: it has no out=)."""
    try:
        upstream = upstream_function(row["op"])
        args, kwargs = upstream_args(row["op"], args, kwargs, row["num_tokens"])
        inputs = [upstream_args(row["op"], a, k, row["num_tokens"]) for a, k in inputs]
        upstream(*args, **kwargs)  # the first call compiles
        up_calls = [lambda a=a, k=k: upstream(*a, **k) for a, k in inputs]
        row["tilekernels_eager_us"] = min(_rounds_us({"eager": (_direct_call(upstream, args, kwargs), None)},
                                                     n=500, rounds=3)["eager"])
        row["tilekernels_device_us"] = _graph_time_us(up_calls)
        row["tilekernels_kernel_us"] = _kernel_time_us(up_calls)
    except Exception as e:  # report it, keep the rest of the run
        row["tilekernels_error"] = f"{type(e).__name__}: {e}"[:300]


def _tilekernels_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("tile_kernels") is not None


def _context_lost(error: Exception) -> bool:
    """Whether ``error`` is a fault that leaves this process's CUDA context unusable (an illegal
    address, a trap, a launch timeout: the driver reports it on every later call)."""
    text = str(error)
    return any(code in text for code in ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
                                          "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_HARDWARE_STACK_ERROR",
                                          "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_LAUNCH_TIMEOUT",
                                          "illegal memory access", "unspecified launch failure"))


def run(json_path=None, only=None, sample_prefixes=None) -> int:
    """Host-time loops first, in a process that has not loaded CUPTI (the profiler) or
    TileLang (TileKernels), which both slow the host path; then the CUPTI kernel times;
    then TileKernels, when importable (its kernels compiled beforehand in worker processes,
    so that no compile runs beside our host-time loops)."""
    if not torch.cuda.is_available():
        print("bench: no CUDA device", file=sys.stderr)
        return 1
    cases = _cases(only, sample_prefixes)
    with_tilekernels = _tilekernels_importable()
    if with_tilekernels:
        started = time.perf_counter()
        in_worker_processes(_compile_tilekernels,
                            [(f"{r['module']}.{r['name']}", s) for r, s in cases if not s.get("host_sync")])
        print(f"bench: TileKernels compiled in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    copy_tbs = copy_bandwidth_tbs()
    gpu = torch.cuda.get_device_name()  # before any op: a fault below leaves CUDA unusable
    rows, later, skipped, lost = [], [], [], False
    for record, sample in cases:
        if sample.get("host_sync"):  # waits for the device: no CUDA graph, no pipelined loop
            skipped.append({"op": f"{record['module']}.{record['name']}", "sample": sample["name"],
                            "num_tokens": sample["tokens"], "reason": "the call synchronizes with the host"})
            continue
        # progress on stderr: a kernel fault stops the process, and this names the sample
        print(f"bench: {record['module']}.{record['name']} [{sample['name']}]", file=sys.stderr, flush=True)
        try:
            row, calls, data = bench_op(record, sample, copy_tbs)
        except Exception as e:  # a build from another shape table may lack a sample's config
            reason = (str(e).split(". Prebuilt:")[0] if "no prebuilt kernel" in str(e)
                      else f"failed: {type(e).__name__}: {e}"[:300])
            skipped.append({"op": f"{record['module']}.{record['name']}", "sample": sample["name"],
                            "num_tokens": sample["tokens"], "reason": reason})
            print(f"bench: skipped: {reason}", file=sys.stderr, flush=True)
            if _context_lost(e):  # every later CUDA call fails with this error: report what ran
                later, with_tilekernels, lost = [], False, True
                break
            continue
        rows.append(row)
        later.append((row, calls, data))
    first = first_call_ms()
    for row, calls, _ in later:
        row["kernel_us"] = _kernel_time_us(calls)

    def report():
        result = {"gpu": gpu, "torch": torch.__version__, "copy_tbs": copy_tbs,
                  "first_call_ms": first, "date": time.strftime("%Y-%m-%d"), "rows": rows, "skipped": skipped}
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=1)
        print(format_table(result), flush=True)

    if not with_tilekernels:
        report()
        return 1 if lost else 0
    # our rows first, so that they stand even if TileKernels' compiles run past a time limit
    report()
    for row, _, data in later:
        bench_tilekernels(row, *data)
    print("\nWith TileKernels:\n", flush=True)
    report()
    return 0


def format_table(result: dict) -> str:
    first = result["first_call_ms"]
    first = f"{first:.1f} ms" if first is not None else "not measured (no prebuilt moe.topk_gate)"
    lines = [f"{result['gpu']}, torch {result['torch']}, {result['date']}: copy bandwidth {result['copy_tbs']:.2f} TB/s, "
             f"first call in a fresh process {first}", "",
             "| op | sample | tokens | device us | kernel us | TB/s | % of copy | eager out= us | eager alloc us | "
             "bare launch us | overhead out= us | overhead alloc us | best-of out= / alloc us | torch ref us |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        if "eager_out_us" in r:  # host loops ran (decode-sized samples)
            host = (f"{r['eager_out_us']:.2f} | {r['eager_alloc_us']:.2f} | {r['bare_launch_us']:.2f} | "
                    f"{r['overhead_out_paired_us']:+.2f} | {r['overhead_alloc_paired_us']:+.2f} | "
                    f"{r['overhead_out_us']:+.2f} / {r['overhead_alloc_us']:+.2f}")
        else:
            host = "- | - | - | - | - | -"
        # no kernel time for the rows before a fault that lost the CUDA context (CUPTI needs it)
        kernel = f"{r['kernel_us']:.1f}" if "kernel_us" in r else "-"
        lines.append(f"| {r['op']} | {r.get('sample', '')} | {r['num_tokens']} | {r['device_us']:.1f} | "
                     f"{kernel} | {r['tbs']:.2f} | {100 * r['copy_share']:.0f}% | {host} | "
                     f"{r['reference_us']:.1f} |")
    upstream = [r for r in result["rows"] if "tilekernels_kernel_us" in r]
    if upstream:
        lines += ["", "TileKernels JIT on the same inputs, measured the same way:", "",
                  "| op | sample | tokens | device us | kernel us | eager (alloc) us | ours: device us | ours: kernel us |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in upstream:
            lines.append(f"| {r['op']} | {r.get('sample', '')} | {r['num_tokens']} | {r.get('tilekernels_device_us', math.nan):.1f} | {r['tilekernels_kernel_us']:.1f} | "
                         f"{r['tilekernels_eager_us']:.2f} | {r['device_us']:.1f} | {r['kernel_us']:.1f} |")
    for r in result["rows"]:
        if "tilekernels_error" in r:
            lines.append(f"TileKernels {r['op']} at {r['num_tokens']} tokens failed: {r['tilekernels_error']}")
    for r in result.get("skipped", []):
        lines.append(f"Skipped {r['op']} ({r.get('sample', '')}, {r['num_tokens']} tokens): {r['reason']}")
    return "\n".join(lines)
