"""The control messages of the relay <-> controller link, in one place.

A control message is a CTRL record (``link.py``) whose payload is a compact JSON
object; its ``"type"`` is one of :class:`Ctrl`'s values. Every field each type
carries is listed here; nothing else is sent.

Handshake (once per link, ``link.client_handshake`` / ``link.server_handshake``):

- ``hello`` relay -> controller: ``host`` (name), ``ranks`` (global ranks this
  host carries), ``world_size``, ``protocol``.
- ``hello_ack`` controller -> relay: the host is admitted. ``outer``: the outer
  optimizer the controller steps, ``{"kind": "none"}`` or ``{"kind": "nesterov",
  "lr": LR, "momentum": MU}``. A controller with a stateful outer optimizer adds
  ``outer_start_round``: -1 when its outer momentum starts fresh, else the sync round
  of the checkpoint whose momentum it loaded (absent: a momentum loaded without its
  round, nothing to check). The relay writes both into the arena
  (``G_CONTROLLER_OUTER*``) for the ranks to check against their own outer optimizer
  and the round they resume from.
- ``reject`` controller -> relay: ``reason`` (why the host was refused).

During the run:

- ``rank_dead`` relay -> controller: ``ranks`` that died on this host.
- ``declare_dead`` controller -> every relay: ``ranks`` now dead cohort-wide
  (a rank that died anywhere, or every rank of a host whose link was lost). Each
  host counts them against its ``max_failures``. ``why`` (optional; flodl's controller
  sends none): how they left, one clause (``host 'NAME' stopped: REASON`` when their
  host said so, ``host 'NAME' was lost (connection closed; ...)``, ``died on host
  'NAME', whose output says why``); each host writes it as their death records.
- ``host_done`` relay -> controller: every rank of this host finished.
- ``host_stopping`` relay -> controller: a failure ends this host's run, before its
  link closes: ``rank`` (the global rank whose failure it is; -1 for none, e.g. a
  signal to the host's launcher) and ``reason`` (one line: its error, e.g.
  ``StartRefused: ...``, or how it died, and why that stops the host). The controller names it when the link closes, instead of a lost host.
- ``arm`` relay -> controller: a rank armed a consensus checkpoint: ``path``,
  ``meta``, ``param_names``, ``buffer_names``, ``tied``.
- ``stall`` controller -> every relay: the round did not complete in time:
  ``round``, ``missing`` (the global ranks that never delivered), ``timeout``.
  Ranks raise ``ReduceStall(round, missing, timeout)``. Before the cohort is complete
  it goes to each host that waited past its deadline alone, for round 0, with
  ``reason``: why the missing ranks did not deliver (they never joined).
- ``error`` controller -> every relay: ``message``; the controller's reduce loop
  failed and the cohort ends.
- ``dropped`` controller -> one relay, before it closes that host's link: ``reason``
  (one line): a record of that host failed the controller's checks (its tag, its
  sequence number, the frame ceiling), so the controller fails the host as a lost one
  and the cohort goes on without its ranks (``declare_dead`` to the others).
- ``frame_parts`` either way: the next ``parts`` frame records carry one round
  frame split at the frame ceiling: ``kind``, ``weight``, ``dtypes``, ``shapes``
  of the whole frame (``link.Link.send_frame`` / ``Link.recv`` do this
  transparently).
"""
from __future__ import annotations

import enum

from ..errors import FrameError

#: The most ranks a cohort holds, across its hosts: every control round carries a value
#: per rank, and the controller keeps a ledger entry per rank.
MAX_WORLD_SIZE = 1 << 16
#: The longest ``reason`` a ``host_stopping`` or ``dropped`` message carries (a control
#: record holds far more).
MAX_REASON_CHARS = 2000


class Ctrl(str, enum.Enum):
    """The ``"type"`` of a control message (see the module docstring for fields)."""

    HELLO = "hello"
    HELLO_ACK = "hello_ack"
    REJECT = "reject"
    RANK_DEAD = "rank_dead"
    DECLARE_DEAD = "declare_dead"
    HOST_DONE = "host_done"
    HOST_STOPPING = "host_stopping"
    ARM = "arm"
    STALL = "stall"
    ERROR = "error"
    DROPPED = "dropped"
    FRAME_PARTS = "frame_parts"


def ctrl_message(kind: Ctrl, /, **fields) -> dict:
    """A control message of type ``kind`` with ``fields`` (JSON-serialisable)."""
    return {"type": Ctrl(kind).value, **fields}


def outer_fields(outer) -> dict:
    """The ``hello_ack``'s ``outer`` object for the outer optimizer a controller steps:
    ``{"kind": "none"}`` for none or a stateless one, ``{"kind": "nesterov", "lr": LR,
    "momentum": MU}`` for an ``OuterNesterov``, and ``{"kind": <type name>}`` for a
    stateful one of the user's own (no settings a rank could compare)."""
    if not getattr(outer, "has_momentum", False):
        return {"kind": "none"}
    if hasattr(outer, "lr") and hasattr(outer, "mu"):
        return {"kind": "nesterov", "lr": float(outer.lr), "momentum": float(outer.mu)}
    return {"kind": type(outer).__name__}


def ctrl_type(msg: dict, peer: str) -> Ctrl:
    """The validated type of a received control message; ``FrameError`` naming the
    peer and the value for a type this protocol version does not define."""
    try:
        return Ctrl(msg.get("type"))
    except ValueError:
        raise FrameError(f"control message of unknown type {msg.get('type')!r} from {peer} "
                         f"(known: {', '.join(c.value for c in Ctrl)})") from None
