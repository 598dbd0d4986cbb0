"""The control block's word map: one definition for the arena and the kernels.

The control block is an int64 word array at the start of the arena's ``ctl``
segment (see ``flodl_shm/engine/arena.py`` for the segments and ``flodl_shm/engine/protocol.py``
for the state machine these words drive). Words written by different processes
sit on different 64-byte cache lines.

The compiled kernels read these names as compile-time constants; the numba cache
is keyed by a digest that includes this file (``kernels/_cache.py``), so editing it
can never leave a stale kernel behind. No imports: the arena and the host-RAM tool
use it without loading numba.
"""
from __future__ import annotations

MAGIC = 0x46534D48_41524E41  # "FSMHARNA"
VERSION = 12  # 2: direct rounds (G_DIRECT, R_PROBE, R_DIRECT, H_SCALE, FLAG_DIRECT*);
             # 3: round reports (H_REPORT, H_REPORT_ROUND);
             # 4: shared parameter blocks (p<r> segments, R_PARAMS_BASE, R_PARAMS_BYTES);
             # 5: the controller's outer start (G_CONTROLLER_OUTER);
             # 6: the controller's outer settings (G_CONTROLLER_OUTER_KIND, _LR, _MU);
             # 7: a rank that gave up on a round (G_GAVE_UP);
             # 8: a spawned rank entered its function (R_ENTERED);
             # 9: the owner's broadcast threshold for direct rounds (G_DIRECT_BROADCAST_MIN);
             # 10: the owner's reduce threshold for direct rounds (G_DIRECT_MIN);
             # 11: all-gather and reduce-scatter rounds (FLAG_GATHER, FLAG_SCATTER);
             # 12: direct all-gathers (FLAG_GATHER | FLAG_DIRECT)

# -- global words ---------------------------------------------------------------------
G_MAGIC = 0
G_VERSION = 1
G_WORLD = 2           # local ranks in this arena
G_EAGER = 3           # bytes per eager slot
G_ABORT = 4           # nonzero: the cohort is being torn down (value = reason code)
G_DOORBELL = 8        # futex word (low 32 bits); bumped on every publication
G_SLEEPERS = 16       # number of waiters blocked on the doorbell
G_RELAY = 24          # 1: a relay completes every bulk round (multi-host)
G_CONSENSUS = 32      # round whose consensus the relay published
G_CONSENSUS_MASS = 33  # f64 bits: accepted mass of that round, cohort-wide
G_RELAY_ERROR = 34    # nonzero: the relay failed (code); ranks raise
G_RESULT_CAP = 40     # current byte size the result segment was grown to
G_FIRST_RANK = 41     # global rank of local rank 0
G_GLOBAL_WORLD = 42   # cohort world size
G_OUTER_NELEM = 43    # elements of the outer-optimizer state (0: none yet)
G_CONTROLLER_OUTER = 44  # on a cluster, where the controller's outer momentum starts (the
                      # relay writes it after the handshake, before any round): 0 nothing
                      # to check, 1 fresh, 2 + R the momentum saved at sync round R
G_CONTROLLER_OUTER_KIND = 45  # on a cluster, the outer optimizer the controller steps (the
                      # relay writes it with G_CONTROLLER_OUTER): 0 unknown (no handshake
                      # yet), 1 none, 2 Nesterov momentum (lr and momentum in the next words)
G_CONTROLLER_OUTER_LR = 46  # f64 bits: its learning rate
G_CONTROLLER_OUTER_MU = 47  # f64 bits: its momentum coefficient
G_TAP_SEQ = 48        # futex word (low 32 bits): checkpoint messages posted to the owner
G_TAP_ACK = 56        # last checkpoint message the owner consumed
G_DIRECT = 57         # 1: a dead rank stops the cohort (no survivor re-reduces its slice),
                      # so large rounds may move data between ranks' private memory
                      # (engine/direct.py); written once by the owner at creation
G_GAVE_UP = 58        # c10d: 1 + the local rank that first gave up on a round (its wait
                      # passed the group's timeout): a late peer whose round then completes
                      # raises too, instead of returning a result the others refused
G_DIRECT_BROADCAST_MIN = 59  # payload bytes from which a broadcast is a direct round
                      # (written once by the owner at creation, so every rank agrees)
G_DIRECT_MIN = 60     # payload bytes from which a reduce is a direct round (the same)
GLOBAL_WORDS = 64

ABORT_NONE = 0
ABORT_FAILED = 1      # a rank failed beyond max_failures
ABORT_INTERRUPT = 2   # the launcher was interrupted (Ctrl-C / SIGTERM)
ABORT_SHUTDOWN = 3    # orderly teardown (e.g. relay lost the controller)

RELAY_FAILED = 1      # G_RELAY_ERROR codes; details (JSON) in the error area
RELAY_STALL = 2
ERROR_AREA_BYTES = 1024

# -- per-rank block -------------------------------------------------------------------
RANK_WORDS = 64
R_ARRIVED = 0         # last round this rank published its contribution for
R_DONE = 8            # last round whose slice (this rank's index) is reduced
R_CLAIM = 16          # (round << 16) | responsible rank, for slice takeover
R_DEAD = 24           # nonzero once the rank's process is gone (DEAD_* code)
R_PID = 25
R_DATA_CAP = 26       # bytes the rank's d<r> segment was grown to
R_PROBE = 27          # address of the rank's private probe word (written once at start)
R_DIRECT = 28         # round in which the rank could reach every peer's probe word, or
                      # -(round + 1) when it could not (written once, before its done word)
R_PARAMS_BASE = 29    # address, in the rank's own process, of its mapping of its p<r>
                      # segment (its shared parameter block); 0: none placed
R_PARAMS_BYTES = 30   # bytes of that block in use (written after R_PARAMS_BASE)
R_ENTERED = 31        # 1 once a spawned rank's start-up is over and it entered its function
                      # (the rank writes it before telling its supervisor): a stop then
                      # grants it a grace before SIGTERM, whatever the supervisor has read
R_HDR = 32            # two round headers of HDR_WORDS, indexed by round parity
HDR_WORDS = 16

H_ROUND = 0
H_KIND = 1
H_FLAGS = 2
H_DTYPE = 3
H_WEIGHT = 4          # f64 bits
H_NTENSORS = 5
H_NBYTES = 6          # payload bytes
H_SCHEMA_HASH = 7
H_SCHEMA_WORDS = 8    # int64 words of schema description preceding the payload
H_NELEM = 9           # payload elements (all tensors share the wire dtype)
H_SCALE = 10          # f64 bits: the scale of a direct round's contribution (applied by
                      # the slice reducers, not at copy-in)
H_REPORT = 11         # REPORT_VALUES float32 (two per word): a rank's report riding in the
                      # round (``Comm.all_reduce_(report=...)``), read by every rank after it
H_REPORT_ROUND = 15   # round + 1 of the report in words 11..14 (0: none yet)
REPORT_VALUES = 8

DEAD_KILLED = 1       # died (crash, signal, exception) and was fenced by the owner
DEAD_EXITED = 2       # returned from its function: it will make no further calls

FLAG_ELIDED = 1       # contributes nothing (a non-root broadcast participant)
FLAG_BULK = 2         # payload is in d<r> (else in the eager slot of this parity)
FLAG_ZERO_COPY = 4    # filled in place through the zero-copy API (small frames: in the
                      # eager slot of the round's parity; larger ones: in d<r>)
FLAG_OUTER = 8        # the params round of a window: the outer optimizer steps it
FLAG_TAP = 16         # captured for a consensus checkpoint
FLAG_BROADCAST = 32   # a broadcast: the root publishes, the others copy its payload out
                      # (one host; on a cluster a broadcast is an elided reduce)
FLAG_DIRECT = 64      # a direct round: no payload in shared memory; the slice reducers read
                      # the contributors' private tensors and write every rank's result
FLAG_GATHER = 128     # an all-gather: every rank contributes a part, every rank copies all
                      # of them out (one host; ``kernels/parts.py``)
FLAG_SCATTER = 256    # a reduce-scatter: every rank contributes a whole input, each reduces
                      # only its part of it (one host; ``kernels/parts.py``)
# every rank of a round must agree on these (a zero-copy round meets only zero-copy
# rounds: its small frames share the eager path with the copy API's)
FLAGS_AGREED = (FLAG_BULK | FLAG_ZERO_COPY | FLAG_OUTER | FLAG_TAP | FLAG_BROADCAST
                | FLAG_DIRECT | FLAG_GATHER | FLAG_SCATTER)

__all__ = [
    "MAGIC",
    "VERSION",
    "G_MAGIC",
    "G_VERSION",
    "G_WORLD",
    "G_EAGER",
    "G_ABORT",
    "G_DOORBELL",
    "G_SLEEPERS",
    "G_RELAY",
    "G_CONSENSUS",
    "G_CONSENSUS_MASS",
    "G_RELAY_ERROR",
    "G_RESULT_CAP",
    "G_FIRST_RANK",
    "G_GLOBAL_WORLD",
    "G_OUTER_NELEM",
    "G_CONTROLLER_OUTER",
    "G_CONTROLLER_OUTER_KIND",
    "G_CONTROLLER_OUTER_LR",
    "G_CONTROLLER_OUTER_MU",
    "G_TAP_SEQ",
    "G_TAP_ACK",
    "G_DIRECT",
    "G_GAVE_UP",
    "G_DIRECT_BROADCAST_MIN",
    "G_DIRECT_MIN",
    "GLOBAL_WORDS",
    "ABORT_NONE",
    "ABORT_FAILED",
    "ABORT_INTERRUPT",
    "ABORT_SHUTDOWN",
    "RELAY_FAILED",
    "RELAY_STALL",
    "ERROR_AREA_BYTES",
    "RANK_WORDS",
    "R_ARRIVED",
    "R_DONE",
    "R_CLAIM",
    "R_DEAD",
    "R_PID",
    "R_DATA_CAP",
    "R_PROBE",
    "R_DIRECT",
    "R_PARAMS_BASE",
    "R_PARAMS_BYTES",
    "R_ENTERED",
    "R_HDR",
    "HDR_WORDS",
    "H_ROUND",
    "H_KIND",
    "H_FLAGS",
    "H_DTYPE",
    "H_WEIGHT",
    "H_NTENSORS",
    "H_NBYTES",
    "H_SCHEMA_HASH",
    "H_SCHEMA_WORDS",
    "H_NELEM",
    "H_SCALE",
    "H_REPORT",
    "H_REPORT_ROUND",
    "REPORT_VALUES",
    "DEAD_KILLED",
    "DEAD_EXITED",
    "FLAG_ELIDED",
    "FLAG_BULK",
    "FLAG_ZERO_COPY",
    "FLAG_OUTER",
    "FLAG_TAP",
    "FLAG_BROADCAST",
    "FLAG_DIRECT",
    "FLAG_GATHER",
    "FLAG_SCATTER",
    "FLAGS_AGREED",
]
