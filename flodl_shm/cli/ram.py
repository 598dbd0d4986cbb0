"""Is this host big enough? ``python -m flodl_shm ram`` (also ``tools/host_ram.py``).

Prints the memory figures a process here sees (``hostmem.host_memory``: RAM total
and available bounded by the container's memory cgroup, swap, ``/dev/shm`` size
and free space), our ``fshm_`` segments in ``/dev/shm`` with whether their owner
is alive (``--reap`` removes those of dead owners), what a model of the given
size needs with N local ranks, and one verdict per check with the numbers behind
it. Exit status 0 when every required check passes, 1 when one fails, 2 for a
usage error.

Checks (``host_checks``):

``dev_shm_space`` (required)
    The host arena for N ranks (``arena.shm_need_bytes``: one frame per rank and the
    result's), plus on a bf16 wire the start broadcast's f32 frame, fits in
    ``/dev/shm``'s free space. Where LocalSGD's rounds run direct, its shared
    parameter blocks (a model per rank) stand in for those regions, which then stay
    empty: the figure covers either. Docker's default ``/dev/shm`` is 64 MB.
``ram`` (required)
    The arena's pages plus one decoded model-sized consensus per rank fit in the
    available RAM. ``/dev/shm`` is tmpfs: its pages are RAM, charged to this
    memory cgroup, so a ``/dev/shm`` larger than the container's memory limit
    (``--ipc=host``, or ``--shm-size`` above ``-m``) passes the first check and is
    OOM-killed later. Training's own memory (model, optimizer state, activations,
    data) is counted only when given (``--train-bytes``, per rank); without it the
    check, and the verdict "fits", are a floor and say so.
``pinned_decode_staging`` (advisory)
    The gate ``staging.pinned_decode_affordable``: when it refuses, ranks decode
    into fresh buffers instead of reusable staging; the run still works.
``dead_owner_segments`` (advisory)
    No ``fshm_`` segment of a dead owner is left in ``/dev/shm`` (they hold RAM;
    ``--reap`` removes them and ``spawn`` reaps them when it starts).

``--json`` prints one object: ``ok`` (bool), ``checks`` (items with ``name``,
``ok``, ``need_bytes``, ``have_bytes``, ``detail``, ``required``), plus ``host``
(the snapshot), ``segments``, ``reaped``, ``needs`` and ``inputs``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from decimal import (MAX_EMAX, MIN_EMIN, Context, Decimal, InvalidOperation, Overflow,
                     localcontext)
from pathlib import Path
from typing import Sequence

from ..engine.arena import MAX_LOCAL_RANKS, shm_need_bytes
from ..errors import plural
from ..engine.hostmem import HostMemory, host_memory
from ..engine.segment import SHM_DIR, SegmentInfo, fmt_bytes, list_segments, reap_dead_owner_segments
from ..engine.staging import GATE_FACTOR, decide_pinned_decode
from . import invoked_as

SIZE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
}
COUNT_UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "b": 10 ** 9}


# 2^62 bytes (4 EiB) or parameters: far past any host, and every figure the report derives
# from it still fits the 64-bit arithmetic of the arena's layout
MAX_SCALED = 1 << 62


def _split_number(text: str, what: str) -> tuple[Decimal, str]:
    s = str(text).strip().replace("_", "")
    if s.startswith("-"):
        raise ValueError(f"{what} {text!r} is negative; give a positive number")
    i = 0
    while i < len(s) and (s[i].isdigit() or s[i] == "."):
        i += 1
    exponent = re.match(r"[eE][+-]?\d+", s[i:])  # (1e9, 2.5E6: as a Python user writes them)
    if i and exponent:
        i += exponent.end()
    num, unit = s[:i], s[i:].strip()
    try:
        value = Decimal(num)
    except InvalidOperation:
        raise ValueError(f"{what} {text!r} is not a number with an optional suffix") from None
    return value, unit


def _scaled(text: str, what: str, units: dict[str, int], accepted: str,
            hint: str = "") -> int:
    value, unit = _split_number(text, what)
    mult = units.get(unit.lower())
    if mult is None:
        raise ValueError(f"{what} {text!r} has an unknown suffix {unit!r}{hint}; use {accepted}")
    try:
        with localcontext(Context(Emax=MAX_EMAX, Emin=MIN_EMIN)):  # (1e1000000 overflowed)
            n = value * mult
    except Overflow:  # (past even that: 1e999999999999999999K)
        n = Decimal("Infinity")
    if n != n.to_integral_value():
        raise ValueError(f"{what} {text!r} is not a whole number ({n})")
    if n > MAX_SCALED:
        raise ValueError(f"{what} {text!r} is {n:.3g}, over the limit of {MAX_SCALED:.3g} "
                         f"(2^62); give the model's real size")
    return int(n)


def parse_size(text: str) -> int:
    """Bytes from ``727MiB``, ``7.3GB``, ``1048576``, ``4e9``: KiB/MiB/GiB/TiB are binary
    (2^10…), KB/MB/GB/TB decimal (10^3…), case-insensitive; plain integers are bytes.

    Raises:
        ValueError: naming the text and the accepted suffixes (a bare ``M`` or ``G``
            is refused as ambiguous).
    """
    unit = _split_number(text, "size")[1]
    hint = ""
    if unit.lower() in ("k", "m", "g", "t"):
        u = unit.upper()
        hint = f" ({unit!r} is ambiguous: write {u}iB for binary or {u}B for decimal)"
    return _scaled(text, "size", SIZE_UNITS, "KiB/MiB/GiB/TiB (binary), KB/MB/GB/TB (decimal) "
                   "or a plain byte count", hint)


def parse_count(text: str) -> int:
    """A parameter count from ``190M``, ``1.3B``, ``250K``, ``12000``, ``1e9``
    (K = 10^3, M = 10^6, B = 10^9, case-insensitive).

    Raises:
        ValueError: naming the text and the accepted suffixes.
    """
    n = _scaled(text, "count", COUNT_UNITS, "K (thousand), M (million), B (billion) or a "
                "plain integer")
    if n == 0:
        raise ValueError(f"count {text!r} is zero: give the model's parameter count "
                         f"(sum(p.numel() for p in model.parameters()))")
    return n


def parse_model_size(text: str) -> int:
    """``--model-bytes``: :func:`parse_size`, and not zero."""
    n = parse_size(text)
    if n == 0:
        raise ValueError(f"size {text!r} is zero: give the model's float32 size, "
                         f"sum(p.numel() for p in model.parameters()) * 4 bytes")
    return n


@dataclass(frozen=True)
class HostCheck:
    """One verdict: ``ok`` when ``have_bytes`` covers ``need_bytes`` (the detail says
    how each was computed, and the fix when not ok). An advisory check
    (``required=False``) never makes the host fail."""

    name: str
    ok: bool
    need_bytes: int
    have_bytes: int
    detail: str
    required: bool = True


def host_checks(mem: HostMemory, staging_bytes: int, local_ranks: int, *,
                wire_bf16: bool = False, relay: bool = False,
                segments: Sequence[SegmentInfo] = (), train_bytes: int = 0
                ) -> list[HostCheck]:
    """The checks for a model of ``staging_bytes`` f32 bytes (Σ numel × 4) trained
    on ``local_ranks`` ranks of this host (see the module doc for each).

    Args:
        train_bytes: each rank's own training memory (model, optimizer state,
            activations, data), added to the RAM check; 0 when not known (the
            check is then a floor and its detail says so).
    """
    from ..engine.arena import direct_min_bytes

    ranks = max(1, int(local_ranks))
    nelem = -(-int(staging_bytes) // 4)
    frame = nelem * (2 if wire_bf16 else 4)
    wire = "bf16" if wire_bf16 else "f32"
    arena = shm_need_bytes(ranks, frame, wire_bf16=wire_bf16, relay=relay)
    # LocalSGD's shared parameter blocks (a model per rank), where its rounds run direct:
    # its regions then stay empty, so the arena's figure covers the blocks
    shared_blocks = (ranks >= 2 and not wire_bf16 and not relay
                     and nelem * 4 >= direct_min_bytes())
    # the replicas' start broadcast is an f32 frame, in its root's region, whatever the
    # wire (unless it runs direct)
    start = nelem * 4 - frame if wire_bf16 and ranks >= 2 else 0
    shm = arena + start
    dead = [s for s in segments if not s.owner_alive]
    dead_bytes = sum(s.nbytes for s in dead)
    checks = []

    # /dev/shm space
    ok = mem.shm_free >= shm
    detail = (f"the arena for {ranks} rank{'s' if ranks != 1 else ''} with "
              f"{fmt_bytes(frame)} {wire} frames needs {fmt_bytes(arena)}"
              + (f", the start broadcast's f32 frame {fmt_bytes(start)} more" if start else "")
              + (f": {fmt_bytes(shm)}" if start else "")
              + (f" (where LocalSGD's rounds run direct, its shared parameter blocks, "
                 f"{ranks} × {fmt_bytes(nelem * 4)}, take the place of the regions, which "
                 f"stay empty)" if shared_blocks else "")
              + f"; {mem.shm_dir} has {fmt_bytes(mem.shm_free)} free of "
                f"{fmt_bytes(mem.shm_total)}")
    if dead:
        holds = "holds" if len(dead) == 1 else "hold"
        detail += (f"; {plural(len(dead), 'segment')} of dead owners {holds} "
                   f"{fmt_bytes(dead_bytes)} "
                   f"(--reap frees them)")
    if not ok:
        if dead and mem.shm_free + dead_bytes >= shm:
            detail += ". Fix: run with --reap (it fits once they are gone)"
        else:
            want = max(1, -(-int(shm * 1.5) // (1 << 30)))
            detail += (f". Fix: give /dev/shm more room: `docker run --shm-size={want}g ...` "
                       f"(Docker's default is 64 MB), a memory-backed emptyDir on /dev/shm in "
                       f"Kubernetes, or `mount -o remount,size={want}G /dev/shm`"
                       + ("; the bf16 wire halves the frames" if not wire_bf16 else ""))
    checks.append(HostCheck("dev_shm_space", ok, shm, mem.shm_free, detail))

    # RAM: the arena's tmpfs pages + one decoded consensus per rank (+ training's own)
    train = max(0, int(train_bytes))
    need = shm + ranks * nelem * 4 + ranks * train
    ok = mem.available >= need
    bound = (f"the cgroup v{mem.cgroup_version} headroom at {mem.cgroup_path}; host "
             f"MemAvailable {fmt_bytes(mem.host_available)}" if mem.limited_by_cgroup
             else "host MemAvailable")
    own = (f" + {ranks} × {fmt_bytes(train)} training memory (--train-bytes)" if train
           else "")
    detail = (f"/dev/shm {fmt_bytes(shm)} (it is RAM, charged to this memory cgroup) + "
              f"{ranks} × {fmt_bytes(nelem * 4)} decoded consensus{own} = {fmt_bytes(need)}; "
              f"{fmt_bytes(mem.available)} available ({bound})")
    if not train:
        detail += (". Training's own memory (model, optimizer state, activations, data) is "
                   "not counted: it comes on top (give it per rank with --train-bytes)")
    if not ok:
        detail += (". Fix: raise the memory limit (`docker run -m`, Kubernetes "
                   "resources.limits.memory), use a bigger host or run fewer local ranks"
                   + ("; the bf16 wire shrinks the arena" if not wire_bf16 else ""))
    checks.append(HostCheck("ram", ok, need, mem.available, detail))

    # the pinned decode staging gate (advisory)
    d = decide_pinned_decode(int(staging_bytes), ranks, mem, log=False, moment="now")
    checks.append(HostCheck("pinned_decode_staging", d.enabled, d.need_bytes, d.available_bytes,
                            d.reason, required=False))

    # segments left behind by dead owners (advisory)
    if dead:
        owners = sorted({s.owner_pid for s in dead})
        detail = (f"{plural(len(dead), 'fshm_ segment')} of dead owner "
                  f"pid{'' if len(owners) == 1 else 's'} {', '.join(map(str, owners))} "
                  f"hold{'s' if len(dead) == 1 else ''} {fmt_bytes(dead_bytes)} of "
                  f"{mem.shm_dir} (and RAM). Fix: `python -m flodl_shm ram --reap"
                  f"{'' if mem.shm_dir == '/dev/shm' else ' --shm-dir ' + mem.shm_dir}` (spawn "
                  f"also reaps them at start)")
    else:
        detail = "no fshm_ segment of a dead owner in " + mem.shm_dir
    checks.append(HostCheck("dead_owner_segments", not dead, 0, dead_bytes, detail,
                            required=False))
    return checks


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Is this host big enough to train a model with N local ranks? "
        "Prints RAM (bounded by the container's memory cgroup), swap, /dev/shm, our shared-"
        "memory segments, and a verdict per check. Exit 0 when everything fits, 1 when not.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model-bytes", "--model-size", type=_argtype(parse_model_size),
                   metavar="SIZE",
                   help="f32 model size (Σ numel × 4), e.g. 727MiB or 760MB (--model-size "
                        "is the same)")
    g.add_argument("--params", type=_argtype(parse_count), metavar="COUNT",
                   help="number of parameters, e.g. 190M or 1.3e9 (K/M/B suffixes)")
    p.add_argument("--local-ranks", "--nprocs", type=int, default=1, metavar="N",
                   help="ranks on this host (default 1; --nprocs as in the demo)")
    p.add_argument("--wire", choices=("f32", "bf16"), default="f32",
                   help="wire dtype of model frames (default f32)")
    p.add_argument("--train-bytes", type=_argtype(parse_size), default=0, metavar="SIZE",
                   help="each rank's own training memory (model, optimizer state, "
                        "activations, data), added to the RAM check; without it the "
                        "verdict counts the engine's memory only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--reap", action="store_true",
                   help="remove fshm_ segments whose owner process is gone, first")
    adv = p.add_argument_group("inspecting another root (tests, a container's files)")
    adv.add_argument("--root", default="/", metavar="DIR",
                     help="folder standing in for / (proc/, sys/fs/cgroup/, dev/shm)")
    adv.add_argument("--shm-dir", default=None, metavar="DIR",
                     help="the /dev/shm to inspect (default <root>/dev/shm)")
    adv.add_argument("--shm-size", type=_argtype(parse_size), default=None, metavar="SIZE",
                     help="state the size of --shm-dir when it is not a real tmpfs; its free "
                          "space is then SIZE minus its files")
    return p


def _folder_problem(flag: str, path: Path) -> str:
    """Why the folder given to ``flag`` cannot be inspected ("" when it can)."""
    if not path.exists():
        return f"{flag} {path} does not exist; pass an existing folder"
    if not path.is_dir():
        return f"{flag} {path} is a file, not a folder; pass a folder"
    return ""


def _argtype(fn):
    def conv(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    conv.__name__ = fn.__name__
    return conv


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the tool; returns the exit status (0 fits, 1 does not, 2 usage error)."""
    p = _parser(prog or f"{invoked_as()} ram")
    try:
        a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)
    if not 1 <= a.local_ranks <= MAX_LOCAL_RANKS:
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: --local-ranks (--nprocs) {a.local_ranks} must be from 1 to "
              f"{MAX_LOCAL_RANKS} (one host runs at most {MAX_LOCAL_RANKS} ranks)",
              file=sys.stderr)
        return 2
    root = Path(a.root)
    problem = _folder_problem("--root", root)
    if not problem and a.shm_dir:
        problem = _folder_problem("--shm-dir", Path(a.shm_dir))
    if not problem and root.resolve() != Path("/") and not (root / "proc" / "meminfo").is_file():
        problem = (f"--root {a.root}: {root / 'proc' / 'meminfo'} is missing; --root stands in "
                   f"for / and needs a proc/meminfo (MemTotal and MemAvailable in kB): put one "
                   f"there, or leave --root out to inspect this host")
    if problem:
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: {problem}", file=sys.stderr)
        return 2
    shm_dir = Path(a.shm_dir) if a.shm_dir else (SHM_DIR if root.resolve() == Path("/")
                                                 else root / "dev" / "shm")
    if a.params is not None:
        params = a.params
        staging = params * 4
    elif a.model_bytes is not None:
        staging = a.model_bytes
        params = -(-staging // 4)
    else:
        params = staging = 0

    reaped = reap_dead_owner_segments(shm_dir) if a.reap else []
    segments = list_segments(shm_dir)
    try:
        mem = host_memory(root, shm_dir=shm_dir, shm_total_bytes=a.shm_size)
    except OSError as e:  # a --root without proc/meminfo, an unreadable --shm-dir
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    checks = host_checks(mem, staging, a.local_ranks, wire_bf16=a.wire == "bf16",
                         segments=segments, train_bytes=a.train_bytes)
    ok = all(c.ok for c in checks if c.required)
    frame = params * (2 if a.wire == "bf16" else 4)
    report = {
        "ok": ok,
        "checks": [asdict(c) for c in checks],
        "inputs": {"params": params, "model_bytes": staging,
                   "model_given": a.params is not None or a.model_bytes is not None,
                   "local_ranks": a.local_ranks,
                   "wire": a.wire, "train_bytes": a.train_bytes, "root": str(root),
                   "shm_dir": str(shm_dir)},
        "needs": {
            "staging_bytes_per_rank": staging,
            "frame_bytes": frame,
            "arena_shm_bytes": checks[0].need_bytes,
            "ram_bytes": checks[1].need_bytes,
            "gate_need_bytes": checks[2].need_bytes,
        },
        "host": mem.to_dict(),
        "segments": [_seg(s) for s in segments],
        "reaped": [_seg(s, alive=False) for s in reaped],
    }
    _emit(json.dumps(report, indent=2) if a.json else render(report, mem, segments, reaped))
    return 0 if ok else 1


def _emit(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _seg(s: SegmentInfo, alive: bool | None = None) -> dict:
    return {"name": s.name, "owner_pid": s.owner_pid, "session": s.session, "what": s.what,
            "nbytes": s.nbytes, "owner_alive": s.owner_alive if alive is None else alive}


def _verdict(check: dict) -> str:
    """Four-letter verdict: ok/FAIL for required checks, on/off for the staging gate,
    ok/warn for other advisory ones."""
    if check["name"] == "pinned_decode_staging":
        return "on  " if check["ok"] else "off "
    if check["ok"]:
        return "ok  "
    return "FAIL" if check["required"] else "warn"


def _count(n: int) -> str:
    """A parameter count in the unit that reads best: 190.0M, 7.0B, 12,345."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:,}"


def render(report: dict, mem: HostMemory, segments: Sequence[SegmentInfo],
           reaped: Sequence[SegmentInfo]) -> str:
    """The human-readable table of a report."""
    inp, needs = report["inputs"], report["needs"]
    ranks = inp["local_ranks"]
    out = []
    if inp["params"]:
        model = (f"{_count(inp['params'])} params = {fmt_bytes(inp['model_bytes'])} f32, "
                 f"{inp['wire']} wire")
    else:
        model = ("not given (--model-bytes SIZE or --params COUNT): the needs below are for "
                 "a 0-byte model")
    out.append(f"model        {model}")
    out.append(f"local ranks  {ranks}")
    out.append("")
    out.append("memory (as a process here sees it)")
    if mem.cgroup_version is None:
        cg = "none found"
    elif mem.cgroup_limit is None:
        cg = f"v{mem.cgroup_version}, no limit, usage {fmt_bytes(mem.cgroup_usage or 0)}"
    else:
        cg = (f"v{mem.cgroup_version}, limit {fmt_bytes(mem.cgroup_limit)}, usage "
              f"{fmt_bytes(mem.cgroup_usage or 0)} ({fmt_bytes(mem.cgroup_reclaimable)} "
              f"reclaimable cache)")
    rows = [
        ("RAM total", f"{fmt_bytes(mem.total)}   (host MemTotal {fmt_bytes(mem.host_total)})"),
        ("RAM available", f"{fmt_bytes(mem.available)}   (host MemAvailable "
                          f"{fmt_bytes(mem.host_available)}; "
                          f"{'bounded by the cgroup' if mem.limited_by_cgroup else 'not bounded by a cgroup'})"),
        ("memory cgroup", cg),
        ("", f"at {mem.cgroup_path}" if mem.cgroup_path else ""),
        ("swap", f"{fmt_bytes(mem.swap_total)} total, {fmt_bytes(mem.swap_free)} free"),
        ("/dev/shm", f"{fmt_bytes(mem.shm_total)} total, {fmt_bytes(mem.shm_free)} free   "
                     f"({mem.shm_dir})"),
    ]
    out += [f"  {k:<15} {v}" for k, v in rows if k or v]
    out.append("")
    out.append(f"fshm_ segments in {inp['shm_dir']}")
    width = max((len(s.name) for s in [*reaped, *segments]), default=0)
    for s in reaped:
        out.append(f"  {s.name:<{width}}  {fmt_bytes(s.nbytes):>10}  owner {s.owner_pid} dead: "
                   f"reaped")
    for s in segments:
        state = "alive" if s.owner_alive else "DEAD (--reap removes it)"
        out.append(f"  {s.name:<{width}}  {fmt_bytes(s.nbytes):>10}  owner {s.owner_pid} {state}")
    if not segments and not reaped:
        out.append("  (none)")
    out.append("")
    out.append("needs")
    arena_label = f"/dev/shm, {ranks} rank{'s' if ranks != 1 else ''}"
    out.append(f"  {'decode staging per rank':<26}{fmt_bytes(needs['staging_bytes_per_rank']):>10}   "
               f"(a float32 model per rank, whatever the wire; kept where "
               f"{GATE_FACTOR}x it per rank is available)")
    out.append(f"  {arena_label:<26}{fmt_bytes(needs['arena_shm_bytes']):>10}   "
               f"({fmt_bytes(needs['frame_bytes'])} frames)")
    out.append("")
    out.append("checks")
    for c in report["checks"]:
        verdict = _verdict(c)
        kind = "" if c["required"] else " (advisory)"
        out.append(f"  [{verdict}] {c['name']}{kind}: need {fmt_bytes(c['need_bytes'])}, have "
                   f"{fmt_bytes(c['have_bytes'])}")
        out.append(f"         {c['detail']}")
    out.append("")
    failed = [c["name"] for c in report["checks"] if c["required"] and not c["ok"]]
    if failed:
        out.append(f"verdict: does NOT fit ({', '.join(failed)} failed; exit 1)")
    elif not inp.get("model_given", True):
        out.append("verdict: no model given, so the checks above are for an empty model (exit "
                   "0); pass --model-bytes SIZE or --params COUNT for a verdict on yours")
    elif inp["train_bytes"]:
        out.append(f"verdict: fits (exit 0), counting {fmt_bytes(inp['train_bytes'])} per rank "
                   f"of training memory (--train-bytes)")
    else:
        out.append("verdict: fits (exit 0) for the engine's memory only: the model, optimizer "
                   "state and activations are not counted (give them per rank with "
                   "--train-bytes SIZE)")
    return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
