"""The host-RAM tool, through its JSON on faked hosts: a container limit below host
RAM, a 64 MiB /dev/shm, leaked segments of a dead owner; plus size parsing, the
table, exit statuses and the launcher."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_shm.engine.arena import shm_need_bytes
from flodl_shm.cli.ram import main, parse_count, parse_model_size, parse_size
from flodl_shm.engine.staging import gate_need_bytes
from test_hostmem import fake_host as fake_root
from test_hostmem import v2

MB = 1 << 20
GB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
CHECK_KEYS = {"name", "ok", "need_bytes", "have_bytes", "detail"}


def dead_pid() -> int:
    """A pid no process can have: above the kernel's pid_max."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def fake_host(root: Path, *, total=24 * GB, avail=22 * GB, limit=None, usage=0) -> Path:
    """A host of ``total``/``avail`` RAM (2 GiB swap, 1 GiB free) in a cgroup v2 of
    ``limit`` (None: unlimited) with ``usage`` charged; an empty dev/shm folder."""
    fake_root(root, total=total, avail=avail, swap=(2 * GB, 1 * GB))
    v2(root, max="max" if limit is None else limit, current=usage)
    return root


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["--json", *map(str, argv)])
    out = capsys.readouterr().out
    report = json.loads(out)
    assert isinstance(report["ok"], bool)
    for c in report["checks"]:
        assert CHECK_KEYS <= set(c), c
    return code, report


def check(report: dict, name: str) -> dict:
    (c,) = [c for c in report["checks"] if c["name"] == name]
    return c


# -- faked hosts --------------------------------------------------------------------


def test_container_limit_below_host_ram_fails_the_ram_check(tmp_path, capsys):
    """A 2 GiB container on a 24 GiB host with an 8 GiB /dev/shm (e.g. --ipc=host):
    /dev/shm has room, but its pages are RAM the container does not have."""
    root = fake_host(tmp_path, total=24 * GB, avail=22 * GB, limit=2 * GB, usage=512 * MB)
    code, rep = run_json(capsys, "--root", root, "--shm-size", "8GiB",
                         "--params", "190M", "--local-ranks", "2")
    assert code == 1 and rep["ok"] is False
    staging = 190_000_000 * 4
    arena = shm_need_bytes(2, staging)  # (LocalSGD's p<r> blocks stand in for its regions)
    assert rep["needs"] == {"staging_bytes_per_rank": staging, "frame_bytes": staging,
                            "arena_shm_bytes": arena, "ram_bytes": arena + 2 * staging,
                            "gate_need_bytes": staging * 2 * 6}
    host = rep["host"]
    assert (host["host_total"], host["host_available"]) == (24 * GB, 22 * GB)
    assert (host["total"], host["available"]) == (2 * GB, 2 * GB - 512 * MB)
    assert (host["cgroup_version"], host["cgroup_limit"]) == (2, 2 * GB)
    assert (host["swap_total"], host["swap_free"]) == (2 * GB, 1 * GB)
    assert (host["shm_total"], host["shm_free"]) == (8 * GB, 8 * GB)

    shm = check(rep, "dev_shm_space")
    assert shm["ok"] and shm["required"] and (shm["need_bytes"], shm["have_bytes"]) == (arena, 8 * GB)
    ram = check(rep, "ram")
    assert not ram["ok"] and ram["required"]
    assert (ram["need_bytes"], ram["have_bytes"]) == (arena + 2 * staging, 2 * GB - 512 * MB)
    assert "cgroup v2 headroom" in ram["detail"] and "docker run -m" in ram["detail"]
    gate = check(rep, "pinned_decode_staging")
    assert not gate["ok"] and not gate["required"]
    assert (gate["need_bytes"], gate["have_bytes"]) == (staging * 12, 2 * GB - 512 * MB)

    # the same model on the bare 24 GiB host fits, staging included; --nprocs (the
    # demo's name for the ranks on this host) says the same as --local-ranks
    for ranks in ("--local-ranks", "--nprocs"):
        code, rep = run_json(capsys, "--root", fake_host(tmp_path / ranks), "--shm-size",
                             "8GiB", "--params", "190M", ranks, "2")
        assert code == 0 and rep["ok"] and check(rep, "pinned_decode_staging")["ok"]
        assert rep["needs"]["gate_need_bytes"] == staging * 2 * 6


@pytest.mark.parametrize("size_flag", ["--model-bytes", "--model-size"])
def test_docker_default_64mib_dev_shm(tmp_path, capsys, size_flag):
    root = fake_host(tmp_path)
    code, rep = run_json(capsys, "--root", root, "--shm-size", "64MiB",
                         size_flag, "100MiB", "--local-ranks", "2", "--wire", "bf16")
    assert code == 1 and not rep["ok"]
    frame = 50 * MB  # bf16 halves the frames; staging stays f32
    assert rep["needs"]["frame_bytes"] == frame
    assert rep["needs"]["staging_bytes_per_rank"] == 100 * MB
    c = check(rep, "dev_shm_space")
    assert not c["ok"]
    # (+ the start broadcast's f32 frame in its root's region)
    assert (c["need_bytes"], c["have_bytes"]) == (shm_need_bytes(2, frame, wire_bf16=True)
                                                  + frame, 64 * MB)
    assert "--shm-size=1g" in c["detail"] and "64 MB" in c["detail"]
    assert [x["name"] for x in rep["checks"] if not x["ok"]] == ["dev_shm_space"]

    code, rep = run_json(capsys, "--root", root, "--shm-size", "64MiB", "--params", "1M",
                         "--local-ranks", "2")
    assert code == 0 and rep["ok"]
    assert check(rep, "dev_shm_space")["need_bytes"] == shm_need_bytes(2, 4_000_000)


def test_leaked_segments_of_a_dead_owner_are_listed_and_reaped(tmp_path, capsys):
    root = fake_host(tmp_path)
    shm = root / "dev/shm"
    dead, me = dead_pid(), os.getpid()
    for what in ("ctl", "d0", "d1"):
        (shm / f"fshm_{dead}_0badc0de_{what}").write_bytes(b"\1" * (12 * MB))
    (shm / f"fshm_{me}_00c0ffee_ctl").write_bytes(b"\1" * MB)
    (shm / "not_ours").write_bytes(b"\1" * MB)
    held = sum((shm / f"fshm_{dead}_0badc0de_{w}").stat().st_blocks * 512
               for w in ("ctl", "d0", "d1"))
    assert held >= 36 * MB

    # 64 MiB /dev/shm, ~38 MiB held by the dead owner: a 10 MiB-frame arena no longer fits
    argv = ["--root", root, "--shm-size", "64MiB", "--model-bytes", "10MiB", "--local-ranks", "2"]
    code, rep = run_json(capsys, *argv)
    assert code == 1
    segs = {s["name"]: s for s in rep["segments"]}
    assert set(segs) == {f"fshm_{dead}_0badc0de_{w}" for w in ("ctl", "d0", "d1")} | {
        f"fshm_{me}_00c0ffee_ctl"}
    assert [s["owner_alive"] for s in rep["segments"] if s["owner_pid"] == dead] == [False] * 3
    assert segs[f"fshm_{me}_00c0ffee_ctl"]["owner_alive"] is True
    stale = check(rep, "dead_owner_segments")
    assert not stale["ok"] and not stale["required"] and stale["have_bytes"] == held
    assert str(dead) in stale["detail"] and "--reap" in stale["detail"]
    space = check(rep, "dev_shm_space")
    assert not space["ok"] and "run with --reap" in space["detail"]
    assert rep["reaped"] == []

    code, rep = run_json(capsys, *argv, "--reap")
    assert code == 0 and rep["ok"]
    assert sorted(s["name"] for s in rep["reaped"]) == sorted(
        f"fshm_{dead}_0badc0de_{w}" for w in ("ctl", "d0", "d1"))
    assert sorted(p.name for p in shm.iterdir()) == [f"fshm_{me}_00c0ffee_ctl", "not_ours"]
    assert [s["owner_pid"] for s in rep["segments"]] == [me]
    assert check(rep, "dead_owner_segments")["ok"]
    assert check(rep, "dev_shm_space")["have_bytes"] == rep["host"]["shm_free"] >= 62 * MB - 4096


def test_the_table_tells_the_same_story(tmp_path, capsys):
    root = fake_host(tmp_path, limit=2 * GB, usage=512 * MB)
    (root / f"dev/shm/fshm_{dead_pid()}_0badc0de_ctl").write_bytes(b"\1" * MB)
    code = main(["--root", str(root), "--shm-size", "64MiB", "--params", "190M",
                 "--local-ranks", "2"])
    out = capsys.readouterr().out
    assert code == 1
    for text in ("local ranks  2", "RAM total       2.0 GiB", "bounded by the cgroup",
                 "v2, limit 2.0 GiB", "64.0 MiB total", "DEAD", "[FAIL] dev_shm_space",
                 "[FAIL] ram", "[off ] pinned_decode_staging (advisory)",
                 "[warn] dead_owner_segments (advisory)", "decode staging per rank    724.8 MiB",
                 "verdict: does NOT fit (dev_shm_space, ram failed; exit 1)"):
        assert text in out, text



def test_without_a_model_size_the_verdict_says_it_judged_an_empty_model(tmp_path, capsys):
    """It said "fits", as if the host had been checked for a model."""
    root = fake_host(tmp_path, limit=2 * GB, usage=512 * MB)
    code = main(["--root", str(root), "--shm-size", "64MiB"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.rstrip().splitlines()[-1] == (
        "verdict: no model given, so the checks above are for an empty model (exit 0); pass "
        "--model-bytes SIZE or --params COUNT for a verdict on yours")

# -- inputs -------------------------------------------------------------------------


@pytest.mark.parametrize("text, n", [
    ("727MiB", 727 * MB), ("727 MiB", 727 * MB), ("1GiB", GB), ("2KiB", 2048), ("1TiB", 1 << 40),
    ("7.3GB", 7_300_000_000), ("760MB", 760_000_000), ("4kb", 4000), ("1048576", MB),
    ("0.5GiB", GB // 2), ("12B", 12), ("1_000", 1000), ("4e9", 4 * 10 ** 9), ("1e3KiB", 1024000),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text, word", [
    ("727M", "ambiguous: write MiB"), ("1.5G", "ambiguous"), ("3 parsecs", "unknown suffix"),
    ("MiB", "not a number"), ("0.3B", "whole number"), ("-5MiB", "is negative"),
    ("99999999999999999999TiB", r"is 1\.10e\+32, over the limit of 4\.61e\+18 \(2\^62\)"),
])
def test_parse_size_errors_name_the_text_and_the_suffixes(text, word):
    with pytest.raises(ValueError, match=word) as e:
        parse_size(text)
    assert repr(text) in str(e.value)


@pytest.mark.parametrize("text, n", [("190M", 190_000_000), ("1.3B", 1_300_000_000),
                                     ("250k", 250_000), ("12000", 12000),
                                     ("1e9", 10 ** 9), ("2.5E6", 2_500_000)])  # (were suffixes)
def test_parse_count(text, n):
    assert parse_count(text) == n


def test_parse_count_errors():
    with pytest.raises(ValueError, match="use K .thousand., M .million., B .billion."):
        parse_count("190MiB")
    with pytest.raises(ValueError, match="count '1.5' is not a whole number"):
        parse_count("1.5")
    with pytest.raises(ValueError, match="count '-5' is negative; give a positive number"):
        parse_count("-5")
    with pytest.raises(ValueError, match="count '9e9x' has an unknown suffix 'x'"):
        parse_count("9e9x")
    with pytest.raises(ValueError, match="count '0' is zero: give the model's parameter count"):
        parse_count("0")  # (it was taken: a model of no parameters "fits")
    with pytest.raises(ValueError, match=r"count '1e1000000' is 1e\+1000000, over the limit"):
        parse_count("1e1000000")  # (decimal.Overflow, a traceback, in a probe)
    with pytest.raises(ValueError, match=r"count '1e999999999999999999K' is Infinity, over"):
        parse_count("1e999999999999999999K")
    with pytest.raises(ValueError, match=r"count '1e-2000000' is not a whole number"):
        parse_count("1e-2000000")
    with pytest.raises(ValueError, match="size '0.0KiB' is zero: give the model's float32 size"):
        parse_model_size("0.0KiB")  # (--model-bytes; other sizes may be zero)
    assert parse_size("0") == 0
    with pytest.raises(ValueError, match="over the limit"):
        parse_count("99999999999B")


def test_usage_errors_exit_2_with_the_reason(capsys):
    assert main(["--model-bytes", "727M"]) == 2
    assert "MiB for binary or MB for decimal" in capsys.readouterr().err
    assert main(["--model-bytes", "1GiB", "--params", "1M"]) == 2
    assert "not allowed with" in capsys.readouterr().err
    assert main(["--local-ranks", "0"]) == 2
    assert "--local-ranks (--nprocs) 0 must be from 1 to 63" in capsys.readouterr().err
    # a probe's 1000000 was checked against /dev/shm and told to grow it to 1.1 TiB
    assert main(["--local-ranks", "1000000"]) == 2
    assert ("--local-ranks (--nprocs) 1000000 must be from 1 to 63 (one host runs at most "
            "63 ranks)"
            in capsys.readouterr().err)
    assert main(["--help"]) == 0
    assert "--model-bytes SIZE" in capsys.readouterr().out


def test_launcher_and_module_on_this_host(tmp_path):
    """tools/host_ram.py runs from a checkout; the real host is measured (no model
    given, an empty stand-in /dev/shm so other runs' segments are never touched)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = subprocess.run([sys.executable, str(REPO / "tools/host_ram.py"), "--json",
                           "--shm-dir", str(shm)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["ok"] is True and rep["segments"] == [] and rep["inputs"]["root"] == "/"
    assert 0 < rep["host"]["available"] <= rep["host"]["total"]
    assert [c["name"] for c in rep["checks"]] == ["dev_shm_space", "ram",
                                                  "pinned_decode_staging", "dead_owner_segments"]
    assert check(rep, "pinned_decode_staging")["need_bytes"] == gate_need_bytes(0, 1) == 0


def test_fits_says_what_it_leaves_out_unless_given_training_memory(tmp_path, capsys):
    """"fits" covers the engine's memory only and says so; ``--train-bytes`` (each rank's
    model, optimizer state and activations) is counted in the RAM check when given."""
    root = str(fake_host(tmp_path, limit=4 * GB, usage=512 * MB))
    argv = ["--root", root, "--shm-size", "8GiB", "--params", "10M", "--local-ranks", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "verdict: fits (exit 0) for the engine's memory only" in out
    assert "optimizer state and activations are not counted" in out and "--train-bytes" in out

    code, rep = run_json(capsys, *argv, "--train-bytes", "1GiB")
    ram = check(rep, "ram")
    base = shm_need_bytes(2, 40_000_000) + 2 * 40_000_000  # the arena, 2 decoded consensus
    assert code == 0 and ram["need_bytes"] == base + 2 * GB
    assert "2 × 1.0 GiB training memory (--train-bytes)" in ram["detail"]
    assert rep["inputs"]["train_bytes"] == GB
    assert main(argv + ["--train-bytes", "1GiB"]) == 0
    assert "counting 1.0 GiB per rank of training memory" in capsys.readouterr().out

    # the same host cannot hold 2 GiB of training memory per rank beside the engine
    code, rep = run_json(capsys, *argv, "--train-bytes", "2GiB")
    assert code == 1 and not check(rep, "ram")["ok"]


def test_dev_shm_counts_what_a_large_local_sgd_places_there(tmp_path, capsys):
    """The arena's figure (a frame per rank and the result's) covers LocalSGD's shared
    parameter blocks, which stand in for those regions where its rounds run direct
    (test_shared_params measures the regions staying empty); a bf16 run's start
    broadcast grows its root's region to an f32 frame."""
    root = fake_host(tmp_path)
    staging = 50_000_000 * 4
    args = ("--root", root, "--shm-size", "8GiB", "--params", "50M", "--local-ranks", "2")
    _, default = run_json(capsys, *args)
    _, bf16 = run_json(capsys, *args, "--wire", "bf16")
    assert default["needs"]["arena_shm_bytes"] == shm_need_bytes(2, staging) >= 3 * staging
    assert bf16["needs"]["arena_shm_bytes"] == (shm_need_bytes(2, staging // 2, wire_bf16=True)
                                                + staging // 2)
    assert ("its shared parameter blocks, 2 × 190.7 MiB, take the place of the regions"
            in check(default, "dev_shm_space")["detail"])
    # a model under the direct rounds' 256 KiB: no direct rounds, no blocks
    _, small = run_json(capsys, "--root", root, "--shm-size", "8GiB", "--params", "50K",
                        "--local-ranks", "2")
    assert small["needs"]["arena_shm_bytes"] == shm_need_bytes(2, 200_000)
    assert "shared parameter blocks" not in check(small, "dev_shm_space")["detail"]


def arena_pages_after_one_round(ctx, owner: int, nelem: int) -> int:
    """Rank 0's count of the /dev/shm pages of the launcher's arena after one round."""
    import torch

    from flodl_shm.engine.segment import list_segments

    ctx.comm.all_reduce_([torch.ones(nelem)])
    ctx.comm.barrier()
    held = sum(s.nbytes for s in list_segments() if s.owner_pid == owner)
    ctx.comm.barrier()  # rank 1 stays until rank 0 has counted
    return held


@pytest.mark.timeout(120)
def test_the_arena_figure_covers_what_the_shared_path_holds():
    """A probe measured 2 MiB more in /dev/shm than `ram` predicted for a 289 MiB model
    on the shared path: the bulk regions grow by whole MiB granules, as the result region
    does, and the figure counted them to the byte. A frame of whole MiB shows it."""
    from flodl_shm import spawn

    nelem = 2 << 20  # 8 MiB f32: the regions grow to 9 MiB with their schema words
    held = spawn(arena_pages_after_one_round, 2, args=(os.getpid(), nelem),
                 max_failures=1)[0]  # a tolerated death: no direct rounds, the shared path
    need = shm_need_bytes(2, nelem * 4)
    assert 2 * (9 << 20) + (8 << 20) <= held <= need, (held, need)


@pytest.mark.parametrize("params, said", [("100B", "100.0B params = 372.5 GiB f32"),
                                          ("190M", "190.0M params = 724.8 MiB f32"),
                                          ("12345", "12,345 params = 48.2 KiB f32")])
def test_the_model_line_counts_params_in_a_unit_that_reads(tmp_path, capsys, params, said):
    """A probe's --params 100B read '100000.0M params'."""
    root = fake_host(tmp_path, total=24 * GB, avail=22 * GB, limit=None, usage=0)
    main(["--root", str(root), "--shm-size", "8GiB", "--params", params])
    out = capsys.readouterr().out
    assert f"model        {said}" in out, out
