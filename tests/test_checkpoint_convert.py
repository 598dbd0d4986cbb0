"""Interoperability: .fdl <-> torch state_dict <-> safetensors, and the ``fdl`` CLI."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from flodl_shm import CheckpointError, CheckpointForge, ModelSchema, load_consensus_checkpoint
from flodl_shm import tensors_to_round_frame
from flodl_shm.cli import fdl as cli
from flodl_shm.checkpoint.convert import (
    consensus_state_dict,
    convert,
    fdl_to_safetensors,
    fdl_to_state_dict,
    load_safetensors,
    read_safetensors_header,
    safetensors_to_fdl,
    save_safetensors,
    state_dict_to_consensus_fdl,
    state_dict_to_fdl,
)
from flodl_shm.checkpoint.fdl import read_fdl, save_tensors


def _model():
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        m[1].running_mean.uniform_()
        m[1].num_batches_tracked.fill_(5)
    return m


def _assert_same_tensors(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def safetensors_bytes(tensors: list, metadata=None) -> bytes:
    """A safetensors file assembled by hand from the format description."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, code, shape, raw in tensors:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + data


# --- safetensors ------------------------------------------------------------------


def test_safetensors_layout(tmp_path):
    path = tmp_path / "m.safetensors"
    save_safetensors({"b": torch.tensor([1, 2], dtype=torch.int16),
                      "a": torch.tensor([1.5, 2.5], dtype=torch.float32)},
                     path, {"format": "pt"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert raw[8:8 + n].rstrip(b" ") == raw[8:8 + n].rstrip()  # padded with spaces only
    assert header["__metadata__"] == {"format": "pt"}
    # Larger elements first (alignment), offsets contiguous from 0.
    assert header["a"] == {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    assert header["b"] == {"dtype": "I16", "shape": [2], "data_offsets": [8, 12]}
    assert raw[8 + n:] == np.float32([1.5, 2.5]).tobytes() + np.int16([1, 2]).tobytes()


def test_hand_built_safetensors_file_is_read(tmp_path):
    path = tmp_path / "h.safetensors"
    path.write_bytes(safetensors_bytes([
        ("w", "F32", [2, 2], np.float32([1, 2, 3, 4]).tobytes()),
        ("h", "BF16", [2], np.uint16([0x3FC0, 0xC000]).tobytes()),
        ("mask", "BOOL", [3], bytes([1, 0, 1])),
        ("ids", "I64", [], np.int64([-9]).tobytes()),
        ("empty", "F16", [0, 3], b""),
    ], metadata={"who": "hand"}))
    tensors, meta = load_safetensors(path)
    assert meta == {"who": "hand"}
    assert tensors["w"].tolist() == [[1, 2], [3, 4]]
    assert tensors["h"].dtype == torch.bfloat16 and tensors["h"].tolist() == [1.5, -2.0]
    assert tensors["mask"].tolist() == [True, False, True]
    assert tensors["ids"].item() == -9 and tensors["ids"].shape == ()
    assert tensors["empty"].shape == (0, 3)


@pytest.mark.parametrize("mutate, needle", [
    (lambda b: struct.pack("<Q", 200_000_000) + b[8:], "exceeds"),
    (lambda b: struct.pack("<Q", 10_000) + b[8:], "header claims 10000 bytes"),
    (lambda b: b[:8] + b"[" + b[9:], "does not start with"),
    (lambda b: b[:-2], "cover 16 bytes but the data region holds 14"),
    (lambda b: b + b"xx", "cover 16 bytes but the data region holds 18"),
    (lambda b: b[:3], "shorter than the 8-byte"),
])
def test_malformed_safetensors_fail_clearly(tmp_path, mutate, needle):
    good = safetensors_bytes([("w", "F32", [4], np.float32([1, 2, 3, 4]).tobytes())])
    path = tmp_path / "bad.safetensors"
    path.write_bytes(mutate(good))
    with pytest.raises(CheckpointError, match=needle):
        read_safetensors_header(path)


@pytest.mark.parametrize("tensors, needle", [
    ([("w", "F33", [1], b"\0" * 4)], "unknown safetensors dtype 'F33'"),
    ([("w", "F32", [2], b"\0" * 4)], "span 4 bytes but shape \\[2\\]"),
    ([("w", "F32", [-1], b"")], "non-negative"),
])
def test_inconsistent_safetensors_entries_fail_clearly(tmp_path, tensors, needle):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(safetensors_bytes(tensors))
    with pytest.raises(CheckpointError, match=needle):
        load_safetensors(path)


def test_safetensors_gap_between_tensors_is_rejected(tmp_path):
    head = json.dumps({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                       "b": {"dtype": "U8", "shape": [1], "data_offsets": [2, 3]}}).encode()
    head += b" " * (-len(head) % 8)
    path = tmp_path / "gap.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"abc")
    with pytest.raises(CheckpointError, match="starts at data offset 2, expected 1"):
        load_safetensors(path)


def test_safetensors_metadata_must_be_strings(tmp_path):
    with pytest.raises(CheckpointError, match="str to str"):
        save_safetensors({"w": torch.ones(1)}, tmp_path / "m.safetensors", {"epoch": 3})


# --- round trips ------------------------------------------------------------------


def test_state_dict_fdl_round_trip(tmp_path):
    sd = _model().state_dict()
    for name in ("m.fdl", "m.fdl.gz"):
        state_dict_to_fdl(sd, tmp_path / name)
        back = fdl_to_state_dict(tmp_path / name)
        assert list(back) == list(sd)
        _assert_same_tensors(sd, back)
        fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        fresh.load_state_dict(back)  # strict: every key, right shapes


def test_fdl_safetensors_round_trip_is_byte_identical(tmp_path):
    # One element size throughout, so the safetensors layout keeps the entry order.
    named = [("0.weight", torch.randn(4, 3)), ("0.bias", torch.randn(4)), ("x", torch.randn(2, 2, 2))]
    save_tensors(tmp_path / "a.fdl", named, structural_hash="ab" * 32)
    fdl_to_safetensors(tmp_path / "a.fdl", tmp_path / "a.safetensors")
    _, meta, _ = read_safetensors_header(tmp_path / "a.safetensors")
    assert meta == {"format": "pt", "fdl_structural_hash": "ab" * 32}
    safetensors_to_fdl(tmp_path / "a.safetensors", tmp_path / "b.fdl")
    assert (tmp_path / "b.fdl").read_bytes() == (tmp_path / "a.fdl").read_bytes()


def test_mixed_dtypes_round_trip_through_every_format(tmp_path):
    sd = _model().state_dict()
    sd["half"] = torch.randn(3).half()
    sd["brain"] = torch.randn(2, 2).bfloat16()
    sd["double"] = torch.randn(2).double()
    sd["ints"] = torch.arange(4, dtype=torch.int32)
    state_dict_to_fdl(sd, tmp_path / "a.fdl")
    assert convert(tmp_path / "a.fdl", tmp_path / "b.safetensors") == len(sd)
    assert convert(tmp_path / "b.safetensors", tmp_path / "c.pt") == len(sd)
    assert convert(tmp_path / "c.pt", tmp_path / "d.fdl.gz") == len(sd)
    _assert_same_tensors(sd, fdl_to_state_dict(tmp_path / "d.fdl.gz"))
    _assert_same_tensors(sd, torch.load(tmp_path / "c.pt", weights_only=True))


def test_dtypes_fdl_cannot_hold_are_named(tmp_path):
    save_safetensors({"mask": torch.ones(2, dtype=torch.bool)}, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match="'mask' has dtype torch.bool"):
        safetensors_to_fdl(tmp_path / "m.safetensors", tmp_path / "m.fdl")
    assert not (tmp_path / "m.fdl").exists()


def test_consensus_keys_translate_to_qualified_names(tmp_path):
    model = _model()
    forge = CheckpointForge(ModelSchema.from_module(model))
    path = tmp_path / "c.fdl"
    forge.arm(path)
    forge.accumulate(tensors_to_round_frame([p.detach() for p in model.parameters()]))
    forge.accumulate(tensors_to_round_frame([b for _, b in model.named_buffers() if b.is_floating_point()]))
    assert forge.flush(30)

    named = consensus_state_dict(path, model)
    assert list(named) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias",
                           "1.running_mean", "1.running_var"]
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    result = fresh.load_state_dict(named, strict=False)
    # Only the integer buffer is absent (torch's BatchNorm may not even report it).
    assert set(result.missing_keys) <= {"1.num_batches_tracked"} and result.unexpected_keys == []
    for k, v in named.items():
        assert torch.equal(fresh.state_dict()[k], v)

    # ...and back: a torch state_dict seeds a consensus checkpoint.
    state_dict_to_consensus_fdl(model.state_dict(), ModelSchema.from_module(model), tmp_path / "s.fdl")
    assert (tmp_path / "s.fdl").read_bytes() == path.read_bytes()
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    load_consensus_checkpoint(other, tmp_path / "s.fdl")
    assert torch.equal(other[2].weight, model[2].weight)

    with pytest.raises(CheckpointError, match="does not match the schema"):
        consensus_state_dict(path, torch.nn.Linear(3, 4))


# --- the CLI ----------------------------------------------------------------------


def test_cli_show_lists_entries_shapes_dtypes_bytes_and_hash(tmp_path, capsys):
    path = tmp_path / "m.fdl"
    save_tensors(path, [("enc.weight", torch.ones(4, 3)), ("step", torch.tensor(7))],
                 structural_hash="0f" * 32)
    assert cli.main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert ".fdl version 2, 2 entries, 56 B of tensor data" in out
    assert "structural hash: " + "0f" * 32 in out
    lines = [ln.split() for ln in out.splitlines()]
    assert ["0", "enc.weight", "f32", "[4,", "3]", "48"] in lines
    assert ["1", "step", "i64", "[]", "8"] in lines

    assert cli.main(["show", "--json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == 2 and doc["structural_hash"] == "0f" * 32
    assert doc["tensors"][0] == {"name": "enc.weight", "dtype": "f32", "dtype_tag": 3,
                                 "shape": [4, 3], "bytes": 48}


def test_cli_reports_corrupt_files_with_status_1(tmp_path, capsys):
    path = tmp_path / "bad.fdl"
    path.write_bytes(b"FDLC" + struct.pack("<I", 9) + bytes(36))
    assert cli.main(["show", str(path)]) == 1
    assert "unsupported checkpoint version 9" in capsys.readouterr().err
    assert cli.main(["show", str(tmp_path / "missing.fdl")]) == 1
    assert capsys.readouterr().err.startswith("python -m flodl_shm fdl show: error: cannot open ")
    good = tmp_path / "good.fdl"
    save_tensors(good, [("w", torch.ones(2))])
    # the destination the user named, not the writer's temp file next to it; a folder
    # that does not exist is a usage error (2) that says so, before anything is read
    dst = tmp_path / "no" / "dir" / "m.pt"
    assert cli.main(["convert", str(good), str(dst)]) == 2
    assert capsys.readouterr().err == (f"python -m flodl_shm fdl convert: error: {dst}: the "
                                       f"folder {dst.parent} does not exist; create it first, "
                                       f"or write elsewhere\n")
    # a name that does not tell the format is a usage error (2), said with the CLI's flags
    assert cli.main(["convert", str(good), str(tmp_path / "m.npz")]) == 2
    err = capsys.readouterr().err
    assert "or pass --to fdl|safetensors|torch" in err and "convert(" not in err, err
    assert cli.main(["frobnicate"]) == 2


def test_cli_entry_point_converts_and_shows(tmp_path):
    sd = _model().state_dict()
    torch.save(sd, tmp_path / "m.pt")
    run = lambda *args: subprocess.run([sys.executable, "-m", "flodl_shm", "fdl", *args],
                                       capture_output=True, text=True, timeout=120)
    conv = run("convert", str(tmp_path / "m.pt"), str(tmp_path / "m.fdl"))
    assert conv.returncode == 0, conv.stderr
    assert f"{len(sd)} tensors" in conv.stdout
    show = run("show", str(tmp_path / "m.fdl"))
    assert show.returncode == 0, show.stderr
    assert "1.num_batches_tracked" in show.stdout and "i64" in show.stdout
    _assert_same_tensors(sd, fdl_to_state_dict(tmp_path / "m.fdl"))
    assert read_fdl(tmp_path / "m.fdl").hash_hex is None


def test_a_state_dict_of_another_shape_is_refused_when_the_model_is_given(tmp_path):
    """state_dict_to_consensus_fdl(sd, model, path) wrote a file whose tensors did not fit
    the model it was given; nothing is written now."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    wrong = {k: torch.ones(1) if k == "0.weight" else v for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"state_dict entry '0.weight' has shape \[1\]; "
                                              r"the model's is \[2, 3\]"):
        state_dict_to_consensus_fdl(wrong, model, tmp_path / "s.fdl")
    assert list(tmp_path.iterdir()) == []
    assert state_dict_to_consensus_fdl(model.state_dict(), model, tmp_path / "s.fdl") > 0
