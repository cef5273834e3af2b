"""The schema of an op folder, as plain data the pipeline, the runtime and the tests read.

An op folder ``kernels_tl/<family>/<op>/`` holds:

* ``kernel.py``: the TileLang factory (``<op>_kernel(**config)`` returning the
  ``T.prim_func`` of one static configuration) and ``PASS_CONFIGS``; optionally
  ``host_constants(**config)``, integers of the kernel's layout that the host side needs
  (lanes per group, tile widths, ...), so they are written once, beside the kernel;
* ``schema.py``: ``SCHEMA``, a :class:`Schema` (this module), importable without TileLang;
* ``host.h``: the host side in C++ (dims, checks, config values, outputs, kernel
  arguments) behind the fixed interface described in ``docs/adding-an-op.md``;
* ``notes.md`` (optional): design notes.

Everything here is JSON-able data once :func:`to_json` has run: the manifest carries it
into the installed package, where the bench, the tests and the exports read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

REQUIRED = "<required>"  # marker: a positional parameter without a default


# ---- parameter kinds --------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    """A tensor parameter.  ``dtypes``: accepted dtype names (``aot.targets.DTYPES``);
    ``ndim``: required rank (with ``leading``, the least rank: any dims before the last
    ``ndim`` are leading dims, which the host flattens); ``contiguous``: False when only the
    last dim must be unit-stride; ``optional``: None allowed; ``mutable``: updated in place
    by the op."""

    dtypes: Sequence[str]
    ndim: int
    contiguous: bool = True
    optional: bool = False
    mutable: bool = False
    leading: bool = False
    kind: str = "tensor"


@dataclass(frozen=True)
class TensorList:
    """A list (or tuple) of at most ``max_len`` tensors, each checked as a :class:`Tensor` of
    ``dtypes``, ``ndim``, ``contiguous`` and ``leading`` (the host checks their shapes);
    ``mutable``: the op writes into them.  The host sees a ``TensorListArg<max_len>`` (``size``,
    ``items``); torch.library sees ``Tensor[]`` (``Tensor(a!)[]`` when mutable).  Samples give
    one as :class:`Tensors`."""

    dtypes: Sequence[str]
    ndim: int
    max_len: int
    contiguous: bool = True
    mutable: bool = False
    leading: bool = False
    kind: str = "tensor_list"


@dataclass(frozen=True)
class QuantizedTensor:
    """A pre-quantized ``(data, sf)`` pair, or (with ``plain_dtypes``) a plain tensor in
    its place.  The host sees two tensor views: ``<name>`` (the data, or the plain tensor)
    and ``<name>_sf`` (absent for a plain tensor)."""

    dtypes: Sequence[str]  # of the data
    sf_dtypes: Sequence[str]
    ndim: int
    plain_dtypes: Sequence[str] = ()
    contiguous: bool = True
    kind: str = "quantized"


@dataclass(frozen=True)
class Int:
    optional: bool = False
    kind: str = "int"


@dataclass(frozen=True)
class Float:
    optional: bool = False
    kind: str = "float"


@dataclass(frozen=True)
class Bool:
    kind: str = "bool"


@dataclass(frozen=True)
class Str:
    """One of ``choices`` (or None when ``optional``).  With ``enum=True`` an ``IntEnum`` member (or its int value,
    an index into ``choices``) is accepted too; the host gets the index either way."""

    choices: Sequence[str]
    enum: bool = False
    optional: bool = False  # None allowed (the host gets ``<name>_is_none`` and an empty string)
    kind: str = "str"


@dataclass(frozen=True)
class Dtype:
    """A ``torch.dtype`` among ``choices`` (dtype names, keys of ``aot.targets.DTYPES``), e.g.
    an output dtype.  A default is written as its name (``Param("out_dtype", Dtype([...]),
    "float32")``, shown as ``torch.float32``).  The host gets the runtime's ``DType``; a value
    that is not a ``torch.dtype`` is a TypeError, a dtype outside ``choices`` a ValueError.
    torch.library sees a ``ScalarType``."""

    choices: Sequence[str]
    kind: str = "dtype"


@dataclass(frozen=True)
class IntTuple:
    """A tuple of ``length`` ints (e.g. a block size), or None when optional."""

    length: int
    optional: bool = False
    kind: str = "int_tuple"


@dataclass(frozen=True)
class Param:
    """One parameter of the public function, in upstream's order."""

    name: str
    type: object
    default: object = REQUIRED


@dataclass(frozen=True)
class Out:
    """An output tensor.  The caller may pass it as keyword-only ``<name>=``.

    ``dtype``, ``shape`` and ``strides`` declare it as Python expressions over the call's
    parameters by name (tensors with ``.shape``), the op's ``dims``, and the helpers
    ``ceil_div``, ``align_up``, ``sym_max`` and ``num_sms`` (a tensor's device's SM count;
    132 off CUDA): ``dtype`` gives a dtype name (or a tensor's ``.dtype``), ``shape`` a
    list of sizes, ``strides`` a list of strides or None for a contiguous tensor.  The
    torch.library registration allocates outputs and builds fake tensors from them, with
    the token dim symbolic; the host side's ``outputs`` computes the same in C++, and the
    GPU tests check that the two agree for every sample.  ``optional``: the host may leave
    it out (it is then returned as None); its ``shape`` expression then gives None, and the
    torch.library schema returns it as ``Tensor?``.  ``positional``: the output is also the
    public function's last positional parameter(s) (after every :class:`Param`, default None),
    as where upstream's signature takes ``out=None`` positionally; positional outputs come
    first among the outputs."""

    name: str
    dtype: str
    shape: str
    strides: Optional[str] = None
    optional: bool = False
    positional: bool = False


# ---- samples ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Randn:
    """A tensor of standard-normal values (drawn in float32, then cast).  ``shape`` may use
    ``"T"`` for the sample's token count, ``"T/<n>"`` for ``ceil(T / n)`` (e.g. the rows of a
    grid of per-block scale factors) and ``"P"`` for the rows of its routing's fused layout
    (:class:`Routing`).  ``layout`` (every drawn kind): ``"row"`` (contiguous) or ``"tma_col"``
    (a 2-D tensor stored column-major with the row dim padded to a multiple of 4, strides
    ``(1, align(rows, 4))``, as TMA-aligned scale factors are)."""

    shape: Sequence
    dtype: str
    kind: str = "randn"
    layout: str = "row"


@dataclass(frozen=True)
class Randint:
    """A tensor of integers uniform in ``[low, high)``.  ``view``: a dtype the drawn bits are
    reinterpreted as (``torch.Tensor.view(dtype)``; the last dim scales by the size ratio), e.g.
    uint8 codes as ``float8_e4m3fn``, or four uint8 exponent bytes as one packed int32."""

    shape: Sequence
    dtype: str
    low: int
    high: int
    kind: str = "randint"
    layout: str = "row"
    view: str = ""


@dataclass(frozen=True)
class Rand:
    """A tensor of values uniform in ``[low, high)`` (drawn in float32, then cast)."""

    shape: Sequence
    dtype: str
    low: float = 0.0
    high: float = 1.0
    kind: str = "rand"
    layout: str = "row"


@dataclass(frozen=True)
class Exp2:
    """A tensor of powers of two ``2**n``, ``n`` a uniform integer in ``[low, high)`` (e.g.
    power-of-two scale factors of a pre-quantized input)."""

    shape: Sequence
    dtype: str
    low: int
    high: int
    kind: str = "exp2"
    layout: str = "row"


@dataclass(frozen=True)
class Quantized:
    """A pre-quantized ``(data, sf)`` pair for a :class:`QuantizedTensor` parameter: a
    standard-normal bfloat16 ``shape`` tensor (``"T"`` for the token count) cast by the
    reference ``per_block_cast`` to ``fmt`` (``'e4m3'`` or ``'e2m1'``) with ``block`` =
    ``(bm, bk)`` and the given sf form, so data and factors agree as a caller's would."""

    shape: Sequence
    fmt: str
    block: Sequence[int]
    use_tma_aligned_col_major_sf: bool = False
    round_sf: bool = False
    use_packed_ue8m0: bool = False
    kind: str = "quantized"


@dataclass(frozen=True)
class Tensors:
    """A list of tensors for a :class:`TensorList` parameter, each drawn as its spec says."""

    items: Sequence
    kind: str = "tensors"


@dataclass(frozen=True)
class TorchDtype:
    """A ``torch.dtype`` argument of a sample (for a :class:`Dtype` parameter), by name."""

    name: str
    kind: str = "torch_dtype"


@dataclass(frozen=True)
class Routing:
    """A sample's MoE routing: ``topk_idx`` ``[T, num_topk]`` int64 with distinct experts per
    token drawn uniformly from ``[0, num_experts * ep_ranks)``, the entries of other ranks'
    experts (``>= num_experts``) set to ``-1`` as on one rank of expert parallelism, and each
    entry ``-1`` (unrouted) with probability ``unrouted``, placed in the fused expert-major layout by the reference
    ``get_fused_mapping`` with ``alignment``.  The layout has
    ``T * num_topk + num_experts * (alignment - 1)`` rows, the most it can need, or with
    ``exact`` the rows this draw needs (as a host-synced mapping sizes it): shapes write it
    as ``"P"``."""

    num_topk: int
    num_experts: int
    alignment: int = 1
    unrouted: float = 0.0
    exact: bool = False
    ep_ranks: int = 1


@dataclass(frozen=True)
class Routed:
    """One tensor of the sample's :class:`Routing`: ``'topk_idx'`` or an output of
    ``get_fused_mapping`` by name (``'pos_to_expert'``, ``'pos_to_token'``,
    ``'pos_to_token_topk'``, ``'token_topk_to_pos'``, ``'expert_start'``, ``'expert_end'``,
    ``'num_tokens_per_expert'``), so the tensors of one call agree with each other."""

    field: str
    kind: str = "routed"


@dataclass(frozen=True)
class Extent:
    """An int argument that follows the sample's size: ``expr``, a Python expression over
    ``T`` (the token count) and ``P`` (the rows of the sample's :class:`Routing` layout), e.g.
    ``Extent("P")`` for a fused buffer of as many rows as the routing can need."""

    expr: str
    kind: str = "extent"


@dataclass(frozen=True)
class Sample:
    """One call of the op: positional ``args`` and keyword ``kwargs`` (tensors given as
    :class:`Randn` / :class:`Randint` / :class:`Rand` / :class:`Exp2` / :class:`Routed`, a
    ``(data, sf)`` pair as a tuple of them or as :class:`Quantized`, sizes as :class:`Extent`), at
    ``tokens`` tokens, with ``routing`` the :class:`Routing` its ``Routed`` tensors and ``"P"``
    extents come from.  The tests run every sample bit-exact against the reference; the bench
    times them.  ``host_sync``: the call waits for the device (its output sizes depend on the
    data), so it cannot be captured in a CUDA graph or traced with fake tensors: the bench and
    those tests leave it out."""

    name: str  # 'decode', 'prefill', or the upstream benchmark it mirrors
    tokens: int
    args: Sequence
    kwargs: dict = field(default_factory=dict)
    routing: Optional[Routing] = None
    host_sync: bool = False


# ---- ops and schema ---------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    """One public function ``tile_kernels_aot.<module>.<name>``.

    ``returns``: the out names returned (a tuple when more than one, None when empty).
    ``bytes``: a Python expression over the call's tensors (arguments and outputs by
    name, each with ``.nbytes``) giving the bytes one launch must move; by default every
    tensor argument read once and every output written once.
    ``token_dim``: which dim of the first tensor argument (and of the per-token outputs)
    is the token dim, or None when the op is not per-token (its rows depend on others).
    ``token_multiple``: the ``"T"`` extents the op accepts are multiples of it.
    ``dims``: ``(name, expression)`` pairs evaluated in order before the outputs'
    declarations, which may use them (e.g. ``("groups", "ceil_div(H, num_per_channels)")``).
    ``wrapper``: the dotted path of a Python function of the runtime package that is the public
    function (``tile_kernels_aot.<module>.<name>``), a thin wrapper over the generated C
    function, which stays the kernel op (``samples.kernel_function``; the torch custom op and
    its dynamo rule are the kernel op's).  It keeps the kernel op's signature and may return
    more than its outputs (e.g. a list learnt with a host sync); None: the C function is public.
    ``tolerance``: ``{out name: (rtol, atol)}`` for outputs the reference computes in an order
    the kernel cannot follow (a cuBLAS GEMM, a PyTorch reduction whose tree depends on the
    launch shape); the tests accept ``|got - want| <= rtol * |want| + atol * max|want|``
    (``max`` over the whole output) with NaN and infinities at the same places.  Every other
    output is compared bit for bit.  Say why in docs/ops.md.
    ``ill_conditioned``: ``{special input of the edge harness: [out names]}``, outputs with a
    tolerance that are a discontinuous function of the values the tolerance bounds under that
    input (Sinkhorn at ties of logits of 1e6 and more): the edge harness does not compare them
    with the reference there; the op's own tests check them another way.  Say why in docs/ops.md.
    ``launches``: the host side may launch the kernel several times per call (the layers of a
    long tensor list in chained launches): its ``launches(plan)`` gives the count and its
    ``kernel_args`` takes the launch index as a last argument; the launches run in order on the
    call's stream.
    ``scratch``: :class:`Out` declarations (same expressions) of buffers the call allocates for
    its kernels alone, with its outputs: no parameter, never returned; the host side sees them
    after the outputs in ``OutSpecs`` (its ``outputs`` fills them) and ``Outs``.
    ``prologue``: the host side launches other kernels first, on the call's stream (e.g. another
    folder's op through its generated ``run``): its ``prologue(op, a, p, o, device, stream)`` runs
    right before the kernel's launch, after ``needs_launch``.
    """

    module: str
    name: str
    params: Sequence[Param]
    outs: Sequence[Out]
    returns: Sequence[str]
    reference: str  # dotted path of the PyTorch reference it mirrors
    samples: Sequence[Sample]
    doc: str
    bytes: Optional[str] = None
    token_dim: Optional[int] = 0
    token_multiple: int = 1  # the token counts the op accepts are multiples of this
    dims: Sequence = ()
    wrapper: Optional[str] = None
    tolerance: dict = field(default_factory=dict)
    ill_conditioned: dict = field(default_factory=dict)
    launches: bool = False
    scratch: Sequence = ()
    prologue: bool = False


@dataclass(frozen=True)
class Schema:
    """An op folder: one kernel (``static``: its config keys, in order) and its public ops."""

    static: Sequence[str]
    ops: Sequence[Op]


def to_json(value):
    """Plain JSON data of a schema value (dataclasses become dicts; REQUIRED stays a marker)."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value
