"""Register loads kept ahead of the math that uses them.

ptxas schedules a basic block's global loads for register pressure and may sink some of them
into the arithmetic that follows in the same block: they are then issued late, each a DRAM
latency the warp waits for again. It does not move loads out of their block, so a branch it
cannot fold, placed right after the loads, has all of them issued first. ``end_of_loads(never)``
is that branch: ``never`` is a run-time value that is false in every launch (for example
``token_blocks == 0`` in a kernel that only runs with ``token_blocks > 0``); taking it traps.
It costs three SASS instructions (``ISETP``, ``BRA``, ``BPT.TRAP``).

A kernel using it calls ``T.import_source(DEVICE_SOURCE)`` in its body once and puts
``T.evaluate(end_of_loads(...))`` after its loads.
"""

from tilelang import language as T

DEVICE_SOURCE = r"""
__device__ __forceinline__ void tka_end_of_loads(bool never) {
  if (never) __trap();
}
"""


def end_of_loads(never):
    """The call ending the loads' basic block (see the module docstring); ``never`` is false."""
    return T.call_extern("void", "tka_end_of_loads", never)
