"""What a kernel module declares, as plain data the AOT pipeline reads.

A kernel module (``kernels_tl/<family>/<op>.py``) exports:

* ``KERNEL``: a :class:`KernelSpec` -- the TileLang factory, the names of its
  static parameters, and the bytes one launch moves (for the roofline share the
  bench prints).
* ``OPS``: a list of :class:`OpSpec` -- the public Python functions this kernel
  backs, described declaratively so that ``aot.stubgen`` can generate their C++
  host stubs (argument parsing, checks, config dispatch, outputs, launch).

Expressions in an ``OpSpec`` are C++ snippets evaluated inside the generated
stub.  In scope there:

* every tensor parameter and output ``t`` as a view with ``t.ndim``,
  ``t.shape[i]``, ``t.stride[i]`` (elements), ``t.dtype`` (a ``DType`` code),
  ``t.data`` (pointer, byte offset applied), ``t.present`` (false for an
  optional tensor passed as ``None``), ``t.contiguous()``; outputs only in
  ``kernel_args``;
* every scalar parameter by name: ``int64_t`` for ints, ``double`` for floats,
  ``bool`` for bools (``None`` allowed where declared: test ``<name>_is_none``),
  ``std::string_view`` for strings;
* every ``dims`` entry (``int64_t``), in declaration order (they are evaluated
  before ``checks``, so guard divisions), and the helpers ``ceil_div(a, b)``,
  ``align_up(a, b)``, ``dtype_bytes(dtype)``;
* dtype constants ``BF16, F32, F16, E4M3, I8, U8, I32, I64``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

REQUIRED = object()  # marker: a positional parameter without a default


@dataclass(frozen=True)
class Tensor:
    """A tensor parameter.  ``dtypes``: accepted dtype names; ``ndim``: required rank."""

    dtypes: Sequence[str]
    ndim: int
    contiguous: bool = True  # False: only the last dim must be unit-stride
    optional: bool = False  # None allowed (the parameter then defaults to None)


@dataclass(frozen=True)
class Int:
    optional: bool = False  # None allowed


@dataclass(frozen=True)
class Float:
    optional: bool = False


@dataclass(frozen=True)
class Bool:
    pass


@dataclass(frozen=True)
class Str:
    choices: Sequence[str]


@dataclass(frozen=True)
class Param:
    """One parameter of the public function, in upstream's order."""

    name: str
    type: object  # Tensor | Int | Float | Bool | Str
    default: object = REQUIRED
    # Parameters upstream accepts but this build does not support yet: any value
    # other than the default raises a ValueError naming the op and the parameter.
    unsupported: bool = False


@dataclass(frozen=True)
class Out:
    """An output tensor; the caller may pass it as keyword-only ``name=``.

    ``shape`` is the logical shape; ``strides`` (optional) the element strides of
    that view.  ``storage`` (optional) is the number of elements to allocate when
    the view is not dense (e.g. a column-major scale-factor tensor whose columns
    are padded for TMA).
    """

    name: str
    dtype: str  # C++ expression giving a DType
    shape: Sequence[str]
    strides: Optional[Sequence[str]] = None
    storage: Optional[str] = None


@dataclass(frozen=True)
class OpSpec:
    """One public function: ``<module>.<name>(params..., *, outs...)``."""

    module: str  # public module: 'moe', 'quant', 'transpose', ...
    name: str
    params: Sequence[Param]
    outs: Sequence[Out]
    returns: Sequence[str]  # names of outs returned (a tuple when more than one)
    dims: dict  # name -> C++ expression, evaluated in order after the checks of params
    checks: Sequence[tuple]  # (C++ condition, message naming the argument), in order; a failure is a ValueError
    config: dict  # static parameter of KERNEL -> C++ expression (or a constant)
    kernel_args: dict  # prim_func parameter / dynamic var -> C++ expression
    launch_when: str = "true"  # no launch (outputs still returned) when false: empty inputs
    doc: str = ""
    bytes: Optional[str] = None  # this op's bytes per launch, where it differs from KERNEL.bytes


@dataclass(frozen=True)
class KernelSpec:
    """The TileLang side of one kernel.

    ``factory(**config)`` returns the ``T.prim_func`` for one static
    configuration; ``static`` names the keys of ``config`` in a fixed order;
    ``bytes`` is a Python expression over the op's dims and static params giving
    the bytes one launch must move (each input read once, each output written
    once).
    """

    name: str  # e.g. 'moe.topk_gate'
    factory: Callable
    static: Sequence[str]
    bytes: str
    pass_configs: dict = field(default_factory=dict)
