"""Crafted ``.fdl`` files: what a hostile or corrupt checkpoint may cost a reader.

A decompression bomb (a small ``.fdl.gz`` declaring a huge tensor), an entry
count far beyond the file, a million tiny entries, bytes after the declared
entries, and entry names carrying terminal escape sequences. Every reader must
fail (or succeed) with memory bounded by the model or by the file, never by
what the file's headers claim; peaks are measured with ``tracemalloc``.
"""
from __future__ import annotations

import gzip
import os
import struct
import tracemalloc

import pytest
import torch

from flodl_shm import CheckpointError
from flodl_shm.checkpoint.fdl import MAX_ENTRIES, MIN_ENTRY_BYTES, read_fdl
from flodl_shm.checkpoint.forge import load_consensus_checkpoint
from flodl_shm.cli import fdl as cli

MiB = 1 << 20
#: One gzip member holding 16 MiB of zeros; concatenated members are one valid gzip
#: stream, so a bomb of any size costs one compression.
_ZEROS = 16 * MiB


@pytest.fixture(scope="module")
def zero_member() -> bytes:
    return gzip.compress(bytes(_ZEROS), 9)


def file_header(count: int) -> bytes:
    return b"FDLC" + struct.pack("<I", 2) + bytes(32) + struct.pack("<I", count)


def entry_header(name: str, shape, tag: int, nbytes: int) -> bytes:
    nb = name.encode()
    return (struct.pack("<I", len(nb)) + nb + struct.pack("<I", len(shape))
            + b"".join(struct.pack("<q", d) for d in shape) + bytes([tag])
            + struct.pack("<Q", nbytes))


def f32_entry(name: str, values, shape=None) -> bytes:
    raw = torch.tensor(values, dtype=torch.float32).numpy().tobytes()
    return entry_header(name, (len(values),) if shape is None else shape, 3, len(raw)) + raw


def peak_of(fn):
    """(result or raised exception, peak bytes traced while running ``fn``)."""
    tracemalloc.start()
    try:
        try:
            out = fn()
        except Exception as e:  # returned, for the caller to check
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --- decompression bombs --------------------------------------------------------------


def test_gzip_bomb_fails_at_the_header_without_inflating_the_payload(tmp_path, zero_member):
    # 130 kB on disk, a 128 MiB tensor declared for a 4-element parameter.
    n = 128 * MiB
    path = tmp_path / "bomb.fdl.gz"
    path.write_bytes(gzip.compress(file_header(1) + entry_header("p0", (n // 4,), 3, n))
                     + zero_member * (n // _ZEROS))
    assert path.stat().st_size < 256 * 1024
    model = torch.nn.Linear(2, 2, bias=False)
    before = model.weight.detach().clone()
    err, peak = peak_of(lambda: load_consensus_checkpoint(model, path))
    assert isinstance(err, CheckpointError), err
    assert "shape mismatch: checkpoint=[33554432] model=[2, 2]" in str(err)
    assert peak < 1 * MiB, f"the shape check ran after {peak} bytes were allocated"
    assert torch.equal(model.weight, before)


def test_gzip_entry_without_a_slot_is_inflated_and_dropped_not_kept(tmp_path, zero_member):
    n = 64 * MiB
    path = tmp_path / "extra.fdl.gz"
    path.write_bytes(gzip.compress(file_header(2) + f32_entry("p0", [1, 2, 3, 4], (2, 2))
                                   + entry_header("junk", (n // 4,), 3, n))
                     + zero_member * (n // _ZEROS))
    model = torch.nn.Linear(2, 2, bias=False)
    report, peak = peak_of(lambda: load_consensus_checkpoint(model, path))
    assert not isinstance(report, Exception), report
    assert report.loaded == ["p0"] and report.unexpected == ["junk"]
    assert model.weight.flatten().tolist() == [1, 2, 3, 4]
    assert peak < 8 * MiB, f"loading 16 bytes into the model held {peak} bytes"


def test_gzip_load_touches_nothing_when_the_stream_is_corrupt_after_the_entries(tmp_path):
    # gzip payloads are staged: a bad CRC at the very end must leave the model as it was.
    blob = bytearray(gzip.compress(file_header(1) + f32_entry("p0", [1, 2, 3, 4], (2, 2))))
    blob[-8] ^= 0xFF  # the CRC32 of the trailer
    path = tmp_path / "crc.fdl.gz"
    path.write_bytes(bytes(blob))
    model = torch.nn.Linear(2, 2, bias=False)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match="CRC"):
        load_consensus_checkpoint(model, path)
    assert torch.equal(model.weight, before)


# --- the entry count ----------------------------------------------------------------


@pytest.mark.parametrize("gz", [False, True])
def test_entry_count_beyond_the_file_is_refused_before_reading_entries(tmp_path, gz):
    blob = file_header(1_000_000) + entry_header("w", (), 3, 4) + bytes(4)
    path = tmp_path / ("many.fdl.gz" if gz else "many.fdl")
    path.write_bytes(gzip.compress(blob) if gz else blob)
    err, peak = peak_of(lambda: read_fdl(path, with_data=False))
    assert isinstance(err, CheckpointError), err
    assert f"entry count 1000000 needs at least {1_000_000 * MIN_ENTRY_BYTES} bytes" in str(err)
    assert peak < 1 * MiB


def test_entry_count_above_the_limit_is_refused(tmp_path):
    path = tmp_path / "limit.fdl"
    path.write_bytes(file_header(MAX_ENTRIES + 1) + bytes(MIN_ENTRY_BYTES))
    with pytest.raises(CheckpointError, match=f"entry count {MAX_ENTRIES + 1} exceeds the limit "
                                              f"of {MAX_ENTRIES} entries"):
        read_fdl(path, with_data=False)


@pytest.mark.parametrize("gz", [False, True])
def test_trailing_bytes_after_the_declared_entries_are_refused(tmp_path, gz):
    blob = file_header(1) + f32_entry("w", [1, 2]) + b"hidden"
    path = tmp_path / ("t.fdl.gz" if gz else "t.fdl")
    path.write_bytes(gzip.compress(blob) if gz else blob)
    needle = ("the stream continues after the 1 declared entries" if gz
              else "6 trailing bytes after the 1 declared entries")
    with pytest.raises(CheckpointError, match=needle):
        read_fdl(path)
    with pytest.raises(CheckpointError, match=needle):
        read_fdl(path, with_data=False)
    with pytest.raises(CheckpointError, match=needle):
        load_consensus_checkpoint(torch.nn.Linear(2, 1, bias=False), path)


def test_a_gzip_tail_after_the_entries_is_not_inflated(tmp_path, zero_member):
    # The declared bytes cap the inflation: 256 MiB appended after the entries are
    # refused at their first byte.
    path = tmp_path / "tail.fdl.gz"
    path.write_bytes(gzip.compress(file_header(1) + f32_entry("w", [1, 2]))
                     + zero_member * 16)
    err, peak = peak_of(lambda: read_fdl(path))
    assert isinstance(err, CheckpointError) and "continues after the 1 declared" in str(err)
    assert peak < 2 * MiB


def many_empty_entries(path, n: int) -> None:
    """``n`` f32 scalars named e000000...: the shape of the 1 M-entry file of issue 12."""
    parts = [file_header(n)]
    for i in range(n):
        parts.append(entry_header(f"e{i:06d}", (), 3, 4) + bytes(4))
    path.write_bytes(b"".join(parts))


def test_fdl_show_memory_does_not_grow_with_the_entry_count(tmp_path, monkeypatch):
    n = 5_000
    path = tmp_path / "many.fdl"
    many_empty_entries(path, n)
    small = tmp_path / "small.fdl"
    many_empty_entries(small, 2)
    for args in (["show", str(path)], ["show", "--json", str(path)]):
        # once untraced, on a small file: the modules a first call imports are not the
        # listing's memory (run alone, this test would otherwise measure the imports)
        with open(os.devnull, "w") as out:
            monkeypatch.setattr("sys.stdout", out)
            assert cli.main([*args[:-1], str(small)]) == 0
            monkeypatch.undo()
        listing = tmp_path / "listing.txt"
        with open(listing, "w") as out:  # not captured in memory: the peak is fdl show's own
            monkeypatch.setattr("sys.stdout", out)
            rc, peak = peak_of(lambda: cli.main(args))
            monkeypatch.undo()
        assert rc == 0
        assert listing.read_text().count("e0") == n
        # ~60 kB here; listing the entries as before held ~3 MB
        assert peak < 256 * 1024, f"fdl {' '.join(args[:-1])} of {n} entries held {peak} bytes"


def test_read_fdl_entry_table_costs_a_bounded_amount_per_entry(tmp_path):
    n = 20_000
    path = tmp_path / "many.fdl"
    many_empty_entries(path, n)
    parsed, peak = peak_of(lambda: read_fdl(path, with_data=False))
    assert len(parsed.entries) == n
    assert peak / n < 200, f"{peak / n:.0f} bytes per entry"


# --- names on the terminal ----------------------------------------------------------


def test_fdl_show_escapes_control_characters_in_names(tmp_path, capsys):
    nasty = "w\x1b[2J\x1b[31mred\r\u202eevil\\x"
    path = tmp_path / "n.fdl"
    path.write_bytes(file_header(2) + f32_entry(nasty, [1]) + f32_entry("bias", [2]))
    assert cli.main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out
    assert r"w\x1b[2J\x1b[31mred\x0d\u202eevil\\x" in out
    assert cli.main(["show", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out
    import json

    assert json.loads(out)["tensors"][0]["name"] == nasty


class _NotATensor:
    pass


def test_a_torch_file_that_cannot_be_converted_is_one_line(tmp_path, capsys):
    """A probe's garbage .pt printed torch's page of advice (six lines: how to turn
    weights_only off, where to file an issue) after 'cannot load torch file'."""
    garbage = tmp_path / "g.pt"
    garbage.write_text("garbage\n")
    objects = tmp_path / "obj.pt"
    torch.save({"a": _NotATensor()}, objects)
    for src, says in ((garbage, "not a file torch.save wrote (it writes a zip archive)"),
                      (objects, "it holds objects other than tensors (Unsupported global: "
                                "GLOBAL test_checkpoint_hostile._NotATensor")):
        assert cli.main(["convert", str(src), str(tmp_path / "o.fdl")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"cannot load torch file {src}: {says}" in err, err
