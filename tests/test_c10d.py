"""The torch.distributed backend "flodl_shm": collectives, DDP, averaging, failures.

Every scenario runs as real rank processes joined through ``tcp://127.0.0.1``
(``c10d_driver.py``); one run per scenario feeds several tests (module fixtures).
Contracts checked: values equal a reference computed here (float sums in rank order,
exact for integers and MIN/MAX), every rank holds the same bits, unsupported ops and
dtypes raise naming what is supported, a dead peer makes the others raise naming it,
and no ``/dev/shm`` segment outlives the ranks.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from c10d_driver import (DTYPES, HALF_AVG_VALUES, PREMUL_READABLE,  # noqa: E402
                         rank_input, run_group, sparse_input)

from flodl_shm.engine.segment import list_segments  # noqa: E402

pytestmark = pytest.mark.timeout(240)

OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
#: the refusal of a PREMUL_SUM on a torch that gives a Python backend no factor
_FACTORLESS_SAYS = "does not let a Python backend read a PREMUL_SUM's factor"


def _no_segments_of(results) -> None:
    """No fshm_ segment owned by any rank process of the run (dead ones included)."""
    pids = {p for r in results if r is not None for p in r["all_pids"]}
    assert pids, "the ranks reported no pids"
    left = [s.name for s in list_segments() if s.owner_pid in pids]
    assert left == [], f"segments left in /dev/shm by the ranks: {left}"


def reference(op: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The documented result: parts combined in rank order, in the tensors' dtype."""
    if op in ("MIN", "MAX"):
        st = torch.stack(parts)
        return st.amin(0) if op == "MIN" else st.amax(0)
    acc = parts[0].clone()
    for p in parts[1:]:
        if acc.dtype is torch.bool:
            acc = acc | p if op == "SUM" else acc & p
        else:
            acc = acc + p if op in ("SUM", "AVG") else acc * p
    if op != "AVG":
        return acc
    # integers: truncated toward zero, as NCCL's AVG (-7 // 2 would give -4, not -3)
    return acc / len(parts) if acc.is_floating_point() else torch.div(
        acc, len(parts), rounding_mode="trunc")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().view(torch.uint8).numpy()) == \
        bytes(b.contiguous().view(torch.uint8).numpy())


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    res = run_group("collectives", 2, tmp_path_factory.mktemp("c10d1"))
    _no_segments_of(res)
    return res


@pytest.fixture(scope="module")
def one_host_shared(tmp_path_factory):
    # every reduce takes the shared regions (by default those from 256 KiB run as
    # direct rounds: engine/direct.py)
    res = run_group("collectives", 2, tmp_path_factory.mktemp("c10d1s"),
                    extra_env={"FLODL_SHM_DIRECT_MIN_BYTES": str(1 << 40)})
    _no_segments_of(res)
    return res


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    # ranks 0 and 2 share host "a", rank 1 is alone on "b": uneven, interleaved hosts
    res = run_group("collectives", 3, tmp_path_factory.mktemp("c10d2"), hosts=["a", "b", "a"],
                    timeout=150)
    _no_segments_of(res)
    return res


def check_collectives(res: list[dict], *, rank_order_sums: bool = True) -> None:
    """``rank_order_sums``: float32 sums equal the rank-order sum bit for bit (one host);
    across hosts they are host sums combined by gloo (same bits on every rank, the
    value within rounding of the rank-order sum)."""
    world = len(res)
    assert all(r is not None and r["returncode"] == 0 for r in res), [r and r["log"] for r in res]
    for dt in DTYPES:
        parts = [rank_input(r, dt) for r in range(world)]
        for op in OPS:
            if op == "AVG" and dt is torch.bool:
                continue
            got = [r[("all_reduce", str(dt), op)] for r in res]
            for g in got[1:]:
                assert same_bits(g, got[0]), (dt, op, "ranks disagree")
            want = reference(op, parts)
            hier = dt is torch.float32 and op == "SUM" and not rank_order_sums
            if dt in (torch.float32, torch.float64) and op in ("SUM", "PRODUCT", "MIN",
                                                                "MAX") and not hier:
                assert same_bits(got[0], want), (dt, op)
            elif dt.is_floating_point:
                torch.testing.assert_close(got[0].double(), want.double(), rtol=2e-2, atol=2e-2)
            else:
                assert torch.equal(got[0], want), (dt, op)
    big = [rank_input(r, torch.float32, n=(3 << 20) // 4 + 5, salt=1) for r in range(world)]
    if rank_order_sums:
        assert same_bits(res[0]["all_reduce_big"], reference("SUM", big))
    torch.testing.assert_close(res[0]["all_reduce_big"], reference("SUM", big))
    for r in res[1:]:
        assert same_bits(r["all_reduce_big"], res[0]["all_reduce_big"])
        assert same_bits(r["all_reduce_big_avg"], res[0]["all_reduce_big_avg"])
    torch.testing.assert_close(res[0]["all_reduce_big_avg"], reference("AVG", big))
    if PREMUL_READABLE:
        torch.testing.assert_close(res[0]["premul"], reference(
            "SUM", [rank_input(r, torch.float64) * 0.5 for r in range(world)]))
    else:  # (refused on every rank, the group usable after: the calls below ran)
        assert all(_FACTORLESS_SAYS in r["premul"] for r in res), res[0]["premul"]
    for r in res:
        assert same_bits(r["broadcast_big"],
                         rank_input(0, torch.float32, n=(3 << 20) // 4 + 5, salt=2))
    src = 1 % world
    for dt in (torch.float64, torch.int32, torch.bool, torch.bfloat16, torch.float32):
        for r in res:
            assert same_bits(r[("broadcast", str(dt))], rank_input(src, dt))
            for k in range(world):
                assert same_bits(r[("all_gather", str(dt))][k], rank_input(k, dt))
    for r in res:
        assert r["all_gather_into_tensor"].tolist() == [k for k in range(world) for _ in range(5)]
        assert ("all_gather_single" in r) == hasattr(torch.distributed, "all_gather_single")
        if "all_gather_single" in r:  # (torch 2.13's name)
            assert same_bits(r["all_gather_single"], r["all_gather_into_tensor"])
        assert r["scatter"].tolist() == [100.0 + r_i for r_i in
                                         [res.index(r)] * 3]
        assert [o.tolist() for o in r["all_to_all"]] == [
            [10 * s + res.index(r)] * (s + 1) for s in range(world)]
        assert r["async"][0] is True and r["async"][1] is True  # waited, then completed
        assert r["async"][2].tolist() == [float(world)] * 3
        assert r["all_gather_object"] == [{"rank": k} for k in range(world)]
        assert r["barrier"] == (True, [])  # (gloo's barrier holds no tensor either)
    for me, r in enumerate(res):
        full = reference("SUM", [rank_input(k, torch.float64, n=4 * world) for k in range(world)])
        torch.testing.assert_close(r["reduce_scatter_tensor"], full[4 * me:4 * me + 4])
        if "reduce_scatter_single" in r:
            assert same_bits(r["reduce_scatter_single"], r["reduce_scatter_tensor"])
        mx = reference("MAX", [rank_input(k, torch.int64, n=4 * world) for k in range(world)])
        assert torch.equal(r["reduce_scatter_max"], mx[4 * me:4 * me + 4])
        want = [torch.arange(2 * world, dtype=torch.float32)[2 * me:2 * me + 2] + 100 * s
                for s in range(world)]
        assert r["all_to_all_single"].tolist() == torch.cat(want).tolist()
        for i, n in enumerate((5, 9)):
            ref = reference("SUM", [rank_input(k, torch.float32, n=n, salt=3 + i)
                                    for k in range(world)])
            torch.testing.assert_close(r["all_reduce_coalesced"][i], ref)
            assert same_bits(r["all_reduce_coalesced"][i], res[0]["all_reduce_coalesced"][i])
            if rank_order_sums:
                assert same_bits(r["all_reduce_coalesced"][i], ref)
    assert [g.tolist() for g in res[0]["gather"]] == [[k + 10] * 3 for k in range(world)]
    assert [g.tolist() for g in res[0]["gather_complex"]] == [
        [complex(k, 0.5), complex(0, -k)] for k in range(world)]
    assert res[0]["reduce"].tolist() == [float(sum(range(world)))] * 4


def test_every_collective_and_dtype_on_one_host(one_host):
    check_collectives(one_host)


def test_every_collective_and_dtype_through_the_shared_regions(one_host, one_host_shared):
    check_collectives(one_host_shared)
    # the 3 MiB reduces ran direct in ``one_host`` (the default threshold, 256 KiB) and
    # through the shared regions here: the same bits. The 3 MiB broadcast
    # settled the direct path in both (broadcasts are direct from 32 KiB)
    assert [r["direct_state"] for r in one_host_shared] == ["ready"] * 2
    assert [r["direct_state"] for r in one_host] == ["ready"] * 2
    for a, b in zip(one_host, one_host_shared):
        assert same_bits(a["all_reduce_big_avg"], b["all_reduce_big_avg"])


@pytest.mark.slow
def test_every_collective_and_dtype_across_two_hosts(two_hosts):
    check_collectives(two_hosts, rank_order_sums=False)


@pytest.mark.slow
def test_mismatched_calls_raise_on_every_rank_of_every_host(two_hosts):
    # host "a" (ranks 0, 2) disagrees inside itself; host "b" (rank 1) is consistent
    # alone but must not be left waiting in the leaders' gloo group
    # and every rank is told what each rank called, through one more round across hosts
    for r in two_hosts:
        for key in ("mismatch", "mismatch_bytes", "mismatch_dtype", "mismatch_op"):
            assert r["errors"][key] is not None, (key, r["errors"])
        assert calls_listed(r["errors"]["mismatch"]) == [
            "allreduce([float32[3]], op=SUM)", "allreduce([float32[4]], op=SUM)",
            "allreduce([float32[5]], op=SUM)"]
        assert calls_listed(r["errors"]["mismatch_op"]) == [
            "allreduce([float32[3]], op=SUM)"] + ["allreduce([float32[3]], op=MAX)"] * 2


def test_layouts_half_sums_empty_complex_and_misuse(tmp_path):
    """A tensor's layout is each rank's own business: one-element tensors of stride 2,
    non-contiguous outputs, a transposed tensor on one rank only, the same bits on every
    rank (signed zeros, NaN signs); bfloat16/float16 sums are summed in float32 and
    rounded once whichever transport a collective takes; empty and complex tensors; and
    a misused collective raises on every rank and leaves the group usable."""
    res = run_group("layouts", 3, tmp_path)
    _no_segments_of(res)
    assert all(r is not None and r["returncode"] == 0 for r in res), [r and r["log"] for r in res]
    world = 3
    for me, r in enumerate(res):
        assert r["one_strided_sum"].tolist() == [1 + 11 + 21]
        assert [o.tolist() for o in r["one_strided_gather"]] == [[0.0], [1.0], [2.0]]
        want = [[7.0, 7.0] if (s == 1 and me == 0) else [float(s)] * 2 for s in range(world)]
        assert [o.tolist() for o in r["all_to_all"]] == want
        assert torch.equal(r["gather_into_transposed"],
                           torch.cat([torch.arange(12.).view(3, 4) + 100 * k for k in range(3)]))
        assert torch.equal(r["gather_into_mixed"],
                           torch.cat([torch.arange(12.).view(3, 4) + 100 * k for k in range(3)]))
        full = sum(torch.arange(world * 6) + k for k in range(world)).view(world * 2, 3)
        assert torch.equal(r["reduce_scatter_into_transposed"], full.chunk(world)[me])
        for name in ("SUM", "AVG"):
            fast, listed = r[("reduce_scatter_transports", name)]
            assert same_bits(fast, listed), (name, fast, listed)
        assert same_bits(r["all_reduce_mixed_layouts"],
                         reference("SUM", [torch.arange(12.).view(3, 4) + k for k in range(3)]))
        assert r[("half_sums", "torch.bfloat16")] == dict.fromkeys(
            ("all_reduce", "all_reduce_strided", "reduce_scatter_tensor", "reduce_scatter"),
            1.0078125)  # 1 + 2^-7: not 1.0, the per-step bfloat16 sum
        assert r[("half_sums", "torch.float16")] == dict.fromkeys(
            ("all_reduce", "all_reduce_strided", "reduce_scatter_tensor", "reduce_scatter"),
            1.0009765625)  # 1 + 2^-10
        for dt in (torch.bfloat16, torch.float16):
            got = r[("half_avg", str(dt))]
            parts = [torch.tensor(v, dtype=dt).float() for v in HALF_AVG_VALUES]
            want = ((parts[0] + parts[1] + parts[2]) * torch.tensor(1 / 3)).to(dt).tolist()
            for how in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter"):
                assert got[how] == want, (dt, how, got[how], want)
            assert got[("negative_zero", "SUM")] == [-1.0, -1.0], dt
            assert got[("negative_zero", "PREMUL_SUM")] == [-1.0, -1.0] if PREMUL_READABLE \
                else _FACTORLESS_SAYS in got[("negative_zero", "PREMUL_SUM")], dt
        assert r["resized"] == [None] * 3, r["resized"]
    assert res[0]["reduce_strided"].tolist() == [3.0 * i + 3 for i in range(6)]
    for key in (("signed_zeros", "MIN"), ("signed_zeros", "MAX"), "nan_bits"):
        assert res[0][key] == res[1][key] == res[2][key], key  # whatever the layout
    assert res[0]["complex_reduce"].tolist() == [6 + 12j, 18 - 6j]
    assert [r["complex_reduce_scatter"].tolist() for r in res] == [[0j], [3 + 3j], [6 + 6j]]
    for r in res:
        errs = r["errors"]
        for what in ("all_gather_count", "gather_into_size", "reduce_scatter_size",
                     "alltoall_splits", "scatter_list", "gather_list", "complex_max"):
            assert errs[what] is not None, (what, r["log"])
            assert errs[what + " then"] == [3.0, 3.0], what  # the group stays usable
    assert "rank 1 sends 4 bytes to rank 0, whose output 1 holds 12" in \
        res[2]["errors"]["alltoall_splits"]
    assert "the root, rank 0, passed a scatter_list" in res[1]["errors"]["scatter_list"]
    assert "the root, rank 0, passed a gather_list" in res[2]["errors"]["gather_list"]
    assert "complex tensors take SUM, AVG or PREMUL_SUM" in res[0]["errors"]["complex_max"]
    # an expand()ed tensor given for a result on one rank only (broadcast: rank 1, not the
    # root; reduce: rank 2, its dst; all_reduce: rank 0; bfloat16 all_reduce: rank 1)
    # raised on that rank before the round, so the others' round paired with the next call
    culprit = {"broadcast": 1, "reduce": 2, "all_reduce": 0, "all_reduce_bf16": 1}
    for me, r in enumerate(res):
        errs = r["expanded"]
        for what, bad in culprit.items():
            assert errs[what + " then"] == [3.0, 3.0], (what, r["log"])  # still in step
            if me == bad:
                assert "has elements that share memory (an expand()ed view)" in errs[what]
                assert "the group stays usable" in errs[what] and what not in \
                    r["expanded_results"]
            else:
                assert errs[what] is None, (what, errs[what])
    assert res[0]["expanded_results"]["broadcast"] == [10.0, 20.0]
    assert res[2]["expanded_results"]["broadcast"] == [10.0, 20.0]
    # the culprit's own values went into the round: [2, 2] from rank 2's expanded tensor
    assert [r["expanded_results"]["reduce"] for r in res[:2]] == [[1.0, 2.0], [1.0, 2.0]]
    assert [r["expanded_results"]["all_reduce"] for r in res[1:]] == [[2.0, 4.0]] * 2
    assert [res[k]["expanded_results"]["all_reduce_bf16"] for k in (0, 2)] == [[3.0, 5.0]] * 2


def test_a_premul_sum_that_reaches_the_backend_without_its_factor_is_refused():
    """torch 2.11 (seen on a GPU host) gives a Python backend no ``ReduceOp.factor``: its
    PREMUL_SUM collectives failed inside the reduce, on every rank, with advice to build
    the op as the caller had. The op check refuses them now (the refusal round keeps the
    group usable), saying what to do instead. A bare ``ReduceOp.PREMUL_SUM`` type has no
    factor on any torch."""
    import torch.distributed as dist

    from flodl_shm.distributed.reduce_ops import RefusedCall, check_op, premul_factor

    with pytest.raises(RefusedCall, match=r"^flodl_shm allreduce: reduce op PREMUL_SUM "
                                          r"reached the backend without its factor") as e:
        check_op(dist.ReduceOp.PREMUL_SUM, torch.float32, "allreduce")
    if PREMUL_READABLE:
        assert str(e.value).endswith("build it with "
                                     "torch.distributed._make_nccl_premul_sum(factor)")
        op = dist._make_nccl_premul_sum(0.25)
        check_op(op, torch.float32, "allreduce")
        assert premul_factor(op) == 0.25
    else:
        assert _FACTORLESS_SAYS in str(e.value) and "use ReduceOp.SUM" in str(e.value)
        assert torch.__version__ in str(e.value)


def test_unsupported_ops_and_dtypes_raise_naming_the_supported_set(one_host):
    errs = one_host[0]["errors"]
    assert "BAND" in errs["band"] and "SUM, AVG, PRODUCT, MIN, MAX" in errs["band"]
    assert "AVG has no meaning for torch.bool" in errs["avg_bool"]
    world = len(one_host)
    for r in one_host:
        for what, said in r["layouts"].items():
            if what.endswith(" then"):
                assert said == [float(world)] * 4, (what, r["log"])  # still in step
            elif r is not one_host[0] and what.split()[0] in ("scatter_list", "gather_list"):
                assert "the root, rank 0, passed a" in said, (what, said)  # (the root's list)
            else:
                kind = "a nested" if what.split()[1] in ("nested", "jagged") else "a torch."
                assert f"{kind}" in said and "handles dense tensors only" in said, (what, said)
    assert "PREMUL_SUM needs a floating dtype" in errs["premul_int"] and "int32" in \
        errs["premul_int"]
    assert "uint16" in errs["uint16"] and "float32" in errs["uint16"]
    assert "send" in errs["send"] and "gloo" in errs["send"]
    # ranks that disagree raise, not hang, and each is told what every rank called
    expected = {
        "mismatch": ["allreduce([float32[3]], op=SUM)", "allreduce([float32[4]], op=SUM)"],
        "mismatch_bytes": ["allreduce([int64[3]], op=SUM)", "allreduce([int64[4]], op=SUM)"],
        "mismatch_dtype": ["allreduce([float32[3]], op=SUM)",
                           "allreduce([float64[3]], op=SUM)"],
        "mismatch_op": ["allreduce([float32[3]], op=SUM)", "allreduce([float32[3]], op=MAX)"],
        # (a probe: each rank scaled every contribution by its own factor, each rank's
        # result a different one)
        "mismatch_factor": ["allreduce([float32[3]], op=PREMUL_SUM(1.0))",
                            "allreduce([float32[3]], op=PREMUL_SUM(2.0))"],
        "mismatch_factor_rs": [
            f"reduce_scatter([float32[2]], [[float32[2], float32[2]]], op=PREMUL_SUM({f}))"
            for f in (0.5, 1.5)]}
    if not PREMUL_READABLE:  # (refused alike, before any round)
        del expected["mismatch_factor"], expected["mismatch_factor_rs"]
    for key, calls in expected.items():
        for r in one_host:
            msg = r["errors"][key]
            assert "the 2 ranks of this group made different calls" in msg, msg
            assert calls_listed(msg) == calls, msg


def calls_listed(message: str) -> list[str]:
    """The per-rank calls an error lists, in rank order (``  rank R: call``)."""
    lines = [line.strip() for line in message.splitlines() if line.startswith("  rank ")]
    assert [int(line.split()[1].rstrip(":")) for line in lines] == list(range(len(lines)))
    return [line.split(": ", 1)[1] for line in lines]


@pytest.mark.slow
def test_ddp_matches_gloo_and_is_identical_across_ranks(tmp_path):
    shm = run_group("ddp", 2, tmp_path)
    gloo = run_group("ddp", 2, tmp_path, backend="gloo")
    _no_segments_of(shm)
    assert all(r["overlapped"] for r in shm)
    for r in shm:
        assert r["hook_allreduce"] == [6.0] * 3 and r["after"] == [1.0, 1.0]
    for rank, (mine, theirs) in enumerate(zip(shm, gloo)):  # in a backward pass, as gloo
        seen = mine["in_backward"]
        for key in ("reduce_scatter_tensor", "all_to_all_single"):
            assert seen[key] == theirs["in_backward"][key], (rank, key, seen[key])
        assert seen["reduce_scatter_tensor"] == [2.0 * (4 * rank + i) + 1 for i in range(4)]
        assert "an output of 3 torch.float32 elements" in seen.get("bad_output", ""), seen
    # (PowerSGD only where CUDA is not available: see sc_ddp; the ranks tell, as asking
    # here would keep the ranks forked later from CUDA)
    for variant in ("plain", "fp16", "powersgd")[:2 if gloo[0]["cuda"] else None]:
        for p0, p1 in zip(shm[0][variant], shm[1][variant]):
            assert same_bits(p0, p1), variant
        for a, b in zip(shm[0][variant], gloo[0][variant]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=variant)


def test_a_compiled_ddp_model_trains_as_on_gloo(tmp_path):
    """A probe: ``torch.compile(DDP(model))`` failed at its second step (DDP's forward
    rebuilt its buckets through the backend, whose Python torch.compile then traced, the
    group an opaque object to it: UnsafeScriptObjectError); gloo's C++ is never traced.
    The collectives run untraced now, without a word from torch.compile."""
    shm = run_group("ddp_compiled", 2, tmp_path)
    gloo = run_group("ddp_compiled", 2, tmp_path, backend="gloo")
    _no_segments_of(shm)
    for r in shm:
        assert r["warnings"] == gloo[0]["warnings"], r["warnings"]
    for rank in (0, 1):  # (each rank's BatchNorm statistics are its own batches')
        for name, value in shm[rank]["state"].items():
            torch.testing.assert_close(value, gloo[rank]["state"][name], rtol=1e-4, atol=1e-5,
                                       msg=name)
    for name in ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"):
        assert same_bits(shm[0]["state"][name], shm[1]["state"][name]), name


def test_ddp_of_a_model_with_a_complex_parameter_matches_gloo(tmp_path):
    """A probe: DDP's start-up broadcast of a model with a complex parameter raised
    'dtype torch.complex64 is not supported' (torch's dist.broadcast passes complex
    tensors as their float views; DDP's _broadcast_coalesced does not); gloo took it."""
    shm = run_group("ddp_complex", 2, tmp_path)
    gloo = run_group("ddp_complex", 2, tmp_path, backend="gloo")
    _no_segments_of(shm)
    assert [p.dtype for p in shm[1]["start"]].count(torch.complex64) == 1
    for p0, p1, g in zip(shm[0]["start"], shm[1]["start"], gloo[1]["start"]):
        assert same_bits(p0, p1) and same_bits(p1, g)  # rank 0's init, byte for byte
    for p0, p1, g in zip(shm[0]["params"], shm[1]["params"], gloo[0]["params"]):
        assert same_bits(p0, p1)
        torch.testing.assert_close(p0, g, rtol=1e-4, atol=1e-5)


def test_ddp_through_direct_rounds_matches_gloo(tmp_path):
    # buckets of ~2.4 MiB: direct rounds (from 256 KiB: engine/direct.py)
    shm = run_group("ddp_big", 2, tmp_path)
    gloo = run_group("ddp_big", 2, tmp_path, backend="gloo")
    _no_segments_of(shm)
    assert [r["direct_state"] for r in shm] == ["ready"] * 2
    for p0, p1, g in zip(shm[0]["params"], shm[1]["params"], gloo[0]["params"]):
        assert same_bits(p0, p1)
        torch.testing.assert_close(p0, g, rtol=1e-4, atol=1e-5)


def _sparse_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """gloo's sparse all-reduce: each rank's tensor coalesced, added in rank order, the
    sum coalesced."""
    out = None
    for p in parts:
        p = p.coalesce()
        p = torch.sparse_coo_tensor(p.indices(), p.values(), p.shape)
        out = p if out is None else out + p
    return out.coalesce()


def _same_sparse(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.layout is b.layout is torch.sparse_coo and a.shape == b.shape
            and a.is_coalesced() and b.is_coalesced()
            and same_bits(a.indices(), b.indices()) and same_bits(a.values(), b.values()))


@pytest.mark.parametrize("hosts", [None, ["a", "b", "a"]], ids=["one_host", "two_hosts"])
def test_sparse_all_reduce_and_ddp_of_sparse_gradients_match_gloo(tmp_path, hosts):
    """A probe: ``dist.all_reduce`` of a sparse COO tensor, and DDP of a model with an
    ``nn.Embedding(sparse=True)``, raised where gloo sums them. Now: the SUM of the
    ranks' entries in rank order (as gloo adds them) on every rank, bit for bit; an op
    but SUM, or ranks whose sparse calls differ, raise on every rank, which stay in step
    with nothing written. And a tensor only one rank refuses before any round (a sparse
    CSR tensor, an unsupported dtype) makes every rank raise at once."""
    import warnings

    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    shm = run_group("sparse", 3, tmp_path, hosts=hosts, timeout=150)
    gloo = run_group("sparse", 3, tmp_path, backend="gloo")
    _no_segments_of(shm)
    assert all(r is not None and r["returncode"] == 0 for r in shm), [r and r["log"] for r in shm]
    world = 3
    wanted = {"f32": (0, torch.float32, (9,)), "f64": (1, torch.float64, (9,)),
              "bf16": (2, torch.bfloat16, (9,)), "int64": (3, torch.int64, (9,)),
              "dense_dims": (4, torch.float32, (7, 3, 2))}
    for name, (salt, dtype, size) in wanted.items():
        want = _sparse_sum([sparse_input(r, salt, dtype, size) for r in range(world)])
        for r in range(world):
            assert _same_sparse(shm[r][name], want), (name, r)
            assert _same_sparse(shm[r][name], gloo[r][name]), (name, r)
    for name in ("empty_on_rank_1", "all_empty", "two_sparse_dims", "pair"):
        for r in range(world):
            for a, b in zip(*(([x[name]] if name != "pair" else x[name]) for x in (shm[r],
                                                                                      gloo[r]))):
                assert _same_sparse(a, b), (name, r)
    assert shm[0]["all_empty"]._nnz() == 0
    assert shm[0]["two_sparse_dims"].to_dense()[2, 2] == 2.0  # rank 1's (1, 2) + rank 2's
    for r in range(world):
        assert shm[r]["threads_after"] == 5  # torch's thread count as the caller set it
        t, result = shm[r]["async"]
        assert _same_sparse(t, result) and _same_sparse(t, gloo[r]["async"][0])
        # the embedding (sparse gradients) and the linear layer trained as on gloo (whose
        # dense sums run in another order), every rank to the same bits
        for a, b, c in zip(shm[r]["ddp"], gloo[r]["ddp"], shm[0]["ddp"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            assert same_bits(a, c), r
    assert not same_bits(shm[0]["ddp"][0], sparse_input(0).to_dense())  # (it trained)
    for r in shm:  # the backend's own sparse tensors leave torch nothing to warn of
        assert r["warnings"] == [], r["warnings"]
    for me, r in enumerate(shm):
        errs = r["errors"]
        for what in ("avg", "op_mismatch", "size_mismatch", "dtype_mismatch", "float16",
                     "mixed_on_rank_1", "dense_on_rank_1", "dense_dims_differ",
                     "leaf_requires_grad", "csr_on_rank_0", "uint16_on_rank_2",
                     "refused_at_two_levels"):
            assert errs[what] is not None, (what, me, r["log"])
            assert errs[what + " then"] == [3.0] * 4, what  # every rank still in step
        assert "take ReduceOp.SUM only" in errs["avg"] and "asked for AVG" in errs["avg"]
        assert "asked for MAX" in errs["op_mismatch"]
        assert "differ in size: rank 0: [9], rank 1: [10], rank 2: [11]" in \
            errs["size_mismatch"]
        assert "differ in dtype: rank 0: torch.float32, rank 1: torch.float64" in \
            errs["dtype_mismatch"]
        assert "torch cannot add sparse torch.float16 tensors" in errs["float16"]
        if me == 1:
            assert "tensor[1] is torch.strided among sparse COO tensors" in \
                errs["mixed_on_rank_1"]
        else:
            assert "rank(s) [1] could not take part" in errs["mixed_on_rank_1"]
        listed = calls_listed(errs["dense_on_rank_1"])
        assert listed[1] == "allreduce([float32[9]], op=SUM)" and listed[0] == \
            "allreduce([sparse_coo float32[9]], op=SUM)", listed
        assert calls_listed(errs["dense_dims_differ"])[1] == \
            "allreduce([sparse_coo float32[9,2]], op=SUM)"
        assert "a leaf Variable that requires grad is being used in an in-place" in \
            errs["leaf_requires_grad"]  # (as gloo raises it; it was written silently)
        # one rank refused before any round while the others reduced: every rank raises
        # at once, told what each called (the refusing rank returned alone, and the
        # others' round paired with its next call)
        assert calls_listed(errs["csr_on_rank_0"]) == [
            "allreduce([sparse_csr float32[4,4]], op=SUM)"] + \
            ["allreduce([float32[4,4]], op=SUM)"] * 2
        assert calls_listed(errs["uint16_on_rank_2"])[2] == "allreduce([uint16[3]], op=SUM)"
        assert errs["csr_on_rank_0"].startswith(
            "flodl_shm allreduce: a torch.sparse_csr tensor" if me == 0 else
            "flodl_shm allreduce: the 3 ranks of this group made different calls")
        assert ("dtype torch.uint16 is not supported" in errs["uint16_on_rank_2"]) == (me == 2)
        said = errs["refused_at_two_levels"]  # every rank refused: each its own reason only
        assert "made different calls" not in said and \
            ("sparse_csr" if me == 0 else "dtype torch.uint16 is not supported") in said
        kept, original = r["kept"]
        assert _same_sparse(kept.coalesce(), original.coalesce())  # a refusal writes nothing


@pytest.mark.slow
def test_periodic_model_averager(tmp_path):
    shm = run_group("averager", 2, tmp_path)
    gloo = run_group("averager", 2, tmp_path, backend="gloo")
    for p0, p1, g in zip(shm[0]["params"], shm[1]["params"], gloo[0]["params"]):
        assert same_bits(p0, p1)
        torch.testing.assert_close(p0, g, rtol=1e-5, atol=1e-6)


def test_fsdp2_on_a_cpu_mesh_matches_gloo(tmp_path):
    """FSDP2's gradient reduce-scatters run during the backward pass, queued on the
    group's worker: they returned before their round ran, and the model trained to NaN."""
    shm = run_group("fsdp2", 2, tmp_path)
    gloo = run_group("fsdp2", 2, tmp_path, backend="gloo")
    _no_segments_of(shm)
    for p0, p1, g in zip(shm[0]["params"], shm[1]["params"], gloo[0]["params"]):
        assert same_bits(p0, p1)
        torch.testing.assert_close(p0, g, rtol=1e-5, atol=1e-6)


def test_torch_code_that_asks_the_group_for_its_device_works(tmp_path):
    """A probe: the group answered 'no device', so dcp.async_save, set_model_state_dict
    with broadcast_from_rank0 and FSDP's sharded state dicts failed, and a
    BroadcastingTorchSaveReader load failed on rank 0 only, which then met rank 1's
    broadcast with another collective."""
    res = run_group("device_checkpoints", 2, tmp_path, extra_env={"C10D_DIR": str(tmp_path)})
    _no_segments_of(res)
    for r in res:
        assert r["devices"] == ["cpu"]
        assert r["saved"].tolist() == [1.0] * 4  # rank 0's shard: w is replicated
        for got, want in zip(r["broadcast"], r["source"]):
            assert torch.equal(got, want)
        for got, want in zip(r["read"], r["source"]):
            assert torch.equal(got, want)


def test_a_peer_dead_in_a_ddp_backward_makes_the_backward_raise_naming_it(tmp_path):
    """DDP waits on the gradient all-reduce's future in C++: a queued collective that
    failed there crashed the survivor with SIGSEGV (no message, exit -11)."""
    res = run_group("ddp_peer_dies", 2, tmp_path, extra_env={"C10D_TIMEOUT": "30"})
    assert res[1] is None  # SIGKILLed before writing anything
    assert res[0] is not None and res[0]["returncode"] == 0, "the survivor crashed"
    assert "rank 1 (pid" in res[0]["error"] and "died" in res[0]["error"], res[0]["error"]
    _no_segments_of(res)


def test_ranks_whose_environments_name_other_direct_thresholds_still_agree(tmp_path):
    """The direct rounds' thresholds are the arena owner's words (the group's leader,
    rank 0 here). A rank that read its own ``FLODL_SHM_DIRECT_MIN_BYTES`` took a 2 MiB
    reduce direct while its peer did not: a schema mismatch neither rank had caused."""
    res = run_group("direct_threshold", 2, tmp_path, rank_env=[
        {"FLODL_SHM_DIRECT_MIN_BYTES": str(8 << 20),
         "FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES": str(1 << 20)},
        {"FLODL_SHM_DIRECT_MIN_BYTES": None, "FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES": None}])
    assert [r["reduced"] for r in res] == [[3.0], [3.0]]  # (SUM)
    assert [r["broadcast"] for r in res] == [[2.0], [2.0]]
    assert [r["min_bytes"] for r in res] == [8 << 20] * 2
    assert [r["broadcast_min_bytes"] for r in res] == [1 << 20] * 2
    _no_segments_of(res)


@pytest.mark.parametrize("world", [2, 3])
def test_all_gathers_and_reduce_scatters_keep_every_bit(tmp_path, world):
    """all_gather_into_tensor broadcasts each rank's part in place as float32: raw random
    bits of any dtype arrive bit for bit (NaN payloads included), small or past the direct
    broadcasts' threshold (1 MiB a rank where the ranks outnumber the cores, as 3 do
    here), into outputs at an odd offset or transposed; parts of no whole float32 take the
    byte round. A float32 SUM reduce_scatter_tensor, an all-reduce through the engine,
    gives the list form's bits, into a strided output too. One rank's misfit output: it
    raises, the others gather; one rank's other dtype: every rank raises, as the byte
    rounds' signatures made them; the group stays in step."""
    res = run_group("big_gathers", world, tmp_path)
    assert all(r is not None for r in res)
    checks = ("torch.float32", "torch.bfloat16", "torch.int64", "torch.uint8", "12 bytes",
              "3 bytes", "offset output",
              "transposed output", "reduce_scatter", "misfit on rank 0", "then in step",
              "strided bfloat16 NaN", "gather int32 among float32",
              "reduce_scatter bfloat16 among float32", "then in step again",
              "input overlapping the output", "one strided int64")
    for r in res:
        assert {k: r[k] for k in checks} == dict.fromkeys(checks, True), r["log"]
    _no_segments_of(res)


def test_ranks_whose_torch_threads_outnumber_the_cores_are_told_once(tmp_path):
    """torch's default under ``mp.spawn`` (a thread a core in every rank): the host's first
    rank says so once, with the fix; one thread a rank (torchrun's) says nothing, also
    where the ranks alone outnumber the cores (3 on a host of 2: one is all they can do)."""
    from flodl_shm.engine.hostcpu import available_cores

    many = str(available_cores() + 1)
    res = run_group("one_sum", 2, tmp_path, rank_env=[{"C10D_THREADS": many}] * 2)
    assert [r["t"] for r in res] == [[4.0, 4.0]] * 2  # (summed twice)
    said = [r["log"].count("each run torch with") for r in res]
    assert said == [1, 0], [r["log"] for r in res]
    assert "OMP_NUM_THREADS=" in res[0]["log"]
    quiet = run_group("one_sum", 3, tmp_path)
    assert all("each run torch with" not in r["log"] for r in quiet)
    _no_segments_of(res + quiet)


def test_collectives_run_their_torch_work_on_the_ranks_share_of_the_cores(tmp_path):
    """Ranks whose torch threads outnumber the cores (torch's default under ``mp.spawn``):
    a collective's own torch work (the all-gather's copy of this rank's bytes, the
    reduce-scatter's copy of its part, sums in torch ops) must not start torch's OpenMP
    team, whose threads then wait for the cores the peers spin on (a 256 KiB all-gather
    took 8 ms instead of 0.09). torch's thread count comes back as the caller set it."""
    res = run_group("torch_threads", 2, tmp_path)
    for r in res:
        assert r["gathered"] and r["summed"] == [2.0] and r["max"] == [2.0], r["log"]
        assert r["new native threads"] == [], r["log"]
        assert r["threads after"] == r["asked"]
    _no_segments_of(res)


@pytest.mark.parametrize("direct", [False, True], ids=["shared", "direct"])
@pytest.mark.parametrize("victim", [0, 1], ids=["leader_dies", "peer_dies"])
def test_a_dead_peer_makes_the_others_raise_naming_it(tmp_path, victim, direct):
    env = {"C10D_VICTIM": str(victim), "C10D_TIMEOUT": "30"}
    if direct:
        env["FLODL_SHM_DIRECT_MIN_BYTES"] = "16"
    res = run_group("peer_dies", 2, tmp_path, extra_env=env)
    survivor = res[1 - victim]
    assert res[victim] is None  # SIGKILLed before writing anything
    assert survivor["error"] is not None
    assert f"rank {victim} (pid" in survivor["error"] and "died" in survivor["error"]
    assert survivor["seconds"] < 30
    _no_segments_of(res)


@pytest.mark.parametrize("late", ["0", "1.5"], ids=["waiting", "arriving_after"])
def test_a_peer_that_destroyed_its_group_is_named_as_gone_not_dead(tmp_path, late):
    """Under torchrun a rank that made one collective fewer, destroyed its group and
    exited 0 was reported as "died ... restart the job", which would fail the same way."""
    res = run_group("peer_leaves", 2, tmp_path, extra_env={"C10D_TIMEOUT": "30",
                                                            "C10D_LATE": late})
    assert res[1]["returncode"] == 0
    err = res[0]["error"]
    assert err is not None and "rank 1" in err and "died" not in err, err
    assert "every rank must make the same sequence of collective calls" in err, err
    assert ("already left (it returned from its function, or destroyed its process group)"
            in err or "destroyed its process group and exited" in err), err
    assert res[0]["seconds"] < 10
    _no_segments_of(res)


def _env_ranks(script: Path, text: str, world: int = 2) -> list:
    """``world`` python processes running ``text`` (written to ``script``) as the ranks
    of an env:// group on a free port, as torchrun or a scheduler starts them, with
    their output piped."""
    import subprocess

    from c10d_driver import free_port

    script.write_text(text)
    port = free_port()
    return [subprocess.Popen(
        [sys.executable, str(script)], text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
             "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
        for rank in range(world)]


def _names_of(pid: int, held: bool, timeout: float = 60.0) -> list[str]:
    """The ``/dev/shm`` names of ``pid``'s segments once there are some (``held``) or
    none (not ``held``), or at ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        names = [g.name for g in list_segments() if g.owner_pid == pid]
        if bool(names) == held or time.monotonic() > deadline:
            return names
        time.sleep(0.02)


_DIES_UNCAUGHT = """
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import flodl_shm
dist.init_process_group("flodl_shm", timeout=timedelta(seconds=30))
dist.all_reduce(torch.ones(4))
if dist.get_rank() == 1:
    raise ValueError("boom in rank 1")
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(4))
    print("no error")
except RuntimeError as e:
    print("error:", e)
print("seconds:", time.monotonic() - t0)
"""


def test_a_peer_that_exits_on_an_uncaught_exception_is_named_dead_not_gone(tmp_path):
    """An elastic-restart probe: under torchrun, a rank whose script raised (uncaught)
    was reported to the rank waiting for it as 'already left (it returned from its
    function, or destroyed its process group) ...: every rank must make the same
    sequence of collective calls', blaming the call order for a crash: the group's
    exit-time shutdown left as cleanly as a rank that finished."""
    procs = _env_ranks(tmp_path / "dies.py", _DIES_UNCAUGHT)
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == 1 and "ValueError: boom in rank 1" in outs[1][1], outs[1]
    assert procs[0].returncode == 0, outs[0]
    said = outs[0][0]
    assert "error: " in said and "rank 1 (pid" in said and "died" in said, said
    assert "same sequence of collective calls" not in said, said
    assert float(said.rsplit("seconds:", 1)[1]) < 20, said


_SLOW_TO_MAP = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
import flodl_shm
from flodl_shm.engine import arena
if os.environ["RANK"] == "1":  # holds the group in formation: the leader keeps its names
    attach = arena.Arena.attach
    arena.Arena.attach = lambda handle: (time.sleep(4), attach(handle))[1]
try:
    dist.init_process_group("flodl_shm", timeout=timedelta(seconds=60))
except RuntimeError as e:
    print("error:", e, flush=True)
"""


def test_a_leader_stopped_by_sigterm_while_the_group_forms_leaves_no_names(tmp_path):
    """An elastic-restart probe: SIGTERM to the torchrun agent while the ranks were in
    init_process_group left the leader's 8 arena segments in /dev/shm (the leader holds
    their names until every host peer mapped them); the others waited on."""
    import signal
    import time

    procs = _env_ranks(tmp_path / "slow.py", _SLOW_TO_MAP)
    leader = procs[0]
    try:
        assert _names_of(leader.pid, held=True), "no arena made"
        time.sleep(0.3)
        leader.send_signal(signal.SIGTERM)
        leader.wait(30)
        t0 = time.monotonic()
        out, _ = procs[1].communicate(timeout=60)
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
        left = [g.name for g in list_segments() if g.owner_pid == leader.pid]
        for name in left:  # (none to remove, unless the test fails)
            os.unlink(f"/dev/shm/{name}")
    assert leader.returncode == -signal.SIGTERM  # it still ends by the signal
    assert left == []
    # (the store lived in rank 0's process here, as under env:// without torchrun)
    assert "error: " in out and "rank 0" in out, out
    assert waited < 9, waited  # (its own attach sleeps 4 s, then it hears at once)


_SLOW_GLOO = """
import os, time
from datetime import timedelta
import torch.distributed as dist
import flodl_shm
os.environ["FLODL_SHM_HOST"] = "h" + os.environ["RANK"]  # two hosts: a gloo group of leaders
if os.environ["RANK"] == "1":
    gloo = dist.ProcessGroupGloo
    dist.ProcessGroupGloo = lambda *a: (print("in gloo", flush=True), time.sleep(20),
                                        gloo(*a))[2]
dist.init_process_group("flodl_shm", timeout=timedelta(seconds=60))
"""


def test_a_sigterm_while_the_leaders_gloo_group_forms_ends_the_rank_at_once(tmp_path):
    """A regression probe of the test above's change: a SIGTERM that reached a leader
    blocked in building the gloo group of host leaders (C++: no Python handler runs)
    ended it only once the other host's leader came, 20 s later. No name is held by
    then: SIGTERM has its default action again."""
    import signal
    import time

    procs = _env_ranks(tmp_path / "gloo.py", _SLOW_GLOO)
    leader = procs[0]
    try:
        # the other host's leader reached the gloo step: this one has, or is about to
        assert procs[1].stdout.readline().strip() == "in gloo"
        time.sleep(1.0)
        leader.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        leader.wait(30)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert leader.returncode == -signal.SIGTERM
    assert took < 5, took


@pytest.mark.slow
def test_a_dead_host_makes_the_other_hosts_raise_naming_its_leader(tmp_path):
    # rank 2 is alone on host "b" and dies: host "a"'s leader sees the gloo group fail,
    # and its local peer hears it through shared memory instead of waiting for the timeout
    res = run_group("peer_dies", 3, tmp_path, hosts=["a", "a", "b"],
                    extra_env={"C10D_VICTIM": "2", "C10D_TIMEOUT": "60"}, timeout=150)
    assert res[2] is None
    for r in res[:2]:
        assert r["error"] is not None and "group rank(s) [2]" in r["error"], r["error"]
        assert r["seconds"] < 60
        # unusable on every rank now: the healthy host's leader used to go back into the
        # leaders' gloo step and block there until the timeout
        assert "this flodl_shm process group is unusable" in r["again"], r["again"]
        assert r["again_seconds"] < 5, r
    _no_segments_of(res)


@pytest.mark.slow
def test_a_dead_non_leader_makes_the_other_hosts_raise_naming_it(tmp_path):
    # rank 3 dies on host "b" (leader: rank 2). Rank 2 sees it through shared memory and,
    # staying up after its error, must still tell host "a" at once (through the leaders'
    # agreement step), not leave it waiting for the timeout or for rank 2's exit
    res = run_group("peer_dies", 4, tmp_path, hosts=["a", "a", "b", "b"],
                    extra_env={"C10D_VICTIM": "3", "C10D_TIMEOUT": "4", "C10D_LINGER": "5"},
                    timeout=150)
    assert res[3] is None
    for r in res[:3]:
        assert r["error"] is not None and "rank 3 (pid" in r["error"], r["error"]
        # before the collective timeout (4 s) and before rank 2 exits (after 5 s)
        assert "died" in r["error"] and r["seconds"] < 4, r
    _no_segments_of(res)


def test_async_collectives_run_in_the_background_as_gloo_s_do(tmp_path):
    """A probe's ranks started one group's all_reduce with async_op=True, then another
    group's synchronously, in opposite orders: gloo finishes in milliseconds; here the
    async one ran in the caller's thread, where it waited for a peer that was in the
    other group's call, until the timeout ('group rank(s) [1] ... had not arrived')."""
    res = run_group("async_order", 2, tmp_path, timeout=60)
    for r in res:
        assert r["error"] is None and r["seconds"] < 5, r
        assert r["a"] == [2.0] * 4 and r["b"] == [4.0] * 4, r
    _no_segments_of(res)


def test_a_wait_with_a_timeout_raises_when_it_passes_and_the_collective_goes_on(tmp_path):
    """gloo's ``Work.wait(timeout)`` raises once the timeout passed; a queued collective's
    wait ignored it and blocked until the peer came."""
    res = run_group("wait_timeout", 2, tmp_path, timeout=60)
    first = res[0]
    assert first["first"] is not None and "Work.wait timed out after 1 s" in first["first"], first
    assert 0.9 < first["first_s"] < 2.5, first
    assert first["t"] == res[1]["t"] == [3.0] * 4, res
    _no_segments_of(res)


def test_a_rank_that_skips_a_collective_makes_the_others_time_out_naming_it(tmp_path):
    res = run_group("stall", 3, tmp_path, extra_env={"C10D_TIMEOUT": "3", "C10D_LINGER": "1"},
                    timeout=120)
    for r in res[:2]:
        assert r["error"].startswith("RuntimeError") and "timed out after 3 s" in r["error"]
        assert "group rank(s) [2]" in r["error"], r["error"]
    _no_segments_of(res)


@pytest.mark.slow
def test_a_host_that_skips_a_collective_is_named_by_every_rank_of_the_others(tmp_path):
    """Rank 2, alone on host "b", skips a collective. Rank 1 waited for its leader with
    the leader's own timeout and blamed it ('group rank(s) [0] of this host had not
    arrived'); rank 0 then saw rank 1 exit and blamed it. Now the leader's verdict
    arrives first and both name the other host's leader."""
    res = run_group("stall", 3, tmp_path, hosts=["a", "a", "b"],
                    extra_env={"C10D_TIMEOUT": "3", "C10D_LINGER": "1"}, timeout=120)
    for r in res[:2]:
        assert "the leader(s) of the other hosts, group rank(s) [2], did not complete this " \
            "collective" in r["error"], r["error"]
    _no_segments_of(res)


def test_a_rank_late_past_the_others_timeout_raises_as_they_did(tmp_path):
    """A probe's late rank got a successful all_reduce (the others' contributions were
    there) after every other rank had raised its timeout: the ranks disagreed on the
    outcome, and one that caught the error would step on one side only."""
    res = run_group("late", 3, tmp_path, extra_env={"C10D_TIMEOUT": "2", "C10D_LINGER": "4"},
                    timeout=120)
    for r in res[:2]:
        assert "timed out after 2 s" in r["error"] and "group rank(s) [2]" in r["error"], r
    late = res[2]["error"]
    assert late is not None, res[2]
    assert late.startswith("RuntimeError: flodl_shm allreduce (group rank 2 of 3): group "
                           "rank(s) [") \
        and "gave up on a collective after the group's 2 s timeout, before this rank (group " \
        "rank 2 of 3) arrived, so the ranks disagree on its outcome" in late, late
    # every later call raises at once naming the first failure, in group ranks. The late
    # rank's waited the whole timeout for ranks that had raised (the one-tensor float32
    # path skipped the group's check), and the others' named rank 2 by its place on the
    # host ("round 2 failed with ReduceStall ... ranks that had not arrived: [2]" came
    # from the engine, whose numbers are places, not group ranks)
    for r in res:
        assert r["again"].startswith("RuntimeError: this flodl_shm process group is unusable: "
                                     ) and r["again_s"] < 1.0, r
    assert ("allreduce (group rank 0 of 3) timed out after 2 s: group rank(s) [2]"
            in res[0]["again"]), res[0]["again"]
    assert "gave up on a collective after the group's 2 s timeout" in res[2]["again"], res[2]
    _no_segments_of(res)


@pytest.mark.slow
def test_a_rank_late_past_its_leaders_timeout_raises_at_once_across_hosts(tmp_path):
    """Rank 3 on host "b" enters after its leader (rank 2) gave up waiting for it. Its
    host round completed (the leader's contribution was there), then it waited for the
    leader's fan-out, which never came: 20 s (its outwaiting of the leaders' two gloo
    steps), to raise 'group rank(s) [2] of this host had not arrived', or PeerDied once
    rank 2 had exited. Now it raises as it arrives, naming the rank that gave up."""
    res = run_group("late", 4, tmp_path, hosts=["a", "a", "b", "b"],
                    extra_env={"C10D_TIMEOUT": "2", "C10D_LINGER": "4"}, timeout=150)
    late = res[3]
    assert late["seconds"] < 1.0, late
    assert late["error"].startswith("RuntimeError: flodl_shm allreduce (group rank 3 of 4): "
                                    "group rank(s) [2] gave up on a collective after the "
                                    "group's 2 s timeout, before this rank (group rank 3 of "
                                    "4) arrived"), late
    assert "group rank(s) [3] of this host had not arrived" in res[2]["error"], res[2]
    for r in res:
        assert r["again"].startswith("RuntimeError: this flodl_shm process group is "
                                     "unusable: ") and r["again_s"] < 1.0, r
    _no_segments_of(res)


def test_a_subgroups_timeout_names_global_ranks_too(tmp_path):
    """A probe: in subgroup [1, 2] the errors named group ranks alone ('allreduce (rank 0
    of 2) ... group rank(s) [1] ... had not arrived', printed by global rank 1 about global
    rank 2), easy to misread; each now says the global rank beside the group's."""
    res = run_group("stall_subgroup", 3, tmp_path, extra_env={"C10D_TIMEOUT": "30"},
                    timeout=120)
    err = res[1]["error"]
    assert err is not None and ("allreduce (group rank 0 of 2, global rank 1) timed out "
                                "after 2 s: group rank(s) [1] (global [2]) of this host had "
                                "not arrived") in err, err
    assert res[0]["error"] is None and res[2]["error"] is None
    _no_segments_of(res)


def test_a_rank_that_sees_a_timed_out_peer_exit_names_the_rank_both_waited_for(tmp_path):
    # rank 1 enters 1.5 s after rank 0, so rank 0 times out first and exits at once:
    # rank 1 sees a death before its own deadline, and must still point at rank 2
    res = run_group("stall", 3, tmp_path, extra_env={"C10D_TIMEOUT": "3", "C10D_LATE": "1.5"},
                    timeout=120)
    assert "timed out after 3 s" in res[0]["error"] and "group rank(s) [2]" in res[0]["error"]
    assert "rank 0 (pid" in res[1]["error"] and "died" in res[1]["error"], res[1]["error"]
    assert "Group rank(s) [2] of this host had not arrived" in res[1]["error"], res[1]["error"]
    _no_segments_of(res)


def test_destroy_then_a_new_group(tmp_path):
    res = run_group("destroy_recreate", 2, tmp_path)
    for r in res:
        assert r["t"].tolist() == [1.0] * 4 and r["u"].tolist() == [2.0, 2.0]
        assert "shut down" in r["after_destroy"]
    _no_segments_of(res)
