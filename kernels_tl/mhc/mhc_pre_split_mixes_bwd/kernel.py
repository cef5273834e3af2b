"""mhc.mhc_pre_split_mixes_bwd: gradient of ``mhc_pre_split_mixes``.

Gradients ``pre_layer_mix_grad``, ``post_layer_mix_grad`` fp32 [num_tokens, M] (the
``(N, M, 1)`` tensors), ``comb_res_mix_grad`` fp32 [num_tokens, M * M] and the forward
inputs ``input_mixes`` fp32 [num_tokens, M3], ``mhc_scale`` [3], ``mhc_base`` [M3] ->
``input_mixes_grad`` fp32 [num_tokens, M3], ``mhc_scale_grad`` [3], ``mhc_base_grad``
[M3].  In float32, each operation rounded on its own (the reference's order), with
``z = input_mixes * scale[k] + base`` and ``sg = sigmoid(z)`` as in the forward pass:

    g_z = (g_pre * (1 - sg)) * sg  |  ((g_post * post_mult_value) * (1 - sg)) * sg  |  g_comb
    input_mixes_grad = g_z * scale[k]
    mhc_base_grad[j] = sum_t g_z[t, j];   S[j] = sum_t g_z[t, j] * input_mixes[t, j]
    mhc_scale_grad[k] = S[first of group k] + ... (left to right over the group's mixes)

with the sums over tokens in ``tile_kernels_aot.torch.mhc._token_sum``'s order: lane ``l`` of
``LANES`` adds tokens ``l, l + LANES, ...`` in order from zero, then a pairwise tree over the
lanes, neighbours first.  Two kernels (the static key ``path``; the host picks by the token
count): ``"cluster"`` for at most ``CLUSTER_TOKENS`` tokens (one launch), ``"blocks"`` above
(two).

``path="cluster"``
------------------
As ``mhc_head_compute_mix_bwd``: one cluster of ``CLUSTER`` blocks of ``mix_math.THREADS``
threads, a thread per lane with ``2 * M3`` running sums in registers (48 for M = 4), the fixed
lane tree through shuffles, shared and distributed shared memory (``kernels_tl/mhc/mix_math.py``),
rank 0 writing the small gradients.  Eight SMs: a round of lanes (``LANES`` tokens) per pass.

``path="blocks"``
-----------------
Every value is elementwise in ``(token, mix)``, so the work is spread over the elements, not
over tokens: ``BLOCKS`` blocks of ``THREADS`` threads, block ``b`` owning the
``LANES_PER_BLOCK`` lanes ``[b * LANES_PER_BLOCK, ...)``, i.e. in every round ``r`` (tokens
``r * LANES .. + LANES - 1``) the contiguous slice of ``LANES_PER_BLOCK * M3`` elements of
tokens ``r * LANES + b * LANES_PER_BLOCK + ...``: thread ``t`` takes the slice's elements
``t, t + THREADS, ...`` (``per_thread`` of them), the same (lane, mix) pairs in every round, so
its running sums follow the lane's token order.  Loads and stores are contiguous across the
block.  ``in_flight`` rounds are loaded before the first of them is used.

The kernel is launched twice per call (the ``phase`` argument):

- phase 0: each block walks the rounds, writes ``input_mixes_grad`` and keeps per element two
  running sums (``g_z`` and ``g_z * input_mixes``); the block's ``LANES_PER_BLOCK`` lanes are a
  whole subtree of the lane tree, which the block sums in shared memory and writes as its
  ``2 * M3`` partials to ``scratch[b]``;
- phase 1 (it waits for phase 0 at its first instruction: the programmatic-dependent-launch
  wait returns once the previous grid has completed): block 0 reads the ``BLOCKS`` partials
  and finishes the tree level by level in shared memory (neighbours first), then writes the
  base gradient and each group's scale gradient.  The other blocks exit.

Both: no atomics and no zeroed memory (every element of the scratch is written by phase 0);
zero tokens still launch and write zero gradients.  Every product and sum is an explicit IEEE
operation, so nvcc cannot contract them into FMAs.  ``M`` is static; the token count dynamic
(offsets 64-bit).
"""


from tilelang import language as T

from kernels_tl.dependent_launch import wait_for_previous_grid
from tilelang.cuda.language import block_rank_in_cluster

from kernels_tl.mhc import mix_math
from kernels_tl.mhc.mix_math import CLUSTER, CLUSTER_LOAD_SOURCE, LANES, cluster_token_sum, pair_tree, sigmoid

PATHS = ("cluster", "blocks")

LANES_PER_BLOCK = 16  # a subtree of the lane tree per block (16 tokens of a round: 1.5 KB of mixes at M 4)
BLOCKS = LANES // LANES_PER_BLOCK  # 128: one wave on the H200's 132 SMs
THREADS = 128  # 3 elements per thread at M 4 (16 x 24 = 384 per round)
LOADS_IN_FLIGHT = 12  # elements a thread loads before using any (rounds in flight = this / per_thread)
TREE_LEVELS = BLOCKS.bit_length() - 1  # phase 1: levels of the tree over the blocks' partials
# the host's boundary between the kernels: at 128 tokens the cluster kernel measured 6.2 us
# against the blocks kernel's 6.4, at 256 9.8 against 6.4 (257 tokens)
CLUSTER_TOKENS = 128
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def host_constants(mhc_mult, path):
    return {"blocks": BLOCKS, "cluster_tokens": CLUSTER_TOKENS}


@T.macro
def _write_small_grads(sums, m, tid, mhc_scale_grad, mhc_base_grad):
    """From the totals ``sums[0:M3]`` (g_z) and ``sums[M3:2 M3]`` (g_z * input_mixes), in
    shared memory: the base gradient, and group ``tid``'s scale gradient, its mixes left to
    right."""
    m3 = m * (m + 2)
    if tid < m3:
        mhc_base_grad[tid] = sums[tid]
    if tid < 3:
        first = T.if_then_else(tid == 0, 0, T.if_then_else(tid == 1, m, 2 * m))
        size = T.if_then_else(tid == 2, m * m, m)
        total = T.alloc_var(T.float32)
        total = sums[m3 + first]
        for j in T.serial(1, size):
            total = T.ieee_add(total, sums[m3 + first + j])
        mhc_scale_grad[tid] = total


def mhc_pre_split_mixes_bwd_kernel(mhc_mult, path):
    if path not in PATHS:
        raise ValueError(f"mhc.mhc_pre_split_mixes_bwd: path must be one of {PATHS}, got {path!r}")
    m = mhc_mult
    mm = m * m
    m3 = 2 * m + mm
    num_tokens = T.dynamic("num_tokens", "int64")
    cluster = path == "cluster"
    body = _cluster_body(m, num_tokens) if cluster else _blocks_body(m, num_tokens)

    @T.prim_func
    def mhc_pre_split_mixes_bwd(
        pre_layer_mix_grad: T.Tensor[(num_tokens, m), T.float32],
        post_layer_mix_grad: T.Tensor[(num_tokens, m), T.float32],
        comb_res_mix_grad: T.Tensor[(num_tokens, mm), T.float32],
        input_mixes: T.Tensor[(num_tokens, m3), T.float32],
        mhc_scale: T.Tensor[(3,), T.float32],
        mhc_base: T.Tensor[(m3,), T.float32],
        input_mixes_grad: T.Tensor[(num_tokens, m3), T.float32],
        mhc_scale_grad: T.Tensor[(3,), T.float32],
        mhc_base_grad: T.Tensor[(m3,), T.float32],
        scratch: T.Tensor[(BLOCKS * 2 * m3,), T.float32],  # the blocks kernel's partial sums
        mhc_post_mult_value: T.float32,
        phase: T.int32,  # the blocks kernel's launch
    ):
        if cluster:
            with T.Kernel(CLUSTER, threads=mix_math.THREADS, cluster_dims=CLUSTER):
                T.import_source(CLUSTER_LOAD_SOURCE)
                wait_for_previous_grid()  # programmatic dependent launch
                body(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale, mhc_base,
                     input_mixes_grad, mhc_scale_grad, mhc_base_grad, mhc_post_mult_value)
        else:
            with T.Kernel(BLOCKS, threads=THREADS) as bid:
                wait_for_previous_grid()  # programmatic dependent launch: phase 1 waits for phase 0 here
                body(bid, pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale,
                     mhc_base, input_mixes_grad, mhc_scale_grad, mhc_base_grad, scratch, mhc_post_mult_value, phase)

    return mhc_pre_split_mixes_bwd


def _blocks_body(mhc_mult, num_tokens):
    """The blocks kernel's body in block ``bid`` (module docstring); ``num_tokens`` the dynamic
    token count."""
    assert BLOCKS * LANES_PER_BLOCK == LANES and (1 << TREE_LEVELS) == BLOCKS
    m = mhc_mult
    mm = m * m
    m3 = 2 * m + mm
    slice_elems = LANES_PER_BLOCK * m3  # a block's elements of one round
    per_thread = -(-slice_elems // THREADS)
    in_flight = max(1, LOADS_IN_FLIGHT // per_thread)  # rounds loaded ahead of use
    partials = 2 * m3  # per block: the g_z sums, then the g_z * input_mixes sums

    @T.macro
    def body(bid, pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale, mhc_base,
             input_mixes_grad, mhc_scale_grad, mhc_base_grad, scratch, mhc_post_mult_value, phase):
        tid = T.get_thread_binding()
        lane_sums = T.alloc_shared((2 * slice_elems,), T.float32)  # phase 0: [kind][lane][mix]
        tree = T.alloc_shared((BLOCKS * partials,), T.float32)  # phase 1: [block][partial]
        acc = T.alloc_local((2 * per_thread,), T.float32)  # [e]: g_z; [per_thread + e]: g_z * mix
        mix = T.alloc_local((in_flight * per_thread,), T.float32)
        grad = T.alloc_local((in_flight * per_thread,), T.float32)
        col = T.alloc_local((per_thread,), T.int32)  # the element's mix j
        row = T.alloc_local((per_thread,), T.int64)  # its lane's token in round 0
        scale = T.alloc_local((per_thread,), T.float32)  # scale[group of j]
        base = T.alloc_local((per_thread,), T.float32)
        sg = T.alloc_var(T.float32)
        gz = T.alloc_var(T.float32)
        if phase == 0:
            for e in T.unroll(per_thread):
                acc[e] = T.float32(0)
                acc[per_thread + e] = T.float32(0)
                col[e] = (tid + e * THREADS) % m3
                row[e] = T.Cast("int64", bid * LANES_PER_BLOCK + (tid + e * THREADS) // m3)
                scale[e] = T.float32(0)
                base[e] = T.float32(0)
                if tid + e * THREADS < slice_elems:
                    scale[e] = mhc_scale[T.if_then_else(col[e] < m, 0, T.if_then_else(col[e] < 2 * m, 1, 2))]
                    base[e] = mhc_base[col[e]]
            for rb in T.serial(T.ceildiv(T.ceildiv(num_tokens, LANES), in_flight)):
                # every load of `in_flight` rounds before the first use
                for u in T.unroll(in_flight):
                    for e in T.unroll(per_thread):
                        t = row[e] + T.Cast("int64", rb * in_flight + u) * LANES
                        if tid + e * THREADS < slice_elems and t < num_tokens:
                            mix[u * per_thread + e] = input_mixes[t, col[e]]
                            if col[e] < m:
                                grad[u * per_thread + e] = pre_layer_mix_grad[t, col[e]]
                            elif col[e] < 2 * m:
                                grad[u * per_thread + e] = post_layer_mix_grad[t, col[e] - m]
                            else:
                                grad[u * per_thread + e] = comb_res_mix_grad[t, col[e] - 2 * m]
                for u in T.unroll(in_flight):
                    for e in T.unroll(per_thread):
                        t = row[e] + T.Cast("int64", rb * in_flight + u) * LANES
                        if tid + e * THREADS < slice_elems and t < num_tokens:
                            # sigmoid for every element (no divergence); the comb mixes keep g
                            sg = sigmoid(T.ieee_add(T.ieee_mul(mix[u * per_thread + e], scale[e]), base[e]))
                            gz = T.if_then_else(col[e] < m, grad[u * per_thread + e],
                                                T.ieee_mul(grad[u * per_thread + e], mhc_post_mult_value))
                            gz = T.if_then_else(col[e] < 2 * m,
                                                T.ieee_mul(T.ieee_mul(gz, T.ieee_sub(T.float32(1), sg)), sg),
                                                grad[u * per_thread + e])
                            input_mixes_grad[t, col[e]] = T.ieee_mul(gz, scale[e])
                            acc[e] = T.ieee_add(acc[e], gz)
                            acc[per_thread + e] = T.ieee_add(acc[per_thread + e],
                                                             T.ieee_mul(gz, mix[u * per_thread + e]))
            # the block's lanes: a subtree of the lane tree, summed per (kind, mix)
            for e in T.unroll(per_thread):
                if tid + e * THREADS < slice_elems:
                    lane_sums[tid + e * THREADS] = acc[e]
                    lane_sums[slice_elems + tid + e * THREADS] = acc[per_thread + e]
            T.sync_threads()
            for c in T.serial(T.ceildiv(partials, THREADS)):
                if c * THREADS + tid < partials:
                    # partial p: kind p // m3, mix p % m3
                    scratch[bid * partials + c * THREADS + tid] = pair_tree(
                        [lane_sums[((c * THREADS + tid) // m3) * slice_elems + lane * m3 + (c * THREADS + tid) % m3]
                         for lane in range(LANES_PER_BLOCK)])
        elif bid == 0:
            for i in T.serial(T.ceildiv(BLOCKS * partials, THREADS)):
                if i * THREADS + tid < BLOCKS * partials:
                    tree[i * THREADS + tid] = scratch[i * THREADS + tid]
            T.sync_threads()
            # level k: node 2j (blocks [2j * 2^k, ...)) += node 2j + 1, kept at block 2j * 2^k
            for k in T.unroll(TREE_LEVELS):
                for i in T.serial(T.ceildiv((BLOCKS >> (k + 1)) * partials, THREADS)):
                    if i * THREADS + tid < (BLOCKS >> (k + 1)) * partials:
                        tree[((i * THREADS + tid) // partials) * (2 << k) * partials + (i * THREADS + tid) % partials] = \
                            T.ieee_add(
                                tree[((i * THREADS + tid) // partials) * (2 << k) * partials
                                     + (i * THREADS + tid) % partials],
                                tree[(((i * THREADS + tid) // partials) * (2 << k) + (1 << k)) * partials
                                     + (i * THREADS + tid) % partials])
                T.sync_threads()
            _write_small_grads(tree, m, tid, mhc_scale_grad, mhc_base_grad)

    return body


def _cluster_body(mhc_mult, num_tokens):
    """The cluster kernel's body in each block of the cluster (module docstring); ``num_tokens``
    the dynamic token count."""
    m = mhc_mult
    mm = m * m
    m3 = 2 * m + mm

    @T.macro
    def body(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, mhc_scale, mhc_base,
             input_mixes_grad, mhc_scale_grad, mhc_base_grad, mhc_post_mult_value):
        tid = T.get_thread_binding()
        rank = block_rank_in_cluster()
        red = T.alloc_shared((mix_math.WARPS * 2 * m3,), T.float32)
        xch = T.alloc_shared((2 * m3,), T.float32)
        tot = T.alloc_shared((2 * m3,), T.float32)
        acc = T.alloc_local((2 * m3,), T.float32)  # [0, m3): g_z; [m3, 2 m3): g_z * input_mixes
        mix = T.alloc_local((m3,), T.float32)
        gz = T.alloc_local((m3,), T.float32)
        sg = T.alloc_var(T.float32)
        s_pre = mhc_scale[0]
        s_post = mhc_scale[1]
        s_comb = mhc_scale[2]
        for c in T.unroll(2 * m3):
            acc[c] = T.float32(0)
        lane = T.Cast("int64", rank * mix_math.THREADS + tid)
        for r in T.serial(T.ceildiv(num_tokens, LANES)):
            t = T.Cast("int64", r) * LANES + lane
            if t < num_tokens:
                for j in T.unroll(m3):
                    mix[j] = input_mixes[t, j]
                for j in T.unroll(m):
                    gz[j] = pre_layer_mix_grad[t, j]
                    gz[m + j] = post_layer_mix_grad[t, j]
                for j in T.unroll(mm):
                    gz[2 * m + j] = comb_res_mix_grad[t, j]
                for j in T.unroll(m):
                    sg = sigmoid(T.ieee_add(T.ieee_mul(mix[j], s_pre), mhc_base[j]))
                    gz[j] = T.ieee_mul(T.ieee_mul(gz[j], T.ieee_sub(T.float32(1), sg)), sg)
                    input_mixes_grad[t, j] = T.ieee_mul(gz[j], s_pre)
                for j in T.unroll(m):
                    sg = sigmoid(T.ieee_add(T.ieee_mul(mix[m + j], s_post), mhc_base[m + j]))
                    gz[m + j] = T.ieee_mul(T.ieee_mul(T.ieee_mul(gz[m + j], mhc_post_mult_value),
                                                      T.ieee_sub(T.float32(1), sg)), sg)
                    input_mixes_grad[t, m + j] = T.ieee_mul(gz[m + j], s_post)
                for j in T.unroll(mm):
                    input_mixes_grad[t, 2 * m + j] = T.ieee_mul(gz[2 * m + j], s_comb)
                for j in T.unroll(m3):
                    acc[j] = T.ieee_add(acc[j], gz[j])
                    acc[m3 + j] = T.ieee_add(acc[m3 + j], T.ieee_mul(gz[j], mix[j]))
        cluster_token_sum(acc, 2 * m3, red, xch, tot, tid, rank)
        if rank == 0:
            _write_small_grads(tot, m, tid, mhc_scale_grad, mhc_base_grad)

    return body
