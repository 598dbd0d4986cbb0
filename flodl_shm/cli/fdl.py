"""``python -m flodl_shm fdl``: inspect and convert checkpoints.

    python -m flodl_shm fdl show FILE [--json]
        version, structural hash, and every entry's name, dtype, shape and bytes
        (reads headers only for a plain .fdl; .fdl.gz is decompressed).
    python -m flodl_shm fdl convert SRC DST [--from FMT] [--to FMT]
        between .fdl / .fdl.gz, .safetensors and torch files (.pt/.pth/.bin),
        formats from the file names unless given.

Exit status: 0 on success, 1 when the file is unreadable or corrupt (the
reason is printed to stderr), 2 for a usage error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from ..errors import CheckpointError


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _show(path: str, as_json: bool) -> int:
    from ..checkpoint.fdl import FdlDtype, is_gzip_path, read_fdl

    parsed = read_fdl(path, with_data=False)
    entries = [{"name": e.name, "dtype": FdlDtype(e.dtype_tag).label, "dtype_tag": e.dtype_tag,
                "shape": list(e.shape), "bytes": e.nbytes} for e in parsed.entries]
    summary = {
        "path": os.fspath(path),
        "gzip": is_gzip_path(path),
        "version": parsed.version,
        "structural_hash": parsed.hash_hex,
        "entries": len(entries),
        "payload_bytes": parsed.total_bytes(),
        "file_bytes": os.path.getsize(path),
    }
    if as_json:
        print(json.dumps({**summary, "tensors": entries}, indent=2))
        return 0
    print(f"{summary['path']}: .fdl version {parsed.version}"
          f"{' (gzip)' if summary['gzip'] else ''}, {len(entries)} entries, "
          f"{_fmt_bytes(summary['payload_bytes'])} of tensor data "
          f"({summary['file_bytes']} bytes on disk)")
    print(f"structural hash: {parsed.hash_hex or 'none (all zero)'}")
    if not entries:
        return 0
    w_name = max(4, max(len(e["name"]) for e in entries))
    shapes = [str(e["shape"]) for e in entries]
    w_shape = max(5, max(len(s) for s in shapes))
    print(f"{'#':>4}  {'name':<{w_name}}  {'dtype':<5}  {'shape':<{w_shape}}  {'bytes':>12}")
    for i, (e, s) in enumerate(zip(entries, shapes)):
        print(f"{i:>4}  {e['name']:<{w_name}}  {e['dtype']:<5}  {s:<{w_shape}}  {e['bytes']:>12}")
    return 0


def _convert(src: str, dst: str, src_fmt: Optional[str], dst_fmt: Optional[str]) -> int:
    from ..checkpoint.convert import convert

    n = convert(src, dst, src_fmt, dst_fmt)
    print(f"wrote {dst}: {n} tensors from {src}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flodl_shm fdl",
                                     description="Inspect and convert .fdl checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print a .fdl's header and entries")
    show.add_argument("file", help="a .fdl or .fdl.gz file")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    conv = sub.add_parser("convert", help="convert between .fdl, safetensors and torch files")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--from", dest="src_format", choices=("fdl", "safetensors", "torch"))
    conv.add_argument("--to", dest="dst_format", choices=("fdl", "safetensors", "torch"))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    try:
        if args.command == "show":
            return _show(args.file, args.json)
        return _convert(args.src, args.dst, args.src_format, args.dst_format)
    except BrokenPipeError:  # e.g. `... | head`: the reader left, nothing to report
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
