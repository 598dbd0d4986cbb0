"""What the ranks must agree on before they average, each checked in one small
collective (``Comm.all_reduce_per_rank_f64``) that raises on every rank, naming who
differs and the fix, before a window could average replicas that disagree:

- **the same settings** (:func:`check_same_settings`): ``LocalSGD``'s construction
  compares its settings and the model's tensors across ranks before the broadcast that
  aligns the replicas. Ranks built with different ``sync_every`` would pair their
  k-th syncs over different amounts of work, different ``gamma`` weigh it differently,
  and a different outer optimizer, cadence or buffers rule runs other rounds;
  different models would fail in the engine's terms (frame schemas) instead of naming
  the parameter.
- **the same start** (:func:`check_same_start`): every rank resumes from the same
  checkpoint round, or every rank starts from scratch; a rank that could not load
  tells the others.
- **the controller's outer optimizer** (:func:`check_controller_outer`, several hosts):
  the controller steps the hosts' outer optimizer, with their settings, and its outer
  momentum starts where the hosts do.

A dead rank's slot reads 0 and is left out of every comparison.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional

from ..cluster.control import outer_fields
from ..errors import StartRefused

__all__ = ["check_controller_outer", "check_controller_steps_none", "check_same_model",
           "check_same_settings", "check_same_start", "digest24", "outer_settings",
           "per_rank_ints"]


def digest24(value: Any) -> int:
    """A digest of ``repr(value)`` in 1 .. 2^24 - 1: exact on the per-rank round's f32
    wire, and never 0 (a dead rank's slot)."""
    h = int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=4).digest(), "little")
    return h % 0xFFFFFF + 1


def check_same_settings(comm, settings: dict[str, Any], fix: str) -> None:
    """Check that every rank passes the same ``settings`` (a collective: one small
    per-rank round; one more per setting when they differ, to name which).

    Args:
        comm: this rank's ``Comm``.
        settings: name -> value (compared through ``repr``; the same names, in the same
            order, on every rank).
        fix: what the message ends with.

    Raises:
        ValueError: on every rank, naming each setting that differs, this rank's value
            and the ranks that hold it, then ``fix``.
    """
    if comm.world_size < 2:
        return
    if _split(comm.rank, per_rank_ints(comm, digest24(tuple(settings.items())))) is None:
        return
    differ = []
    for name, value in settings.items():
        if _split(comm.rank, per_rank_ints(comm, digest24(value))) is not None:
            # every rank learns every rank's value (one more round), so every rank (and
            # every host, which a controller then reports once) says the same
            held: dict[str, list[int]] = {}
            for r, text in enumerate(_texts_by_rank(comm, repr(value))):
                if text is not None:
                    held.setdefault(text, []).append(r)
            differ.append(f"{name} (" + "; ".join(f"{text} on ranks {ranks}"
                                                  for text, ranks in held.items()) + ")")
    raise ValueError(f"the ranks differ in {'; '.join(differ) or 'their settings'}: {fix}")


#: the longest value (UTF-8 bytes of its repr) a settings mismatch quotes per rank
QUOTED_BYTES = 240


def _texts_by_rank(comm, text: str) -> list[Optional[str]]:
    """Every rank's ``text`` (its first ``QUOTED_BYTES`` bytes, ``...`` where cut), None
    for a dead rank: a collective, one small round (``sync_window.gather_columns``;
    three bytes per value, exact on its float32 wire)."""
    from .sync_window import gather_columns

    full = text.encode()
    data = full[:QUOTED_BYTES]
    n = -(-QUOTED_BYTES // 3)
    # the whole length + 1 (0: a dead rank), at most 2^23: exact on the float32 wire
    column = [float(min(len(full), 1 << 23) + 1)] + [0.0] * n
    for i in range(0, len(data), 3):
        column[1 + i // 3] = float(int.from_bytes(data[i:i + 3].ljust(3, b"\0"), "little"))
    table = gather_columns(comm, column)
    out: list[Optional[str]] = []
    for r in range(comm.world_size):
        head = int(table[0, r])
        if head == 0:
            out.append(None)
            continue
        size = head - 1
        raw = b"".join(int(table[1 + j, r]).to_bytes(3, "little") for j in range(n))
        out.append(raw[:size].decode(errors="replace")
                   + ("..." if size > QUOTED_BYTES else ""))
    return out


def check_same_model(comm, tensors: list[tuple[str, str]], fix: str) -> None:
    """Check that every rank averages the same tensors (a collective: one small per-rank
    round; when they differ, one more per tensor to name the first that differs).

    Args:
        comm: this rank's ``Comm``.
        tensors: ``(name, description)`` of each averaged tensor in round order, e.g.
            ``("parameter 'fc.weight'", "shape (4, 3) torch.float32")``.
        fix: what the message ends with.

    Raises:
        ValueError: on every rank, naming the first tensor that differs (this rank's
            name and description, and the ranks that agree with it), then ``fix``.
    """
    if comm.world_size < 2:
        return
    if _split(comm.rank, per_rank_ints(comm, digest24(tuple(tensors)))) is None:
        return
    counts = per_rank_ints(comm, len(tensors) + 1)
    for i in range(max(counts) - 1):
        entry = tensors[i] if i < len(tensors) else None
        split = _split(comm.rank, per_rank_ints(comm, digest24(entry)))
        if split is not None:
            same, others = split
            what = (f"tensor {i} is {entry[0]}, {entry[1]}" if entry is not None
                    else f"the model averages {len(tensors)} tensors, none at {i}")
            raise ValueError(f"the ranks' models differ: on rank {comm.rank}"
                             f"{_also(comm.rank, same)}, {what}; ranks {others} have "
                             f"another: {fix}")
    raise ValueError(f"the ranks' models differ (the same tensors in another order): {fix}")


def outer_settings(outer) -> Any:
    """What of an outer optimizer every rank must agree on: its kind and its
    hyper-parameters (a ``torch.optim`` optimizer's parameter groups without their
    tensors; an ``OuterNesterov``'s lr and momentum); None for none."""
    if outer is None:
        return None
    groups = getattr(outer, "param_groups", None)
    if groups is not None:
        return (type(outer).__name__, [{k: v for k, v in g.items() if k != "params"}
                                       for g in groups])
    return (type(outer).__name__, getattr(outer, "lr", None), getattr(outer, "mu", None))


def _split(rank: int, got: list[int]) -> Optional[tuple[list[int], list[int]]]:
    """``(ranks with rank's value, live ranks with another)``, or None when every live
    rank (non-zero slot) has the same value."""
    if len({v for v in got if v}) <= 1:
        return None
    mine = got[rank]
    return ([r for r, v in enumerate(got) if v == mine],
            [r for r, v in enumerate(got) if v and v != mine])


def _also(rank: int, same: list[int]) -> str:
    """``" (as on ranks [...])"`` when ranks other than ``rank`` agree with it."""
    return "" if same == [rank] else f" (as on ranks {same})"


def per_rank_ints(comm, value: int) -> list[int]:
    """Every rank's ``value`` by rank (a collective: one small per-rank round; 0 for a
    dead rank). The round carries float32: exact for integers of magnitude below 2^24."""
    mine = [0.0] * comm.world_size
    mine[comm.rank] = float(value)
    return [int(round(v)) for v in comm.all_reduce_per_rank_f64(mine)]


def check_same_start(comm, start_round: Optional[int], fix: str,
                     failed: Optional[Exception] = None) -> None:
    """Check that every rank starts from the same checkpoint (a collective: one small
    per-rank round). ``start_round`` is the sync round of the bundle this rank loaded, or
    None when it starts from scratch; ``failed`` the error this rank's load raised (its
    peers are told, instead of waiting for it at their next round). On several hosts
    each host loads its own copy of the bundles: a host left with an older one would
    average with the others while its counters and books say otherwise. A rank already
    dead (its slot reads 0) is left out.

    Raises:
        ``failed`` itself on the rank that failed.
        StartRefused: (a ``ValueError``) on every other rank, naming which ranks start
            from which round or could not load, then ``fix``.
    """
    # -1: this rank's load failed, 1: from scratch, 2 + round: from a bundle; a dead
    # rank's slot reads 0 (ignored)
    got = per_rank_ints(comm, -1 if failed is not None else
                        1 if start_round is None else start_round + 2)
    if failed is not None:
        raise failed
    if len({v for v in got if v}) <= 1:
        return
    by_start: dict[int, list[int]] = {}
    for r, v in enumerate(got):
        if v:
            by_start.setdefault(v, []).append(r)
    starts = "; ".join(("could not load (see their error)" if v < 0 else
                        "from scratch" if v == 1 else f"from sync round {v - 2}")
                       + f": ranks {ranks}" for v, ranks in sorted(by_start.items()))
    raise StartRefused(f"the ranks start from different checkpoints ({starts}); {fix}")


def check_controller_outer(comm, outer, start_round: Optional[int],
                           outer_name: Optional[str]) -> None:
    """On a cluster whose controller steps the outer optimizer: check that it steps
    this rank's ``outer`` (kind, lr, momentum: ``Comm.controller_outer``) and that
    its outer momentum starts where this rank does (``Comm.controller_outer_round``).
    Call it after a cross-host round. ``start_round`` is the sync round of the bundle
    this rank resumes from, or None from scratch; ``outer_name`` the file name of that
    bundle's outer momentum (what the controller should load), or None from scratch.

    Raises:
        StartRefused: (a ``ValueError``) on every rank, naming both sides and the
            controller option that fixes it.
    """
    _check_controller_steps(comm.controller_outer(), outer)
    if not getattr(outer, "has_momentum", False):
        return
    held = comm.controller_outer_round()
    if held is None or held == (-1 if start_round is None else start_round):
        return
    have = ("fresh outer momentum" if held < 0
            else f"the outer momentum of sync round {held} (--outer-state)")
    if start_round is None:
        raise StartRefused(f"the hosts start from scratch, but the controller holds {have}: "
                           f"restart the controller without --outer-state")
    raise StartRefused(f"the hosts resume from sync round {start_round}, but the controller "
                       f"holds {have}: restart the controller with --outer-state naming its "
                       f"copy of {outer_name}, the momentum saved with that round, so the "
                       f"outer optimizer continues where the hosts do")


def check_controller_steps_none(comm, outer) -> None:
    """On a cluster whose ranks step their outer optimizer themselves (LocalSGD across
    hosts: no round asks the controller to step one), the controller must step none.
    Call it after a cross-host round.

    Raises:
        StartRefused: on every rank, naming the controller's outer optimizer and the fix.
    """
    held = comm.controller_outer()
    if held is None or held["kind"] == "none":
        return
    theirs = f"OuterNesterov(lr={held['lr']:g}, momentum={held['momentum']:g})"
    mine = "outer=None" if outer is None else type(outer).__name__
    raise StartRefused(
        f"the controller steps {theirs}, but LocalSGD across hosts steps its outer optimizer "
        f"on every rank ({mine}) and never asks the controller to: its --outer nesterov "
        f"would be silently ignored. Restart the controller without --outer nesterov, and "
        f"build LocalSGD with the outer optimizer you want (outer=OuterNesterov(...), or "
        f"DiLoCo)")


def _check_controller_steps(held: Optional[dict], outer) -> None:
    """The controller steps the outer optimizer of the ranks' rounds: the one the
    ranks were built with, or none when theirs has no state (refusing either way)."""
    if held is None:
        return  # one host, or a controller that says nothing
    mine = outer_fields(outer)
    if mine["kind"] not in ("none", "nesterov"):
        return  # a stateful outer optimizer of the user's own: no settings to compare
    if held == mine:
        return
    if held["kind"] == "none":
        raise StartRefused(
            f"this rank's outer optimizer is OuterNesterov(lr={mine['lr']:g}, "
            f"momentum={mine['momentum']:g}), which the controller steps on a cluster, but "
            f"the controller steps none: restart it with --outer nesterov --outer-lr "
            f"{mine['lr']:g} --outer-momentum {mine['momentum']:g}")
    theirs = f"OuterNesterov(lr={held['lr']:g}, momentum={held['momentum']:g})"
    if mine["kind"] == "none":
        raise StartRefused(
            f"the controller steps {theirs}, but this rank's rounds have no outer "
            f"optimizer ({type(outer).__name__ if outer is not None else 'outer=None'}), "
            f"so the controller's would never run: build the ranks with outer={theirs}, "
            f"or restart the controller without --outer nesterov")
    raise StartRefused(
        f"this rank's outer optimizer is OuterNesterov(lr={mine['lr']:g}, "
        f"momentum={mine['momentum']:g}), but the controller, which steps it on a cluster, "
        f"has {theirs}: restart the controller with --outer-lr {mine['lr']:g} "
        f"--outer-momentum {mine['momentum']:g} (or build the ranks with {theirs})")
