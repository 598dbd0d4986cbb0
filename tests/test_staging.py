"""Decode staging (spec §5): the RAM gate, slot buffers, and armed decodes through
real collectives (FakeCohort: a real arena, thread ranks)."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import flodl_shm
from flodl_shm import DECODE_SLOT_BUFFERS, DECODE_SLOT_PARAMS, RoundKind, pinned_decode_affordable
from flodl_shm.engine.hostmem import host_memory
from flodl_shm.engine.staging import (
    GATE_FACTOR,
    U64_MAX,
    DecodeStaging,
    alloc_staging,
    check_slot,
    decide_pinned_decode,
    gate_need_bytes,
)
from flodl_shm.testing import FakeCohort
from test_hostmem import fake_host, v2

MB = 1 << 20
GB = 1 << 30


def _cuda_usable() -> bool:
    """Whether CUDA is usable here, asked in a process of its own: asked in this one
    (``torch.cuda.is_available()``), it starts the driver, and on a GPU host the ranks that
    later tests fork then fail wherever torch touches CUDA ("Cannot re-initialize CUDA in
    forked subprocess": torch.compile in a rank, say). A CPU build of torch needs no ask."""
    if torch.version.cuda is None:
        return False
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip() == "True"


CUDA_USABLE = _cuda_usable()


# -- the gate -----------------------------------------------------------------------


def test_pinned_decode_gate_at_the_rig_numbers():
    """The rig's measured A/B (2026-07-29): two 190M ranks (727 MiB f32 staging each)
    on the 9.4 GB VM must be refused at the ~7.3 GB the ranks read at rank start;
    one rank on a 13 GB host passes; a small model passes even on the tight VM;
    local_ranks 0 clamps to 1 (a zero need would enable staging everywhere)."""
    assert not pinned_decode_affordable(727 * MB, 2, 73 * GB // 10)
    assert pinned_decode_affordable(727 * MB, 1, 13 * GB)
    assert pinned_decode_affordable(10 * MB, 2, 73 * GB // 10)
    assert (pinned_decode_affordable(727 * MB, 0, 73 * GB // 10)
            == pinned_decode_affordable(727 * MB, 1, 73 * GB // 10))


def test_gate_need_is_staging_times_ranks_times_six_and_strictly_greater():
    assert GATE_FACTOR == 6
    assert gate_need_bytes(727 * MB, 2) == 727 * MB * 2 * 6 == 9_147_777_024
    assert gate_need_bytes(727 * MB, 0) == gate_need_bytes(727 * MB, 1) == 727 * MB * 6
    need = gate_need_bytes(100, 3)
    assert need == 1800
    assert not pinned_decode_affordable(100, 3, 1800)      # equal is refused
    assert pinned_decode_affordable(100, 3, 1801)
    # the first-cut factor-4 gate's 5.8 GB need would have passed the rig; 6 does not
    assert 727 * MB * 2 * 4 < 73 * GB // 10 < gate_need_bytes(727 * MB, 2)


def test_gate_need_saturates_like_u64():
    assert gate_need_bytes(1 << 62, 1 << 20) == U64_MAX
    assert not pinned_decode_affordable(1 << 62, 1 << 20, U64_MAX)
    assert pinned_decode_affordable(1 << 62, 1 << 20, U64_MAX + 1)
    assert pinned_decode_affordable(0, 4, 1)        # nothing to stage, any RAM
    assert not pinned_decode_affordable(0, 4, 0)


@pytest.mark.parametrize("args, word", [
    ((-1, 1, 10), "staging_bytes=-1"),
    ((1, -2, 10), "local_ranks=-2"),
    ((1, 1, -5), "available_bytes=-5"),
    ((1, 1, float("nan")), "available_bytes=nan"),
])
def test_gate_rejects_negative_inputs_naming_them(args, word):
    with pytest.raises(ValueError, match=word):
        pinned_decode_affordable(*args)


def test_gate_rejects_non_integer_sizes():
    with pytest.raises(TypeError):
        pinned_decode_affordable(727.5 * MB, 2, 8 * GB)


def test_constants_are_distinct_public_ints():
    assert (DECODE_SLOT_PARAMS, DECODE_SLOT_BUFFERS) == (0, 1)
    assert flodl_shm.pinned_decode_affordable is pinned_decode_affordable


# -- the decision -------------------------------------------------------------------


def _fake_host(tmp_path, *, mem_total, mem_avail, limit=None, usage=0):
    fake_host(tmp_path, total=mem_total, avail=mem_avail)
    v2(tmp_path, max="max" if limit is None else limit, current=usage)
    return host_memory(tmp_path, shm_total_bytes=64 * MB)


def test_decision_refuses_the_rig_and_logs_why(tmp_path, caplog):
    snap = _fake_host(tmp_path, mem_total=94 * GB // 10, mem_avail=73 * GB // 10)
    with caplog.at_level(logging.INFO, logger="flodl_shm"):
        d = decide_pinned_decode(727 * MB, 2, snap, cuda=True)
    assert not d.enabled and d.pinned
    assert d.need_bytes == 727 * MB * 12 and d.available_bytes == snap.available
    assert "OFF" in d.reason and "8.5 GiB" in d.reason and "7.3 GiB" in d.reason
    assert "727.0 MiB f32 staging × 2 local ranks × 6" in d.reason
    recs = [r for r in caplog.records if r.name == "flodl_shm" and r.levelno == logging.INFO]
    assert [r.getMessage() for r in recs] == [d.reason]


def test_decision_uses_the_container_limit_not_host_ram(tmp_path):
    """A 2 GiB container on a 24 GiB host: the host would pass, the container refuses."""
    snap = _fake_host(tmp_path, mem_total=24 * GB, mem_avail=22 * GB, limit=2 * GB,
                      usage=512 * MB)
    assert snap.available == 2 * GB - 512 * MB
    assert pinned_decode_affordable(300 * MB, 1, snap.host_available)
    d = decide_pinned_decode(300 * MB, 1, snap, cuda=False, log=False)
    assert not d.enabled
    assert d.available_bytes == 2 * GB - 512 * MB
    assert "cgroup v2" in d.available_source


def test_decision_enables_with_room_and_says_plain_memory_without_cuda(tmp_path):
    snap = _fake_host(tmp_path, mem_total=64 * GB, mem_avail=13 * GB)
    d = decide_pinned_decode(727 * MB, 1, snap, cuda=False, log=False)
    assert d.enabled and not d.pinned
    assert "ON" in d.reason and "plain memory: this process uses no CUDA" in d.reason
    d2 = decide_pinned_decode(727 * MB, 1, available_bytes=4 * GB, cuda=True, log=False)
    assert not d2.enabled and d2.available_source == "given"


# -- slot buffers -------------------------------------------------------------------


def test_slot_buffers_are_reused_distinct_and_resized_on_schema_change():
    st = DecodeStaging(pin=False)
    a = st.buffer(DECODE_SLOT_PARAMS, 6)
    assert a.dtype == torch.float32 and a.numel() == 6 and not a.is_pinned()
    assert st.buffer(DECODE_SLOT_PARAMS, 6) is a                 # reused
    b = st.buffer(DECODE_SLOT_BUFFERS, 6)                        # same size, other slot
    assert b.data_ptr() != a.data_ptr()
    c = st.buffer(DECODE_SLOT_PARAMS, 8)                         # schema changed
    assert c.numel() == 8 and c is not a
    assert st.slots() == [0, 1] and st.nbytes() == (8 + 6) * 4 and len(st) == 2
    st.clear()
    assert len(st) == 0 and a.numel() == 6                       # handed-out tensors live on


def test_check_slot_names_the_bad_slot():
    assert check_slot(DECODE_SLOT_BUFFERS) == 1
    with pytest.raises(ValueError, match="decode slot -1 must be >= 0"):
        check_slot(-1)
    with pytest.raises(TypeError, match="decode slot 'params'"):
        check_slot("params")


@pytest.mark.skipif(CUDA_USABLE, reason="exercises the no-pinning fallback")
def test_pinning_failure_falls_back_to_pageable_with_one_warning(caplog, monkeypatch):
    import flodl_shm.engine.staging as S

    monkeypatch.setattr(S, "_pin_warned", False)
    with caplog.at_level(logging.WARNING, logger="flodl_shm"):
        t1 = alloc_staging(16, pin=True)
        t2 = alloc_staging(16, pin=True)
    assert t1.dtype == t2.dtype == torch.float32 and t1.numel() == 16 and not t1.is_pinned()
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1 and "page-locking 64 B failed" in warns[0].getMessage()


STAGING_IN_A_FRESH_PROCESS = """
import sys, torch
from flodl_shm.engine.staging import alloc_staging, decide_pinned_decode
if sys.argv[1] == "gpu":
    torch.cuda.init()
t = alloc_staging(1024)
d = decide_pinned_decode(4096, 2, available_bytes=1 << 30, log=False)
print(t.is_pinned(), d.pinned, torch.cuda.is_initialized())
"""


def staging_in_a_fresh_process(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", STAGING_IN_A_FRESH_PROCESS, mode],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_rank_that_never_used_cuda_stages_in_plain_memory_and_never_starts_cuda():
    """On a GPU host too: page-locking would create a CUDA context (0.4 s and memory on
    the host and the GPU, per process) in a rank that trains on the CPU and never copies
    to a GPU."""
    assert staging_in_a_fresh_process("cpu") == ["False", "False", "False"]


@pytest.mark.skipif(not CUDA_USABLE, reason="needs CUDA to page-lock")
def test_staging_is_page_locked_in_a_rank_that_uses_cuda():  # pragma: no cover - GPU hosts
    assert staging_in_a_fresh_process("gpu") == ["True", "True", "True"]


# -- armed decodes through real collectives (ports of the seed tests) ---------------


def test_pinned_decode_reuses_staging_and_keeps_values():
    """Consensus values equal the fresh-alloc path, AND round N's tensors alias the
    reused staging: round N+1's armed decode overwrites them in place (the
    single-consumer contract, pinned as behaviour so a silent switch to fresh
    allocations shows up here)."""
    def rank(comm):
        v1, v2 = {0: (2.0, 10.0), 1: (4.0, 14.0)}[comm.rank]
        comm.set_pinned_decode(True)
        comm.arm_pinned_decode(DECODE_SLOT_PARAMS)
        round1 = comm.all_reduce_scaled([torch.full((2,), v1)], 1.0, RoundKind.MODEL, 1.0)[0]
        round1_vals = round1[0].tolist()
        comm.arm_pinned_decode(DECODE_SLOT_PARAMS)
        round2 = comm.all_reduce_scaled([torch.full((2,), v2)], 1.0, RoundKind.MODEL, 1.0)[0]
        return round1_vals, round1, round2

    with FakeCohort(2) as cohort:
        results = cohort.run(rank)
    for r, (round1_vals, round1, round2) in enumerate(results):
        assert round1_vals == [3.0, 3.0], f"rank {r} round-1 consensus"
        assert round2[0].tolist() == [12.0, 12.0], f"rank {r} round-2 consensus"
        # Round 2 decoded into the SAME staging: round 1's handle reads round 2.
        assert round1[0].tolist() == [12.0, 12.0], f"rank {r} staging reuse"
        assert round1[0].data_ptr() == round2[0].data_ptr()


def test_unarmed_rounds_return_fresh_memory():
    """Contrast: without arming (or with pinned decode off) every reply is fresh."""
    def rank(comm):
        comm.set_pinned_decode(True)
        a = comm.all_reduce_tensors([torch.full((2,), float(comm.rank))])    # not armed
        comm.set_pinned_decode(False)
        comm.arm_pinned_decode(DECODE_SLOT_PARAMS)                            # no-op when off
        b = comm.all_reduce_tensors([torch.full((2,), 10.0 + comm.rank)])
        return a, b

    with FakeCohort(2) as cohort:
        results = cohort.run(rank)
    for r, (a, b) in enumerate(results):
        assert a[0].tolist() == [0.5, 0.5] and b[0].tolist() == [10.5, 10.5], f"rank {r}"
        assert a[0].data_ptr() != b[0].data_ptr()


def test_an_in_place_round_takes_the_arm_and_a_later_reply_is_fresh():
    """The arm is one shot on the next MODEL round: an in-place all_reduce_ used to leave
    it standing (through a barrier too), so a later unarmed reply landed in the slot and
    overwrote the earlier armed result the caller still held."""
    def rank(comm):
        comm.set_pinned_decode(True)
        comm.arm_pinned_decode(DECODE_SLOT_BUFFERS)
        b = comm.all_reduce_tensors([torch.full((4,), 2.0)])[0]  # in the slot
        comm.arm_pinned_decode(DECODE_SLOT_BUFFERS)
        comm.all_reduce_([torch.ones(4)])  # takes the arm: its reply is the tensor
        comm.barrier()
        x = comm.all_reduce_tensors([torch.full((4,), 7.0)])[0]  # not armed
        return b.tolist(), x.tolist(), b.data_ptr() == x.data_ptr()

    with FakeCohort(2) as cohort:
        for b, x, same in cohort.run(rank):
            assert b == [2.0] * 4 and x == [7.0] * 4 and not same


def test_pinned_decode_slots_do_not_collide_on_identical_schemas():
    """A BatchNorm-style buffers frame can carry the params frame's exact shape
    list; a schema-keyed cache would decode buffers into the params staging while
    the params consensus is unconsumed. Caller-tagged slots keep them apart."""
    def rank(comm):
        p, b = {0: (2.0, 100.0), 1: (4.0, 200.0)}[comm.rank]
        comm.set_pinned_decode(True)
        comm.arm_pinned_decode(DECODE_SLOT_PARAMS)
        params = comm.all_reduce_scaled([torch.tensor([p])], 1.0, RoundKind.MODEL, 1.0)[0]
        comm.arm_pinned_decode(DECODE_SLOT_BUFFERS)                           # same schema
        buffers = comm.all_reduce_scaled([torch.tensor([b])], 1.0, RoundKind.MODEL, 1.0)[0]
        return params, buffers

    with FakeCohort(2) as cohort:
        results = cohort.run(rank)
    for r, (params, buffers) in enumerate(results):
        assert buffers[0].tolist() == [150.0], f"rank {r} buffers consensus"
        # Would read 150.0 if both rounds shared one staging set.
        assert params[0].tolist() == [3.0], f"rank {r} params survive the buffers decode"
        assert params[0].data_ptr() != buffers[0].data_ptr()


def test_pinned_decode_bf16_wire_upcasts_into_staging():
    """bf16 wire + pinned decode: the payload is upcast straight into the f32
    staging and the returned tensors are f32 views of it. Values are bf16-exact."""
    def rank(comm):
        vals = {0: [2.0, 8.0], 1: [4.0, 16.0]}[comm.rank]
        comm.set_bf16_wire(True)
        comm.set_pinned_decode(True)
        comm.arm_pinned_decode(DECODE_SLOT_PARAMS)
        first = comm.all_reduce_scaled([torch.tensor(vals)], 1.0, RoundKind.MODEL, 1.0)[0]
        first_vals = first[0].tolist()
        comm.arm_pinned_decode(DECODE_SLOT_PARAMS)
        again = comm.all_reduce_scaled([torch.tensor(vals) * 2], 1.0, RoundKind.MODEL, 1.0)[0]
        return first_vals, first, again

    with FakeCohort(2) as cohort:
        results = cohort.run(rank)
    for r, (first_vals, first, again) in enumerate(results):
        assert first[0].dtype == torch.float32, f"rank {r} staging decode returns f32"
        assert first_vals == [3.0, 12.0], f"rank {r} consensus"
        assert again[0].tolist() == [6.0, 24.0] == first[0].tolist(), f"rank {r} aliasing"
