"""Status codes of the compiled round steps and spin checks, named once.

Every compiled wait step (``signals.spin_*``, ``rounds.arrive``, ``rounds.eager_round``
and the fused rounds) returns one int:

- ``>= 0``: not done yet; the value names the first rank (or slice) still missing
  when the spin budget ran out. The caller waits the blocking way and asks again.
- ``OK``: the condition holds / the step completed.
- ``ABORT``: the cohort is aborting (``CohortAborted`` in the engine).
- ``MISMATCH`` and below are *terminal*: the round cannot complete and the caller
  raises (``is_terminal``). ``WAKE`` is the one terminal code that is no error: a
  fused round published but peers sleep on the doorbell, so the caller wakes them
  and finishes the round the blocking way.

They are plain module-level ints (not an ``IntEnum``) so numba folds them into
compiled code as constants.
"""
from __future__ import annotations

OK = -1
ABORT = -2
MISMATCH = -3     # accepted ranks published different schemas
EXITED = -4       # a rank returned from its function while others wait for it
OUT_OF_STEP = -5  # a header is for another round (a rank skipped a collective)
WAKE = -6         # a fused round published but peers sleep: wake them, then wait
NOT_ROOT = -7     # a fused broadcast completed, but its root is not its only contributor
# the delivery step of a direct broadcast (``cma.deliver_broadcast``), after its arrivals:
UNREACHABLE = -8  # a peer's memory could not be read or written (the rank in I_CULPRIT)
SLICES_PENDING = -9  # this rank's slice is delivered and its done word published, but
#                      not every slice is yet (or peers sleep): wake them, then wait
# a direct reduce's one call (``cma.direct_reduce_f32``), after its arrivals:
PEERS_MAPPED = -10  # every peer's tensors lie in its shared parameter block, which this
#                     process has not mapped (or mapped smaller): the caller maps it and
#                     reduces the slice with plain loads and stores

NAMES = {OK: "OK", ABORT: "ABORT", MISMATCH: "MISMATCH", EXITED: "EXITED",
         OUT_OF_STEP: "OUT_OF_STEP", WAKE: "WAKE", NOT_ROOT: "NOT_ROOT",
         UNREACHABLE: "UNREACHABLE", SLICES_PENDING: "SLICES_PENDING",
         PEERS_MAPPED: "PEERS_MAPPED"}


def is_terminal(code: int) -> bool:
    """Whether ``code`` ends a wait without its condition holding (MISMATCH and below).

    Args:
        code: a status returned by a compiled wait step.
    """
    return code <= MISMATCH


def is_finished(code: int) -> bool:
    """Whether a wait is over: its condition holds (``OK``) or it is terminal.

    Args:
        code: a status returned by a compiled wait step.
    """
    return code == OK or code <= MISMATCH
