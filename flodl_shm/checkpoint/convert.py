"""Converters between ``.fdl``, torch state_dicts and safetensors files.

The safetensors layout is written and read here directly (no dependency)::

    u64 LE   N, the header length
    N bytes  UTF-8 JSON object: {"__metadata__": {str: str} (optional),
             name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...}
             padded with spaces so N is a multiple of 8
    bytes    the tensors' raw little-endian bytes; offsets are relative to the
             start of this region, which they cover exactly (no gaps, no overlap)

Tensors are laid out by element size, largest first (stable otherwise), so every
tensor is aligned to its element size as the reference implementation does.

A *consensus* ``.fdl`` stores positional keys (``p{i}`` / ``b{j}``, see
``forge``), which keep it loadable by flodl. The qualified names behind them
travel in the bundle's ``<stem>.names.json`` (a ``ModelSchema``, written by the
forge before the model, and by :func:`state_dict_to_consensus_fdl`). Every
converter that reads a ``.fdl`` with such a sidecar (``names="auto"``, the
default) renames the keys, so ``model.load_state_dict(torch.load(converted))``
works; ``names=None`` keeps the file's keys, and a ``ModelSchema`` or module
supplies the names explicitly. A ``.fdl`` -> ``.fdl`` conversion keeps the
positional keys and copies the sidecar next to the new file.
"""
from __future__ import annotations

import json
import logging
import math
import os
import struct
from pathlib import Path
from typing import Mapping, Optional

from ..errors import CheckpointError
from ._atomic import atomic_write
from .fdl import RawEntry, _tensor_bytes, read_fdl, save_tensors, tag_for_torch_dtype, write_fdl_raw
from .meta import ModelSchema, consensus_buffer_key, consensus_param_key, names_sidecar_path

logger = logging.getLogger("flodl_shm")

#: Largest safetensors header this reader accepts (the reference limit).
SAFETENSORS_MAX_HEADER = 100_000_000
#: Metadata key carrying a non-zero .fdl structural hash through a safetensors file.
FDL_HASH_METADATA_KEY = "fdl_structural_hash"


def _torch():
    import torch

    return torch


def _st_dtypes() -> dict:
    torch = _torch()
    table = {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
        "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
        "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
    }
    for code, attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                       ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
        if hasattr(torch, attr):
            table[code] = getattr(torch, attr)
    return table


def _itemsize(dtype) -> int:
    return _torch().empty((), dtype=dtype).element_size()


# --- safetensors --------------------------------------------------------------------


def save_safetensors(tensors: Mapping[str, object], path: "str | os.PathLike[str]",
                     metadata: Optional[Mapping[str, str]] = None) -> int:
    """Commit ``tensors`` (name -> tensor) as a safetensors file at ``path``, atomically.

    ``metadata`` must map strings to strings. Returns the file size. Tensor
    bytes are written from the tensors' own storage (contiguous CPU tensors are
    not copied).
    """
    codes = {v: k for k, v in _st_dtypes().items()}
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise CheckpointError(f"safetensors keys must be strings, got {name!r}")
        if name == "__metadata__":
            raise CheckpointError("'__metadata__' is reserved in safetensors; rename that tensor")
        code = codes.get(t.dtype)
        if code is None:
            raise CheckpointError(
                f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store"
            )
        items.append((name, t, code, _itemsize(t.dtype)))
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise CheckpointError(
                    f"safetensors metadata must map str to str, got {k!r}: {v!r}; convert the "
                    f"values with str() or json.dumps()"
                )
    # Largest elements first keeps every tensor aligned to its element size.
    items.sort(key=lambda it: -it[3])
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    views = []
    for name, t, code, size in items:
        data = _tensor_bytes(t)
        header[name] = {"dtype": code, "shape": list(t.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        views.append(data)
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    head += b" " * (-len(head) % 8)

    def _write(fh) -> int:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for v in views:
            fh.write(v)
        return 8 + len(head) + offset

    return atomic_write(path, _write)


def read_safetensors_header(path: "str | os.PathLike[str]") -> tuple[dict, dict, int]:
    """Parse and validate a safetensors header.

    Returns ``(entries, metadata, data_start)`` where ``entries`` maps each name,
    in offset order, to ``{"dtype", "shape", "data_offsets"}``. Raises
    ``CheckpointError`` for a malformed file.
    """
    p = Path(os.fspath(path))
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            if len(prefix) != 8:
                raise CheckpointError(f"{p} is not a safetensors file: {size} bytes, shorter "
                                      f"than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > SAFETENSORS_MAX_HEADER:
                raise CheckpointError(f"{p}: safetensors header length {n} exceeds the "
                                      f"{SAFETENSORS_MAX_HEADER}-byte limit (corrupt file?)")
            if 8 + n > size:
                raise CheckpointError(f"{p}: safetensors header claims {n} bytes but the file "
                                      f"holds {size - 8} after the length")
            raw = fh.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read {p}: {e}") from e
    if not raw.startswith(b"{"):
        raise CheckpointError(f"{p}: safetensors header does not start with '{{'")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: safetensors header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{p}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{p}: safetensors __metadata__ must map strings to strings")
    dtypes = _st_dtypes()
    data_len = size - 8 - n
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise CheckpointError(f"{p}: tensor {name!r}: header entry is not an object")
        code, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if code not in dtypes:
            raise CheckpointError(f"{p}: tensor {name!r}: unknown safetensors dtype {code!r} "
                                  f"(known: {', '.join(dtypes)})")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                           for d in shape)):
            raise CheckpointError(f"{p}: tensor {name!r}: shape {shape!r} is not a list of "
                                  f"non-negative ints")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise CheckpointError(f"{p}: tensor {name!r}: data_offsets {offs!r} is not "
                                  f"[begin, end] with 0 <= begin <= end")
        want = math.prod(shape) * _itemsize(dtypes[code])
        if offs[1] - offs[0] != want:
            raise CheckpointError(
                f"{p}: tensor {name!r}: data_offsets span {offs[1] - offs[0]} bytes but shape "
                f"{shape} x {code} needs {want}")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin != cursor:
            raise CheckpointError(
                f"{p}: tensor {name!r} starts at data offset {begin}, expected {cursor} "
                f"(tensors must cover the data region without gaps or overlap)")
        cursor = end
    if cursor != data_len:
        raise CheckpointError(
            f"{p}: tensors cover {cursor} bytes but the data region holds {data_len} "
            f"(truncated or padded file)")
    ordered = {name: header[name] for _, _, name in spans}
    return ordered, metadata, 8 + n


def load_safetensors(path: "str | os.PathLike[str]") -> tuple[dict, dict]:
    """Read a safetensors file: ``(name -> CPU tensor, metadata)``; tensors own their memory."""
    torch = _torch()
    entries, metadata, start = read_safetensors_header(path)
    dtypes = _st_dtypes()
    out = {}
    with open(os.fspath(path), "rb") as fh:
        for name, info in entries.items():
            t = torch.empty(info["shape"], dtype=dtypes[info["dtype"]])
            begin, end = info["data_offsets"]
            if end > begin:
                fh.seek(start + begin)
                got = fh.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                if got != end - begin:
                    raise CheckpointError(f"{path}: tensor {name!r} truncated: {got} of "
                                          f"{end - begin} bytes")
            out[name] = t
    return out, metadata


# --- consensus keys <-> qualified names ---------------------------------------------


def _schema_of(schema_or_module) -> ModelSchema:
    if isinstance(schema_or_module, ModelSchema):
        return schema_or_module
    return ModelSchema.from_module(schema_or_module)


def bundle_names(path: "str | os.PathLike[str]") -> Optional[ModelSchema]:
    """The ``ModelSchema`` in the ``.names.json`` next to the ``.fdl`` at ``path``
    (``x.fdl``, ``x.fdl.gz``, ``x.outer.fdl`` -> ``x.names.json``), or None without one."""
    side = names_sidecar_path(path)
    return ModelSchema.read_from_file(side) if side.exists() else None


def _names_for(path, names) -> Optional[ModelSchema]:
    """The schema to rename ``path``'s keys with: ``"auto"`` -> its sidecar (or None),
    None -> None, a ``ModelSchema`` or module -> its names."""
    if isinstance(names, str):
        if names != "auto":
            raise ValueError(f"names must be 'auto', None, a ModelSchema or a module, got "
                             f"{names!r}")
        return bundle_names(path)
    return None if names is None else _schema_of(names)


def rename_positional(tensors: Mapping[str, object], schema: ModelSchema,
                      source: "str | os.PathLike[str]") -> dict:
    """``tensors`` keyed ``p{i}`` / ``b{j}`` renamed to ``schema``'s qualified names.

    The keys must be exactly the schema's (a consensus model), or exactly its
    ``p{i}`` (an outer-momentum sidecar, one tensor per parameter). Raises
    ``CheckpointError`` naming the missing and unexpected keys otherwise. Each of the
    schema's ``tied`` names maps to the same tensor as the name it shares, and its
    non-persistent buffers are left out, as in the model's own ``state_dict()``.
    """
    names = schema.positional_names()
    params = {consensus_param_key(i) for i in range(len(schema.param_names))}
    missing = [k for k in names if k not in tensors]
    unexpected = [k for k in tensors if k not in names]
    if unexpected or (missing and set(tensors) != params):
        raise CheckpointError(
            f"{os.fspath(source)} does not match the schema ({len(schema.param_names)} params + "
            f"{len(schema.buffer_names)} buffers): missing {missing}, unexpected {unexpected}; "
            f"pass the model it was saved from, or keep the file's keys (names=None, "
            f"fdl convert --keep-keys)")
    return schema.as_state_dict({names[k]: tensors[k] for k in names if k in tensors})


def consensus_state_dict(path: "str | os.PathLike[str]", schema_or_module=None) -> dict:
    """Read a consensus ``.fdl`` with its positional keys renamed to qualified names.

    ``p{i}`` -> ``schema.param_names[i]``, ``b{j}`` -> ``schema.buffer_names[j]``,
    the schema taken from ``schema_or_module`` or, when None, from the bundle's
    ``.names.json``. Raises ``CheckpointError`` when the keys don't match the
    schema exactly (a checkpoint from another model) or no names are available.
    The result loads with ``module.load_state_dict(sd)`` (integer buffers such as
    BatchNorm's ``num_batches_tracked`` are not in it; torch's BatchNorm fills
    that one in, other modules may need ``strict=False``).
    """
    schema = _names_for(path, "auto" if schema_or_module is None else schema_or_module)
    if schema is None:
        raise CheckpointError(
            f"{path} has no {names_sidecar_path(path).name} next to it: pass the model (or its "
            f"ModelSchema) whose names the p{{i}}/b{{j}} keys stand for")
    return fdl_to_state_dict(path, names=schema)


def state_dict_to_consensus_fdl(state_dict: Mapping[str, object], schema_or_module,
                                path: "str | os.PathLike[str]") -> int:
    """Write a named state_dict as a consensus ``.fdl`` (positional keys, f32) and its
    ``.names.json``, e.g. to start a flodl_shm run from a torch checkpoint. Every
    schema name must be present, except a non-persistent buffer (which ``state_dict()``
    leaves out) when ``schema_or_module`` is the module: its own value is taken. Given
    the module, each entry must also have its tensor's shape (``CheckpointError`` naming
    the first that does not: the file would not load into it)."""
    torch = _torch()
    schema = _schema_of(schema_or_module)
    own = ({} if isinstance(schema_or_module, ModelSchema)
           else dict(schema_or_module.named_buffers()))
    shapes = ({} if isinstance(schema_or_module, ModelSchema)
              else {n: tuple(t.shape) for n, t in (*schema_or_module.named_parameters(),
                                                    *schema_or_module.named_buffers())})
    entries = []
    for key_of, names in ((consensus_param_key, schema.param_names),
                          (consensus_buffer_key, schema.buffer_names)):
        for i, n in enumerate(names):
            value = state_dict.get(n)
            if value is None and n in schema.non_persistent:
                value = own.get(n)
                if value is None:
                    raise CheckpointError(
                        f"state_dict has no entry {n!r}, a non-persistent buffer (needed for "
                        f"{key_of(i)}; state_dict() leaves it out): pass the model itself "
                        f"rather than its ModelSchema, and its value is taken from it")
            if value is None:
                raise CheckpointError(f"state_dict has no entry {n!r} (needed for "
                                      f"{key_of(i)}); it does not match the schema")
            t = value.detach().to(torch.float32)
            if n in shapes and tuple(t.shape) != shapes[n]:
                raise CheckpointError(f"state_dict entry {n!r} has shape {list(t.shape)}; the "
                                      f"model's is {list(shapes[n])}: it is another model's "
                                      f"state_dict")
            entries.append(RawEntry(key_of(i), tuple(t.shape), tag_for_torch_dtype(t.dtype),
                                    _tensor_bytes(t)))
    schema.write_to_file(names_sidecar_path(path))
    return write_fdl_raw(path, entries)


# --- .fdl <-> state_dict / safetensors ----------------------------------------------


def fdl_to_state_dict(path: "str | os.PathLike[str]", names="auto") -> dict:
    """Read a ``.fdl`` as ``{name: tensor}`` in file order (duplicates: the later wins).

    Args:
        path: the ``.fdl`` / ``.fdl.gz``.
        names: ``"auto"``: a consensus checkpoint's ``p{i}`` / ``b{j}`` keys become
            the qualified names of its bundle's ``.names.json`` when there is one;
            None: the file's keys as they are; a ``ModelSchema`` or module: its names.
    """
    return read_any(path, "fdl", names)[0]


def state_dict_to_fdl(state_dict: Mapping[str, object], path: "str | os.PathLike[str]",
                      structural_hash: "None | str | bytes" = None) -> int:
    """Commit a ``{name: tensor}`` mapping as a by-name ``.fdl`` (dtypes kept)."""
    for name, t in state_dict.items():
        if not hasattr(t, "dtype") or not hasattr(t, "shape"):
            raise CheckpointError(
                f"state_dict entry {name!r} is a {type(t).__name__}, not a tensor; pass a "
                f"flat mapping of names to tensors (e.g. model.state_dict())")
    return save_tensors(path, list(state_dict.items()), structural_hash)


def fdl_to_safetensors(src: "str | os.PathLike[str]", dst: "str | os.PathLike[str]",
                       metadata: Optional[Mapping[str, str]] = None, names="auto") -> int:
    """Convert a ``.fdl`` to safetensors (keys renamed as :func:`fdl_to_state_dict`'s
    ``names`` says). A non-zero structural hash rides in the metadata under
    ``fdl_structural_hash``; ``{"format": "pt"}`` is added unless ``metadata``
    says otherwise."""
    return convert(src, dst, "fdl", "safetensors", names=names, metadata=metadata)


def safetensors_to_fdl(src: "str | os.PathLike[str]", dst: "str | os.PathLike[str]") -> int:
    """Convert a safetensors file to a ``.fdl`` (restoring an ``fdl_structural_hash``).
    ``CheckpointError`` names any tensor whose dtype .fdl cannot hold."""
    return convert(src, dst, "safetensors", "fdl")


# --- torch files ----------------------------------------------------------------------


def _torch_load_error(path, e: Exception) -> str:
    """One line for why ``torch.load(weights_only=True)`` failed: torch's own text is a
    page (how to turn the safety off, where to file an issue)."""
    import zipfile

    if isinstance(e, OSError):
        return str(e)
    if not zipfile.is_zipfile(os.fspath(path)):
        return "not a file torch.save wrote (it writes a zip archive)"
    text = str(e)
    for line in text.splitlines():
        _, found, why = line.partition("WeightsUnpickler error:")
        if found and why.strip():
            why = why.strip().split(" Please use ")[0]
            return (f"it holds objects other than tensors ({why}); save model.state_dict() "
                    f"to convert it")
    first = text.splitlines()[0] if text else type(e).__name__
    return first[:300]


def load_torch_state_dict(path: "str | os.PathLike[str]") -> dict:
    """``torch.load(path, weights_only=True)`` of a flat ``{name: tensor}`` mapping (a
    ``{"state_dict": {...}}`` wrapper is unwrapped)."""
    torch = _torch()
    try:
        obj = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot load torch file {path}: {_torch_load_error(path, e)}"
                              ) from e
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        others = [k for k in obj if k != "state_dict"]
        if others:
            logger.warning("%s: converting its 'state_dict' entry; its other entries (%s) are "
                           "left out", path, ", ".join(map(repr, others[:5]))
                           + (", ..." if len(others) > 5 else ""))
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"{path} does not hold a flat {{name: tensor}} state_dict (got "
            f"{type(obj).__name__}); save model.state_dict() to convert it")
    for name, value in obj.items():
        if not isinstance(value, torch.Tensor):
            hint = (f"a checkpoint of several parts? save the model's part alone, e.g. "
                    f"torch.save(ckpt[{name!r}], ...)" if isinstance(value, Mapping)
                    else "save model.state_dict() alone to convert it")
            raise CheckpointError(
                f"{path} does not hold a flat {{name: tensor}} state_dict: its entry {name!r} "
                f"is not a tensor ({type(value).__name__}); {hint}")
    return dict(obj)


def save_torch_state_dict(state_dict: Mapping[str, object], path: "str | os.PathLike[str]") -> None:
    """``torch.save`` a state_dict to ``path``, committed atomically."""
    torch = _torch()
    atomic_write(path, lambda fh: torch.save(dict(state_dict), fh))


FORMATS = ("fdl", "safetensors", "torch")


def detect_format(path: "str | os.PathLike[str]") -> str:
    """``fdl`` for ``.fdl`` / ``.fdl.gz``, ``safetensors`` for ``.safetensors``, ``torch``
    for ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt``."""
    name = Path(os.fspath(path)).name.lower()
    if name.endswith((".fdl", ".fdl.gz")):
        return "fdl"
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return "torch"
    raise CheckpointError(
        f"cannot tell the format of {os.fspath(path)!r} from its name; use a .fdl, .fdl.gz, "
        f".safetensors or .pt/.pth/.bin name, or pass the format (fdl convert --from/--to, "
        f"convert(src_format=, dst_format=))")


def read_any(path: "str | os.PathLike[str]", fmt: Optional[str] = None,
             names="auto") -> tuple[dict, Optional[str]]:
    """``({name: tensor}, structural_hash_hex_or_None)`` from any supported format; a
    ``.fdl``'s keys renamed as :func:`fdl_to_state_dict`'s ``names`` says."""
    fmt = fmt or detect_format(path)
    if fmt == "fdl":
        parsed = read_fdl(path)
        tensors = {e.name: e.to_tensor() for e in parsed.entries}
        schema = _names_for(path, names)
        if schema is not None:
            tensors = rename_positional(tensors, schema, path)
        return tensors, parsed.hash_hex
    if fmt == "safetensors":
        tensors, meta = load_safetensors(path)
        return tensors, meta.get(FDL_HASH_METADATA_KEY)
    if fmt == "torch":
        return load_torch_state_dict(path), None
    raise CheckpointError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")


def convert(src: "str | os.PathLike[str]", dst: "str | os.PathLike[str]",
            src_format: Optional[str] = None, dst_format: Optional[str] = None,
            names="auto", metadata: Optional[Mapping[str, str]] = None) -> int:
    """Convert a checkpoint between ``.fdl``, safetensors and torch files (formats from
    the names unless given). Shapes, dtypes and bytes are preserved; a non-zero .fdl
    structural hash survives a trip through safetensors. Returns the number of
    tensors converted.

    Args:
        src, dst: the files.
        src_format, dst_format: ``fdl``, ``safetensors`` or ``torch``; None: from the name.
        names: for a ``.fdl`` source, as in :func:`fdl_to_state_dict`: by default a
            consensus checkpoint's ``p{i}`` / ``b{j}`` become the model's names from
            its ``.names.json``, so ``model.load_state_dict(torch.load(dst))`` works.
            Into a ``.fdl`` the positional keys stay and the names are copied to
            ``dst``'s own ``.names.json`` (the result is still a consensus checkpoint).
        metadata: extra safetensors metadata (safetensors destinations only).
    """
    src_format = src_format or detect_format(src)
    dst_format = dst_format or detect_format(dst)
    schema = _names_for(src, names) if src_format == "fdl" else None
    fdl_to_fdl = src_format == "fdl" and dst_format == "fdl"
    tensors, hash_hex = read_any(src, src_format, names=None if fdl_to_fdl else schema)
    if dst_format == "fdl":
        if fdl_to_fdl and schema is not None:
            rename_positional(tensors, schema, src)  # the names must fit before they travel
            schema.write_to_file(names_sidecar_path(dst))
        state_dict_to_fdl(tensors, dst, hash_hex)
    elif dst_format == "safetensors":
        meta = {"format": "pt"}
        if hash_hex:
            meta[FDL_HASH_METADATA_KEY] = hash_hex
        meta.update(metadata or {})
        save_safetensors(tensors, dst, meta)
    elif dst_format == "torch":
        save_torch_state_dict(tensors, dst)
    else:
        raise CheckpointError(f"unknown format {dst_format!r} (known: {', '.join(FORMATS)})")
    return len(tensors)


__all__ = [
    "FDL_HASH_METADATA_KEY",
    "bundle_names",
    "consensus_state_dict",
    "convert",
    "detect_format",
    "fdl_to_safetensors",
    "fdl_to_state_dict",
    "load_safetensors",
    "load_torch_state_dict",
    "read_any",
    "read_safetensors_header",
    "rename_positional",
    "safetensors_to_fdl",
    "save_safetensors",
    "save_torch_state_dict",
    "state_dict_to_consensus_fdl",
    "state_dict_to_fdl",
]
