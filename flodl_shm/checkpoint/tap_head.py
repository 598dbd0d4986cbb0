"""The head of a checkpoint-tap message: one typed record, built by the rank, read by
the forge's owner (a single host's tap server, or a cluster's controller).

A rank that arms a consensus checkpoint (``Comm.arm_checkpoint``) describes the
cycle once — where the bundle goes, the model's tensor names, the metadata — and
then, for each captured MODEL round (the params frame, then the buffers frame),
adds what that frame is: its wire dtype, shapes, accepted mass and round, and the
shapes of the outer momentum that follows it (params frame of an outer optimizer
with state). It travels as JSON in front of the payload in the arena's ``tap``
mailbox (``engine/checkpoint_tap.py``); on a cluster only the arm travels, as the
fields of an ``arm`` control message (``arm_fields``), and the controller's forge
taps the consensus itself. Either reader arms its forge with
``checkpoint.forge.arm_from_head``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from ..errors import FrameError

Shapes = tuple[tuple[int, ...], ...]


def _shapes(value, what: str) -> Shapes:
    try:
        return tuple(tuple(int(d) for d in s) for s in value)
    except (TypeError, ValueError):
        raise FrameError(f"checkpoint tap head: {what} must be a list of shapes (lists of "
                         f"ints), got {value!r}") from None


@dataclass(frozen=True)
class TapHead:
    """One checkpoint-tap message head.

    Attributes:
        cycle: the arming rank's checkpoint cycle (1, 2, ... per ``arm_checkpoint``).
        part: the frame's index within the cycle (0: params, 1: buffers).
        path: the bundle's model path (``<stem>.fdl``).
        param_names, buffer_names, tied, non_persistent: the model's tensor names (its
            ``ModelSchema``; ``tied`` as ``(name, name it shares)`` pairs,
            ``non_persistent`` the buffers its ``state_dict()`` leaves out).
        meta: the bundle's ``CheckpointMeta.to_dict()``, or None (no ``.meta.json``).
        arm_only: a cluster arm (no frame follows; the controller taps the consensus).
        dtype: the frame's wire dtype (``DTYPE_F32``/``DTYPE_BF16``).
        shapes: the frame's tensor shapes.
        mass: the round's accepted mass.
        round: the round the frame is the consensus of (-1 for an arm).
        momentum_shapes: shapes of the outer momentum after the payload, or None.
    """

    cycle: int
    part: int
    path: str
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    meta: dict | None = None
    arm_only: bool = False
    dtype: int = 0
    shapes: Shapes = ()
    mass: float = 0.0
    round: int = -1
    momentum_shapes: Shapes | None = None
    tied: tuple[tuple[str, str], ...] = ()
    non_persistent: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_names", tuple(str(n) for n in self.param_names))
        object.__setattr__(self, "buffer_names", tuple(str(n) for n in self.buffer_names))
        object.__setattr__(self, "non_persistent", tuple(str(n) for n in self.non_persistent))
        tied = self.tied.items() if isinstance(self.tied, dict) else self.tied
        try:
            object.__setattr__(self, "tied", tuple((str(a), str(n)) for a, n in tied))
        except (TypeError, ValueError):
            raise FrameError(f"checkpoint tap head: tied must map names to names, got "
                             f"{self.tied!r}") from None
        object.__setattr__(self, "shapes", _shapes(self.shapes, "shapes"))
        if self.momentum_shapes is not None:
            object.__setattr__(self, "momentum_shapes",
                               _shapes(self.momentum_shapes, "momentum_shapes"))

    @property
    def tensor_count(self) -> int:
        """Tensors of the whole checkpoint (params + buffers)."""
        return len(self.param_names) + len(self.buffer_names)

    def for_frame(self, *, dtype: int, shapes, mass: float, round: int,
                  momentum_shapes=None) -> "TapHead":
        """This cycle's head describing one captured frame."""
        return replace(self, dtype=int(dtype), shapes=shapes, mass=float(mass),
                       round=int(round), momentum_shapes=momentum_shapes)

    def next_part(self) -> "TapHead":
        """The head of the cycle's next frame (no frame fields yet)."""
        return replace(self, part=self.part + 1, shapes=(), mass=0.0, round=-1,
                       momentum_shapes=None)

    # -- the tap mailbox's JSON ----------------------------------------------------------
    def to_json(self) -> bytes:
        """The head as the compact JSON the tap mailbox carries."""
        return json.dumps({
            "cycle": self.cycle, "part": self.part, "path": self.path,
            "param_names": list(self.param_names), "buffer_names": list(self.buffer_names),
            "meta": self.meta, "arm_only": self.arm_only, "dtype": self.dtype,
            "shapes": [list(s) for s in self.shapes], "mass": self.mass, "round": self.round,
            "momentum_shapes": (None if self.momentum_shapes is None
                                else [list(s) for s in self.momentum_shapes]),
            "tied": dict(self.tied), "non_persistent": list(self.non_persistent),
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "TapHead":
        """Parse ``to_json``'s bytes; FrameError naming a missing or malformed field."""
        try:
            d = json.loads(data)
        except ValueError as e:
            raise FrameError(f"checkpoint tap head is not JSON: {e}") from None
        return cls._from(d, "checkpoint tap head")

    # -- the cluster's arm message ---------------------------------------------------------
    def arm_fields(self) -> dict[str, Any]:
        """The fields of the ``arm`` control message a cluster arm travels as."""
        return {"path": self.path, "meta": self.meta, "param_names": list(self.param_names),
                "buffer_names": list(self.buffer_names), "tied": dict(self.tied),
                "non_persistent": list(self.non_persistent)}

    @classmethod
    def from_arm_fields(cls, msg: dict) -> "TapHead":
        """The head of a cluster arm from an ``arm`` message's fields (extra keys, such
        as ``type``, are ignored); FrameError naming a missing field."""
        d = {k: msg.get(k) for k in ("path", "meta", "param_names", "buffer_names", "tied",
                                     "non_persistent")}
        d.update(cycle=0, part=0, arm_only=True)
        return cls._from(d, "checkpoint arm message")

    @classmethod
    def _from(cls, d: Any, what: str) -> "TapHead":
        if not isinstance(d, dict):
            raise FrameError(f"{what} must be a JSON object, got {type(d).__name__}")
        for key in ("cycle", "part", "path", "param_names", "buffer_names"):
            if d.get(key) is None:
                raise FrameError(f"{what} lacks {key!r} (got keys {sorted(d)})")
        meta = d.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise FrameError(f"{what}: meta must be an object or null, got {meta!r}")
        try:
            return cls(cycle=int(d["cycle"]), part=int(d["part"]), path=str(d["path"]),
                       param_names=d["param_names"], buffer_names=d["buffer_names"],
                       meta=meta, arm_only=bool(d.get("arm_only", False)),
                       dtype=int(d.get("dtype", 0)), shapes=d.get("shapes") or (),
                       mass=float(d.get("mass", 0.0)), round=int(d.get("round", -1)),
                       momentum_shapes=d.get("momentum_shapes"), tied=d.get("tied") or (),
                       non_persistent=d.get("non_persistent") or ())
        except (TypeError, ValueError) as e:
            raise FrameError(f"{what}: malformed field: {e}") from None
