"""Programmatic dependent launch, as every kernel of this package begins.

The runtime launches each kernel as a programmatic dependent of the previous grid in
its stream (the manifest's ``pdl`` flag, read from the lowered function), so a kernel
may start before that grid has finished and must wait for it before touching memory.
"""

from tilelang import language as T
from tilelang.cuda.language import pdl_sync, pdl_trigger


@T.macro
def wait_for_previous_grid():
    """Wait for the previous grid in the stream before any memory access
    (``griddepcontrol.wait``), then let the next grid start its blocks while this one
    drains (``griddepcontrol.launch_dependents``)."""
    pdl_sync()
    pdl_trigger()


@T.macro
def wait_for_previous_grid_then(launch_now):
    """``wait_for_previous_grid`` with the next grid's early start a run-time choice: where
    ``launch_now`` is nonzero the next grid may start its blocks now; elsewhere it starts as
    this grid's blocks exit (their implicit trigger), so its blocks take the SMs this grid
    leaves, in grid order, rather than whatever slots are free while this grid runs."""
    pdl_sync()
    if launch_now != 0:
        pdl_trigger()
