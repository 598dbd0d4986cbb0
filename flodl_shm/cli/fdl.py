"""``python -m flodl_shm fdl``: inspect and convert checkpoints.

    python -m flodl_shm fdl show FILE [--json]
        version, structural hash, and every entry's name, dtype, shape and bytes
        (reads headers only for a plain .fdl; .fdl.gz is decompressed); with the
        bundle's .names.json, the model name behind each p{i} / b{j} too.
    python -m flodl_shm fdl convert SRC DST [--from FMT] [--to FMT] [--keep-keys]
        between .fdl / .fdl.gz, .safetensors and torch files (.pt/.pth/.bin/.ckpt),
        formats from the file names unless given; a consensus checkpoint's
        p{i} / b{j} become the model's names (from its .names.json) unless
        --keep-keys.

Exit status: 0 on success, 1 when the file is unreadable or corrupt (the
reason is printed to stderr), 2 for a usage error.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..checkpoint.meta import bundle_meta_of, names_sidecar_path
from ..errors import CheckpointError, plural
from . import invoked_as, shortened


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def printable_name(name: str) -> str:
    """``name`` safe to print on a terminal: control and format characters (ANSI escape
    sequences, carriage returns, bidi overrides) and backslashes are escaped as
    ``\\xNN`` / ``\\uNNNN``; other characters, non-ASCII letters included, are kept."""
    if name.isprintable() and "\\" not in name:
        return name
    out = []
    for ch in name:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def _show(path: str, as_json: bool) -> int:
    """Print a .fdl's header and entries. Two passes over the headers (a plain file is not
    read past them), none of them held: memory does not grow with the entry count, and a
    corrupt file is reported before anything is printed."""
    from ..checkpoint.convert import bundle_names
    from ..checkpoint.fdl import FdlDtype, FdlReader, is_gzip_path

    if not path or os.path.isdir(path):  # (no bundle names to look for either)
        raise CheckpointError(f"cannot open checkpoint {path!r}: "
                              + ("a folder, not a .fdl file" if path else "an empty path"))
    try:
        schema = bundle_names(path)
    except CheckpointError as e:
        print(f"warning: model names not shown: {e}", file=sys.stderr)
        schema = None
    model_names = {} if schema is None else schema.positional_names()
    w_name, w_shape, w_model, payload = 4, 5, 10, 0
    with FdlReader(path) as reader:
        for e in reader.entries():
            payload += e.nbytes
            w_name = max(w_name, len(printable_name(e.name)))
            w_shape = max(w_shape, len(str(list(e.shape))))
            w_model = max(w_model, len(printable_name(model_names.get(e.name, ""))))
        version, hash_hex, count = reader.version, reader.hash_hex, reader.count
    summary = {
        "path": os.fspath(path),
        "gzip": is_gzip_path(path),
        "version": version,
        "structural_hash": hash_hex,
        "entries": count,
        "payload_bytes": payload,
        "file_bytes": os.path.getsize(path),
    }
    out = sys.stdout
    if as_json:
        # one JSON object, its "tensors" list streamed (json escapes control characters)
        head = json.dumps({**summary, "tensors": []}, indent=2)
        out.write(head[: head.rindex("[") + 1])
        with FdlReader(path) as reader:
            for i, e in enumerate(reader.entries()):
                item = {"name": e.name, "dtype": FdlDtype(e.dtype_tag).label,
                        "dtype_tag": e.dtype_tag, "shape": list(e.shape), "bytes": e.nbytes}
                if model_names:
                    item["model_name"] = model_names.get(e.name)
                out.write(("," if i else "") + "\n    " + json.dumps(item))
        out.write(("\n  " if count else "") + "]\n}\n")
        return 0
    entries = f"{count} entr{'y' if count == 1 else 'ies'}"
    out.write(f"{summary['path']}: .fdl version {version}"
              f"{' (gzip)' if summary['gzip'] else ''}, {entries}, "
              f"{_fmt_bytes(payload)} of tensor data ({summary['file_bytes']} bytes on disk)\n")
    out.write(f"structural hash: {hash_hex or 'none (all zero)'}\n")
    if not count:
        return 0
    if model_names:
        out.write(f"model names: {names_sidecar_path(path).name}\n")
    model_col = f"  {'model name':<{w_model}}" if model_names else ""
    out.write(f"{'#':>4}  {'name':<{w_name}}{model_col}  {'dtype':<5}  {'shape':<{w_shape}}  "
              f"{'bytes':>12}\n")
    with FdlReader(path) as reader:
        for i, e in enumerate(reader.entries()):
            model_col = (f"  {printable_name(model_names.get(e.name, '')):<{w_model}}"
                         if model_names else "")
            out.write(f"{i:>4}  {printable_name(e.name):<{w_name}}{model_col}  "
                      f"{FdlDtype(e.dtype_tag).label:<5}  {str(list(e.shape)):<{w_shape}}  "
                      f"{e.nbytes:>12}\n")
    return 0


def _convert(src: str, dst: str, src_fmt: Optional[str], dst_fmt: Optional[str],
             keep_keys: bool) -> int:
    from ..checkpoint.convert import bundle_names, convert, detect_format

    from_fdl = (src_fmt or detect_format(src)) == "fdl"
    renamed = not keep_keys and from_fdl and bundle_names(src) is not None
    n = convert(src, dst, src_fmt, dst_fmt, names=None if keep_keys else "auto")
    if from_fdl and not keep_keys and not renamed and (dst_fmt or detect_format(dst)) != "fdl" \
            and _positional(src):
        side = names_sidecar_path(src).name
        if _is_outer(src):  # the outer optimizer's momentum, one entry per parameter
            print(f"note: {src} has no {side} next to it, so {dst} keeps its positional keys "
                  f"(p0, p1, ...: the outer optimizer's momentum of each parameter, in the "
                  f"model's order): copy the bundle's .names.json next to {src} and convert "
                  f"again to key them by parameter name", file=sys.stderr)
        else:
            print(f"note: {src} has no {side} next to it, so {dst} keeps its positional keys "
                  f"(p0, p1, ..., b0, ...), which model.load_state_dict does not take: copy "
                  f"the bundle's .names.json next to {src} and convert again, or in Python: "
                  f"flodl_shm.checkpoint.convert.consensus_state_dict({src!r}, model)",
                  file=sys.stderr)
    how = ""
    if renamed:
        kept = (dst_fmt or detect_format(dst)) == "fdl"
        how = (f" (positional keys kept, names copied to {names_sidecar_path(dst).name})" if kept
               else f" (keys named from {names_sidecar_path(src).name})")
    print(f"wrote {dst}: {plural(n, 'tensor')} from {src}{how}")
    return 0


def _is_outer(path: str) -> bool:
    """Whether ``path`` names a bundle's outer-momentum file (``<stem>.outer.fdl[.gz]``)."""
    return os.path.basename(path).endswith((".outer.fdl", ".outer.fdl.gz"))


def _positional(path: str) -> bool:
    """Whether the ``.fdl`` at ``path`` is keyed as a consensus is (``p0``, ``b0``, ...)."""
    from ..checkpoint.fdl import FdlReader

    with FdlReader(path) as reader:
        names = [e.name for e in reader.entries()]
    return bool(names) and all(re.fullmatch(r"[pb]\d+", name) for name in names)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{invoked_as()} fdl",
                                     description="Inspect and convert .fdl checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print a .fdl's header and entries")
    show.add_argument("file", help="a .fdl or .fdl.gz file")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    conv = sub.add_parser("convert", help="convert between .fdl, safetensors and torch files")
    conv.add_argument("src", help="the file to read (.fdl, .fdl.gz, .safetensors, "
                      ".pt/.pth/.bin/.ckpt)")
    conv.add_argument("dst", help="the file to write; its format comes from its name, as src's")
    conv.add_argument("--from", dest="src_format", choices=("fdl", "safetensors", "torch"),
                      help="src's format when its name does not tell")
    conv.add_argument("--to", dest="dst_format", choices=("fdl", "safetensors", "torch"),
                      help="dst's format when its name does not tell")
    conv.add_argument("--keep-keys", action="store_true",
                      help="keep a consensus checkpoint's positional keys p0, p1, ..., b0, ... "
                           "(default: the model's names from the bundle's .names.json)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    if args.command == "convert":
        problem = (_unwritable_destination(args) or _unknown_format(args)
                   or _refused_destination(args))
        if problem:
            print(f"{parser.prog} convert: error: {problem}", file=sys.stderr)
            return 2
    try:
        if args.command == "show":
            return _show(args.file, args.json)
        return _convert(args.src, args.dst, args.src_format, args.dst_format, args.keep_keys)
    except BrokenPipeError:  # e.g. `... | head`: the reader left, nothing to report
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (CheckpointError, OSError) as e:
        print(f"{parser.prog} {args.command}: error: {e}{_series_hint(args)}", file=sys.stderr)
        return 1


def _unwritable_destination(args) -> str:
    """A usage error when the destination is a folder, lies in a folder that does not
    exist, or names a file whose own name or its temp file's would pass the file system's
    limit ("" otherwise): the write would fail after the conversion, naming a temporary
    file."""
    from ..checkpoint._atomic import LONGEST_TEMP_SUFFIX, path_limit
    from ..checkpoint.convert import detect_format

    dst = args.dst
    path = Path(dst)
    try:
        fdl = (args.dst_format or detect_format(dst)) == "fdl"
    except CheckpointError:  # (no format: _unknown_format says so)
        fdl = False
    # (an .fdl destination gets its .names.json beside it; each is written through a temp)
    names = [path.name, names_sidecar_path(path).name] if fdl else [path.name]
    longest = max(len(os.fsencode(n)) for n in names) + len(LONGEST_TEMP_SUFFIX)
    limit = path_limit(path.parent, "PC_NAME_MAX", 255)
    if longest > limit:
        fits = len(os.fsencode(path.name)) - (longest - limit)
        return (f"{shortened(dst)}: the file name is {len(os.fsencode(path.name))} bytes and "
                f"the files written for it take up to {longest} (their temp files add "
                f"{len(LONGEST_TEMP_SUFFIX)}), over this file system's limit of {limit}; "
                f"name it with at most {max(fits, 1)} bytes")
    if path.is_dir():
        return (f"{dst} is a folder; name the file to write in it, e.g. "
                f"{path / 'model.pt'}")
    parent = path.parent
    if not parent.is_dir():
        return (f"{dst}: {parent} is not a folder" if parent.exists() else
                f"{dst}: the folder {parent} does not exist; create it first, or write "
                f"elsewhere")
    return ""


def _unknown_format(args) -> str:
    """A usage error in the command's own terms when ``convert`` cannot tell a file's
    format from its name and no ``--from`` / ``--to`` gives it ("" otherwise)."""
    from ..checkpoint.convert import detect_format

    for path, fmt, flag in ((args.src, args.src_format, "--from"),
                            (args.dst, args.dst_format, "--to")):
        if fmt is None:
            try:
                detect_format(path)
            except CheckpointError:
                return (f"cannot tell the format of {path} from its name; name it .fdl, "
                        f".fdl.gz, .safetensors or .pt/.pth/.bin/.ckpt, or pass {flag} "
                        f"fdl|safetensors|torch")
    return ""


def _refused_destination(args) -> str:
    """A usage error when ``convert`` would write over its own source, or over any file
    of a committed checkpoint bundle (one with its ``.meta.json``): the model, its
    metadata, a rank's state, or the ``.names.json`` a ``.fdl`` destination gets beside
    it. That run's resume reads them all ("" otherwise)."""
    dst = args.dst
    try:
        if os.path.exists(dst) and os.path.samefile(args.src, dst):
            return f"{dst} is the file being converted; write the result to another path"
    except OSError:
        pass  # src missing: convert says so
    fdl_out = (args.dst_format or _format_or_none(dst)) == "fdl"
    for target in (dst, names_sidecar_path(dst)) if fdl_out else (dst,):
        meta = bundle_meta_of(target)
        if meta is not None:
            what = "is a file" if os.fspath(target) == os.fspath(dst) else \
                f"would rewrite {Path(target).name}, a file,"
            return (f"{dst} {what} of the checkpoint bundle committed by {meta.name}: writing "
                    f"it would break that run's resume; write the result to another path "
                    f"(another stem)")
    return ""


def _format_or_none(path: str) -> Optional[str]:
    from ..checkpoint.convert import detect_format
    try:
        return detect_format(path)
    except CheckpointError:
        return None


def _series_hint(args) -> str:
    """When the file given does not exist but names a checkpoint series (the stem a
    Trainer or ``LocalSGD.save`` was given), the newest bundle's path, to pass instead."""
    from ..checkpoint.series import latest_checkpoint

    path = args.file if args.command == "show" else args.src
    if os.path.exists(path):
        return ""
    try:
        latest = latest_checkpoint(path)
    except ValueError:  # no stem at all ("", a path ending with a separator)
        return ""
    return "" if latest is None else (f"; {path} names a checkpoint series, whose newest "
                                      f"bundle is {latest}")


if __name__ == "__main__":
    sys.exit(main())
