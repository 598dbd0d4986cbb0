"""The .fdl format: flodl's exact byte layout, round trips, load semantics, corrupt files.

Layout per ``notes/flodl-spec.md`` §7.1 and flodl 0.7.0 ``nn/checkpoint.rs``.
"""
from __future__ import annotations

import gzip
import os
import re
import struct
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_shm import CheckpointError, LoadReport
from flodl_shm.checkpoint.fdl import (
    FDL_VERSION,
    FdlDtype,
    RawEntry,
    load_checkpoint_file,
    load_module,
    read_fdl,
    save_module,
    save_tensors,
    write_fdl_raw,
    write_fdl_stream,
)


def fdl_bytes(entries, version=2, hash_=bytes(32), count=None):
    """Hand-assembled .fdl bytes, straight from the spec table (independent of the writer)."""
    out = b"FDLC" + struct.pack("<I", version) + hash_
    out += struct.pack("<I", len(entries) if count is None else count)
    for name, shape, tag, raw in entries:
        nb = name.encode()
        out += struct.pack("<I", len(nb)) + nb + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<q", d) for d in shape)
        out += bytes([tag]) + struct.pack("<Q", len(raw)) + raw
    return out


F32_1234 = np.array([1.0, 2.0, 3.0, 4.0], np.float32).tobytes()


# --- the byte layout -----------------------------------------------------------


def test_writer_emits_flodls_exact_bytes(tmp_path):
    path = tmp_path / "m.fdl"
    write_fdl_raw(path, [
        RawEntry("w", (2, 2), FdlDtype.F32, F32_1234),
        RawEntry("n", (), FdlDtype.I64, struct.pack("<q", 7)),
    ])
    expected = (
        b"FDLC" + b"\x02\x00\x00\x00" + bytes(32) + b"\x02\x00\x00\x00"
        + b"\x01\x00\x00\x00" + b"w" + b"\x02\x00\x00\x00"
        + b"\x02\x00\x00\x00\x00\x00\x00\x00" * 2 + b"\x03" + b"\x10" + bytes(7) + F32_1234
        + b"\x01\x00\x00\x00" + b"n" + b"\x00\x00\x00\x00" + b"\x06" + b"\x08" + bytes(7)
        + b"\x07" + bytes(7)
    )
    assert path.read_bytes() == expected
    assert path.read_bytes() == fdl_bytes([("w", (2, 2), 3, F32_1234),
                                           ("n", (), 6, struct.pack("<q", 7))])


def test_reader_parses_hand_built_file_of_every_dtype(tmp_path):
    raws = {
        FdlDtype.F16: np.array([1.5, -2], np.float16).tobytes(),
        FdlDtype.BF16: np.array([0x3FC0, 0xC000], np.uint16).tobytes(),  # 1.5, -2.0
        FdlDtype.F32: np.array([1.5, -2], np.float32).tobytes(),
        FdlDtype.F64: np.array([1.5, -2], np.float64).tobytes(),
        FdlDtype.I32: np.array([3, -4], np.int32).tobytes(),
        FdlDtype.I64: np.array([3, -4], np.int64).tobytes(),
    }
    path = tmp_path / "all.fdl"
    path.write_bytes(fdl_bytes([(f"t{int(tag)}", (2,), int(tag), raw) for tag, raw in raws.items()]))
    parsed = read_fdl(path)
    assert parsed.version == 2 and parsed.hash_hex is None
    got = {e.name: e.to_tensor() for e in parsed.entries}
    assert got["t1"].dtype == torch.float16 and got["t1"].tolist() == [1.5, -2.0]
    assert got["t2"].dtype == torch.bfloat16 and got["t2"].tolist() == [1.5, -2.0]
    assert got["t3"].dtype == torch.float32 and got["t3"].tolist() == [1.5, -2.0]
    assert got["t4"].dtype == torch.float64 and got["t4"].tolist() == [1.5, -2.0]
    assert got["t5"].dtype == torch.int32 and got["t5"].tolist() == [3, -4]
    assert got["t6"].dtype == torch.int64 and got["t6"].tolist() == [3, -4]


def test_version_1_files_are_read(tmp_path):
    path = tmp_path / "v1.fdl"
    path.write_bytes(fdl_bytes([("w", (4,), 3, F32_1234)], version=1))
    parsed = read_fdl(path)
    assert parsed.version == 1
    assert parsed.entries[0].to_tensor().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert FDL_VERSION == 2


def test_gzip_when_the_path_ends_in_gz(tmp_path):
    plain, packed = tmp_path / "m.fdl", tmp_path / "m.fdl.gz"
    entries = [RawEntry("w", (4,), FdlDtype.F32, F32_1234)]
    write_fdl_raw(plain, entries)
    write_fdl_raw(packed, entries)
    # The whole stream is one gzip member of exactly the plain bytes.
    assert packed.read_bytes()[:2] == b"\x1f\x8b"
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert read_fdl(packed).entries[0].to_tensor().tolist() == [1.0, 2.0, 3.0, 4.0]


def test_gzip_stream_written_elsewhere_is_read(tmp_path):
    # A .fdl.gz from another gzip implementation (level 9, with a name and mtime).
    path = tmp_path / "other.fdl.gz"
    path.write_bytes(gzip.compress(fdl_bytes([("w", (4,), 3, F32_1234)]), compresslevel=9))
    assert read_fdl(path).entries[0].to_tensor().tolist() == [1.0, 2.0, 3.0, 4.0]


def test_structural_hash_round_trips(tmp_path):
    h = bytes(range(32))
    path = tmp_path / "h.fdl"
    write_fdl_raw(path, [RawEntry("w", (4,), FdlDtype.F32, F32_1234)], structural_hash=h.hex())
    assert path.read_bytes()[8:40] == h
    assert read_fdl(path).hash_hex == h.hex()


def test_writes_leave_no_temp_file(tmp_path):
    path = tmp_path / "m.fdl"
    for i in range(3):
        write_fdl_raw(path, [RawEntry("w", (1,), FdlDtype.F32, np.float32([i]))])
    assert os.listdir(tmp_path) == ["m.fdl"]
    assert read_fdl(path).entries[0].to_tensor().tolist() == [2.0]


def test_stale_temp_file_is_ignored_then_replaced(tmp_path):
    path = tmp_path / "m.fdl"
    write_fdl_raw(path, [RawEntry("w", (1,), FdlDtype.F32, np.float32([1]))])
    (tmp_path / "m.fdl.tmp").write_bytes(b"FDLC torn garbage from a killed writer")
    assert read_fdl(path).entries[0].to_tensor().tolist() == [1.0]
    write_fdl_raw(path, [RawEntry("w", (1,), FdlDtype.F32, np.float32([2]))])
    assert os.listdir(tmp_path) == ["m.fdl"]
    assert read_fdl(path).entries[0].to_tensor().tolist() == [2.0]


def test_failed_write_keeps_previous_file_and_removes_temp(tmp_path):
    path = tmp_path / "m.fdl"
    write_fdl_raw(path, [RawEntry("w", (1,), FdlDtype.F32, np.float32([1]))])
    before = path.read_bytes()

    class Boom(Exception):
        pass

    def body(w):
        w.write_entry("a", (1 << 20,), FdlDtype.F32, np.zeros(1 << 20, np.float32))
        raise Boom  # the writer dies half way through the file

    with pytest.raises(Boom):
        write_fdl_stream(path, 2, body)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.fdl"]


def test_raw_write_does_not_copy_payloads(tmp_path):
    # Writing from payload bytes streams them: no tensor, no second copy in memory.
    data = np.arange(8 << 20, dtype=np.float32)  # 32 MiB
    tracemalloc.start()
    try:
        write_fdl_raw(tmp_path / "big.fdl", [RawEntry("w", data.shape, FdlDtype.F32, data)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"writing 32 MiB allocated {peak} bytes"
    assert (tmp_path / "big.fdl").stat().st_size == 44 + 4 + 1 + 4 + 8 + 1 + 8 + data.nbytes


# --- invalid input to the writer ------------------------------------------------


def test_writer_rejects_inconsistent_entries(tmp_path):
    with pytest.raises(CheckpointError, match="needs 16 bytes"):
        RawEntry("w", (4,), FdlDtype.F32, b"\0" * 12)
    with pytest.raises(CheckpointError, match="unknown dtype tag: 9"):
        RawEntry("w", (1,), 9, b"\0")
    with pytest.raises(CheckpointError, match="at most 64"):
        RawEntry("w", (1,) * 65, FdlDtype.F32, b"\0" * 4)
    with pytest.raises(CheckpointError, match="65537 bytes exceeds"):
        RawEntry("x" * 65537, (1,), FdlDtype.F32, b"\0" * 4)
    with pytest.raises(CheckpointError, match="cannot store"):
        save_tensors(tmp_path / "b.fdl", [("mask", torch.ones(2, dtype=torch.bool))])
    with pytest.raises(CheckpointError, match=r"torch.view_as_real\(t\)\); .float\(\) would "
                                              r"drop the imaginary part"):
        save_tensors(tmp_path / "c.fdl", [("freq", torch.ones(2, dtype=torch.complex64))])
    assert not list(tmp_path.iterdir())


# --- corrupt files --------------------------------------------------------------


@pytest.mark.parametrize("blob, needle", [
    (b"NOPE" + bytes(40), "bad magic"),
    # a probe's `fdl show` of a .meta.json read only "bad magic b'{\\n  '"
    (b'{\n  "schema_version": 4' + bytes(20), r"bad magic .*; it looks like a JSON file \(a "
                                              r"bundle's .meta.json or .names.json\?\): pass "
                                              r"the bundle's .fdl"),
    (fdl_bytes([], version=3), "unsupported checkpoint version 3"),
    (fdl_bytes([], version=0), "unsupported checkpoint version 0"),
    (fdl_bytes([]) [:-2], "entry count"),
    (fdl_bytes([], count=1) + struct.pack("<I", 70000) + bytes(16),
     "entry name length 70000 exceeds 65536"),
    (fdl_bytes([], count=1) + struct.pack("<I", 1) + b"w" + struct.pack("<I", 65) + bytes(8),
     "tensor rank 65 exceeds 64"),
    (fdl_bytes([("w", (1,), 7, b"\0\0\0\0")]), "unknown dtype tag: 7"),
    (fdl_bytes([("w", (4,), 3, F32_1234)])[:-5], "payload truncated: header claims 16 bytes, 11 present"),
    (fdl_bytes([("w", (4,), 3, F32_1234[:8])]), "claims 8 bytes but shape \\[4\\]"),
    (fdl_bytes([("w", (-1,), 3, b"")]), "negative dim"),
])
def test_corrupt_files_fail_with_clear_errors(tmp_path, blob, needle):
    path = tmp_path / "bad.fdl"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=needle):
        read_fdl(path)
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint_file(path, [("w", torch.zeros(4))])


def test_huge_claimed_payload_fails_without_allocating(tmp_path):
    # A header claiming ~2^60 bytes must fail on the bytes present, not on malloc.
    blob = fdl_bytes([], count=1) + struct.pack("<I", 1) + b"w" + struct.pack("<I", 1)
    blob += struct.pack("<q", 1 << 58) + b"\x03" + struct.pack("<Q", 1 << 60) + b"\0" * 16
    for name in ("huge.fdl", "huge.fdl.gz"):
        path = tmp_path / name
        path.write_bytes(gzip.compress(blob) if name.endswith(".gz") else blob)
        with pytest.raises(CheckpointError, match=f"header claims {1 << 60} bytes, 16 present"):
            read_fdl(path)


def test_every_truncation_is_a_checkpoint_error_naming_the_file(tmp_path):
    blob = fdl_bytes([("weight", (2, 2), 3, F32_1234), ("n", (), 6, bytes(8))])
    path = tmp_path / "t.fdl"
    for cut in range(len(blob)):
        path.write_bytes(blob[:cut])
        with pytest.raises(CheckpointError, match=re.escape(str(path))):
            read_fdl(path)
    gz = tmp_path / "t.fdl.gz"
    packed = gzip.compress(blob)
    for cut in range(len(packed)):
        gz.write_bytes(packed[:cut])
        with pytest.raises(CheckpointError, match=re.escape(str(gz))):
            read_fdl(gz)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_byte_flips_never_escape_as_other_errors(tmp_path, data):
    blob = bytearray(fdl_bytes([("weight", (2, 2), 3, F32_1234), ("n", (), 6, bytes(8))]))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    path = tmp_path / "flip.fdl"
    path.write_bytes(bytes(blob))
    try:
        read_fdl(path)
    except CheckpointError:
        pass


# --- round trips ---------------------------------------------------------------

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(st.tuples(st.text(min_size=0, max_size=12),
                                st.lists(st.integers(0, 4), max_size=4),
                                st.sampled_from(_DTYPES)), max_size=6),
       gz=st.booleans())
def test_any_tensors_round_trip(tmp_path, specs, gz):
    gen = torch.Generator().manual_seed(len(specs))
    named = []
    for name, shape, dt in specs:
        t = torch.randn(shape, generator=gen) * 100
        named.append((name, t.to(dt)))
    path = tmp_path / ("r.fdl.gz" if gz else "r.fdl")
    save_tensors(path, named)
    parsed = read_fdl(path)
    assert [e.name for e in parsed.entries] == [n for n, _ in named]
    for e, (_, t) in zip(parsed.entries, named):
        back = e.to_tensor()
        assert back.dtype == t.dtype and tuple(back.shape) == tuple(t.shape)
        assert torch.equal(back, t)
    shallow = read_fdl(path, with_data=False)
    assert [(e.name, e.shape, e.nbytes) for e in shallow.entries] == [
        (e.name, e.shape, e.nbytes) for e in parsed.entries]


# --- loading into a module ------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def test_save_and_load_module_by_name(tmp_path):
    src, dst = _model(), _model()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
        src[1].running_mean.fill_(0.5)
        src[1].num_batches_tracked.fill_(7)
    for gz in (False, True):
        path = tmp_path / ("m.fdl.gz" if gz else "m.fdl")
        save_module(src, path)
        report = load_module(dst, path)
        assert isinstance(report, LoadReport)
        assert report.missing == [] and report.unexpected == [] and report.complete
        assert report.loaded == [n for n, _ in dst.named_parameters()] + [
            n for n, _ in dst.named_buffers()]
        for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
            assert torch.equal(a, b), n


def test_load_copies_in_place_and_keeps_parameter_identity(tmp_path):
    model = torch.nn.Linear(2, 2)
    ids = [id(p) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "m.fdl"
    save_tensors(path, [("weight", torch.full((2, 2), 3.0)), ("bias", torch.full((2,), 4.0))])
    load_module(model, path)
    assert [id(p) for p in model.parameters()] == ids
    assert opt.param_groups[0]["params"][0] is model.weight
    assert model.weight.requires_grad
    assert model.weight.tolist() == [[3.0, 3.0], [3.0, 3.0]] and model.bias.tolist() == [4.0, 4.0]


def test_load_report_lists_missing_and_unexpected(tmp_path):
    path = tmp_path / "m.fdl"
    save_tensors(path, [("weight", torch.ones(2, 3)), ("extra", torch.ones(1)), ("more", torch.ones(1))])
    model = torch.nn.Linear(3, 2)
    bias_before = model.bias.detach().clone()
    report = load_module(model, path)
    assert report.loaded == ["weight"]
    assert report.missing == ["bias"]
    assert report.unexpected == ["extra", "more"] == report.skipped
    assert not report.complete
    assert torch.equal(model.weight, torch.ones(2, 3))
    assert torch.equal(model.bias, bias_before)  # missing entries keep their values


def test_shape_mismatch_is_a_hard_error_and_touches_nothing(tmp_path):
    path = tmp_path / "m.fdl"
    save_tensors(path, [("bias", torch.ones(2)), ("weight", torch.ones(5, 3))])
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r'parameter .weight.: shape mismatch: '
                                              r'checkpoint=\[5, 3\] model=\[2, 3\]'):
        load_module(model, path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} modified by a failed load"


def test_load_casts_to_the_model_dtype(tmp_path):
    path = tmp_path / "m.fdl"
    save_tensors(path, [("weight", torch.tensor([[1.5, 2.5]], dtype=torch.bfloat16)),
                        ("bias", torch.tensor([0.25], dtype=torch.float64))])
    model = torch.nn.Linear(2, 1)
    load_module(model, path)
    assert model.weight.dtype == torch.float32
    assert model.weight.tolist() == [[1.5, 2.5]] and model.bias.tolist() == [0.25]


def test_duplicate_names_later_entry_wins(tmp_path):
    path = tmp_path / "dup.fdl"
    path.write_bytes(fdl_bytes([
        ("w", (4,), 3, np.zeros(4, np.float32).tobytes()),
        ("w", (4,), 3, F32_1234),
    ]))
    target = torch.zeros(4)
    report = load_checkpoint_file(path, [("w", target)])
    assert report.loaded == ["w"] and report.unexpected == []
    assert target.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_structural_hash_is_checked_only_when_both_are_nonzero(tmp_path):
    a, b = "11" * 32, "22" * 32
    path = tmp_path / "h.fdl"
    save_tensors(path, [("w", torch.ones(1))], structural_hash=a)
    load_checkpoint_file(path, [("w", torch.zeros(1))], structural_hash=a)
    load_checkpoint_file(path, [("w", torch.zeros(1))], structural_hash=None)
    load_checkpoint_file(path, [("w", torch.zeros(1))], structural_hash="00" * 32)
    with pytest.raises(CheckpointError, match=f"architecture mismatch: file={a} model={b}"):
        load_checkpoint_file(path, [("w", torch.zeros(1))], structural_hash=b)
    unhashed = tmp_path / "u.fdl"
    save_tensors(unhashed, [("w", torch.ones(1))])
    load_checkpoint_file(unhashed, [("w", torch.zeros(1))], structural_hash=b)


def test_buffer_shape_mismatch_names_the_buffer(tmp_path):
    path = tmp_path / "m.fdl"
    save_tensors(path, [("rm", torch.ones(3))])
    with pytest.raises(CheckpointError, match=r'buffer .rm.: shape mismatch'):
        load_checkpoint_file(path, [], [("rm", torch.zeros(4))])
