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
    ``ndim``: required rank; ``contiguous``: False when only the last dim must be
    unit-stride; ``optional``: None allowed; ``mutable``: updated in place by the op."""

    dtypes: Sequence[str]
    ndim: int
    contiguous: bool = True
    optional: bool = False
    mutable: bool = False
    kind: str = "tensor"


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
    ``ceil_div``, ``align_up`` and ``sym_max``: ``dtype`` gives a dtype name (or a tensor's ``.dtype``), ``shape`` a
    list of sizes, ``strides`` a list of strides or None for a contiguous tensor.  The
    torch.library registration allocates outputs and builds fake tensors from them, with
    the token dim symbolic; the host side's ``outputs`` computes the same in C++, and the
    GPU tests check that the two agree for every sample.  ``optional``: the host may leave
    it out (it is then returned as None)."""

    name: str
    dtype: str
    shape: str
    strides: Optional[str] = None
    optional: bool = False


# ---- samples ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Randn:
    """A tensor of standard-normal values (drawn in float32, then cast).  ``shape`` may use
    ``"T"`` for the sample's token count, ``"T/n"`` for ``ceil(T / n)`` (e.g. the rows of
    a grid of per-block scale factors) and ``"P"`` for the rows of its routing's fused
    layout (:class:`Routing`).  ``layout``: ``"row"`` (contiguous) or ``"tma_col"`` (a 2-D
    tensor stored column-major with the row dim padded to a multiple of 4, strides
    ``(1, align(rows, 4))``, as TMA-aligned scale factors are).  A sample argument that is a
    tuple of tensors (a quantized ``(data, sf)`` pair) is drawn as a tuple."""

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
class Routing:
    """A sample's MoE routing: ``topk_idx`` ``[T, num_topk]`` int64 with distinct experts per
    token drawn uniformly from ``[0, num_experts)`` and each entry ``-1`` (unrouted) with
    probability ``unrouted``, placed in the fused expert-major layout by the reference
    ``get_fused_mapping`` with ``alignment``.  The layout has
    ``T * num_topk + num_experts * (alignment - 1)`` rows, the most it can need: shapes write
    it as ``"P"``."""

    num_topk: int
    num_experts: int
    alignment: int = 1
    unrouted: float = 0.0


@dataclass(frozen=True)
class Routed:
    """One tensor of the sample's :class:`Routing`: ``'topk_idx'`` or an output of
    ``get_fused_mapping`` by name (``'pos_to_expert'``, ``'pos_to_token'``,
    ``'pos_to_token_topk'``, ``'token_topk_to_pos'``, ``'expert_start'``, ``'expert_end'``,
    ``'num_tokens_per_expert'``), so the tensors of one call agree with each other."""

    field: str
    kind: str = "routed"


@dataclass(frozen=True)
class Sample:
    """One call of the op: positional ``args`` and keyword ``kwargs`` (tensors given as
    :class:`Randn` / :class:`Randint` / :class:`Rand` / :class:`Routed`), at ``tokens``
    tokens, with ``routing`` the :class:`Routing` its ``Routed`` tensors and ``"P"`` extents
    come from.  The tests run every sample bit-exact against the reference; the bench times
    them."""

    name: str  # 'decode', 'prefill', or the upstream benchmark it mirrors
    tokens: int
    args: Sequence
    kwargs: dict = field(default_factory=dict)
    routing: Optional[Routing] = None


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
