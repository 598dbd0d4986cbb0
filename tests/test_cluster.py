"""Multi-host cohorts on loopback: relays, the controller, authentication, failures.

Each "host" is a spawn group with its own arena and relay, all talking to one
ClusterController on 127.0.0.1. Ports of the seed's relay-path tests plus the
handshake refusals, tampering, host loss and stalls.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
import torch

from flodl_shm import (DECODE_SLOT_BUFFERS, DECODE_SLOT_PARAMS, ClusterController, FrameError,
                       RoundFrame, RoundKind, ReduceStall, gamma_mass, mover_mass, spawn,
                       sumcount_reduce)
from flodl_shm.frame import DTYPE_F32, TensorPayload
from flodl_shm.cluster.link import HandshakeRejected, Kind

from cluster_util import (SALT, HostProcess, join_raw, kill_a_host_mid_run, quick_average,
                          run_hosts)
from engine_util import assert_no_leaks

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def _no_leaks():
    """After each test: no shared-memory segment of ours and no rank process left."""
    yield
    assert_no_leaks(10)


def frame_with(values, weight=1.0):
    return RoundFrame([TensorPayload(DTYPE_F32, (len(values),), np.asarray(values, np.float32))],
                      weight)


# --- rank functions -----------------------------------------------------------------------

def two_rank_frames(ctx):
    vals = {0: [[2.0, 4.0, 6.0], [1.0], [5.0], [9.0]], 1: [[4.0, 8.0, 12.0], [3.0], [7.0], [11.0]]}
    out = []
    for v in vals[ctx.rank]:
        r = ctx.comm.all_reduce(frame_with(v))
        out.append((r.tensors[0].as_array().tolist(), r.weight))
    return out


def tensor_average(ctx, bf16):
    ctx.comm.set_bf16_wire(bf16)
    t = torch.tensor([2.0, 4.0, 6.0]) * (ctx.rank + 1)
    big = torch.full((70000,), float(ctx.rank + 1))
    out = ctx.comm.all_reduce_tensors([t, big])
    return out[0].tolist(), out[0].dtype, float(out[1][0]), float(out[1][-1])


def scaled_bf16(ctx):
    ctx.comm.set_bf16_wire(True)
    vals, w = ([2.0, 8.0], 3.0) if ctx.rank == 0 else ([4.0, 16.0], 1.0)
    (t,), mass = ctx.comm.all_reduce_scaled([torch.tensor(vals)], w, RoundKind.MODEL, w)
    return t.tolist(), mass


def broadcasts(ctx):
    vals = {0: [1.5, 2.5, 3.5], 1: [10.0, 20.0, 30.0], 2: [100.0, 200.0, 300.0]}
    one = ctx.comm.broadcast_from_root([torch.tensor(vals[ctx.rank])], 0)
    w = torch.arange(1.0, 7.0).reshape(2, 3) if ctx.rank == 0 else torch.full((2, 3), 9.0)
    b = torch.tensor([-1.0, -2.0, -3.0, -4.0]) if ctx.rank == 0 else torch.full((4,), 9.0)
    two = ctx.comm.broadcast_from_root([w, b], 0)
    return one[0].tolist(), [t.tolist() for t in two], [tuple(t.shape) for t in two]


def window_round(comm, n_i, value, gamma):
    counts = np.zeros(comm.world_size)
    counts[comm.rank] = n_i
    counts = comm.all_reduce_per_rank_f64(counts)
    w = gamma_mass(n_i, gamma)
    t = torch.tensor([value])
    adopted = float(sumcount_reduce(comm, [t], w, DECODE_SLOT_PARAMS)[0][0])
    (raw,), _ = comm.all_reduce_weighted([t * w], RoundKind.MODEL, w)
    return counts.tolist(), adopted, float(raw[0])


def realized_all_alive(ctx):
    n, v = {0: (3, 1.0), 1: (5, 2.0), 2: (2, 3.0)}[ctx.rank]
    return window_round(ctx.comm, n, v, 1.0)


def realized_after_death(ctx):
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    n, v, b = {0: (3, 1.0, 1.0), 1: (5, 2.0, 2.0)}[ctx.rank]
    g1 = window_round(ctx.comm, n, v, 1.0)
    buf = float(sumcount_reduce(ctx.comm, [torch.tensor([b])], mover_mass(n),
                                DECODE_SLOT_BUFFERS)[0][0])
    g_half = window_round(ctx.comm, n, v, 0.5)
    return g1, buf, g_half


def dies_between_the_count_gather_and_the_params_round(ctx):
    """A Trainer-like window on hosts [1, 2]: rank 2 (host B) joins the count gather,
    then dies; what each surviving rank would credit."""
    from flodl_shm import LocalSGD
    from flodl_shm.training.sync_window import (accepted_across_hosts, falls_short,
                                                gather_counts)

    model = torch.nn.Linear(2, 1)
    sgd = LocalSGD(model, sync_every=None, comm=ctx.comm)
    for _ in range(2):
        sgd.step(1)
    counts = gather_counts(ctx.comm, 2, 1.0)
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    sync = sgd.sync()
    short = falls_short(sync.mass, counts, 1.0)
    return sync.accepted, short, accepted_across_hosts(ctx.comm, sync.accepted)


def rank_dies_mid_run(ctx):
    out = []
    for i in range(4):
        if ctx.rank == 3 and i == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        (t,), mass = ctx.comm.all_reduce_scaled([torch.full((40000,), float(ctx.rank + i))], 1.0,
                                               RoundKind.MODEL, 1.0)
        g = np.zeros(ctx.world_size)
        g[ctx.rank] = 1.0
        out.append((float(t[0]), float(t[-1]), mass, ctx.comm.all_reduce_per_rank_f64(g).tolist()))
    return out


def stall_on_host_one(ctx):
    ctx.comm.barrier()
    if ctx.rank == 1:
        time.sleep(120.0)  # hung: its host learns the verdict from the controller
    ctx.comm.barrier()
    return "finished"


# --- seed ports ----------------------------------------------------------------------------

def test_two_rank_average_and_multi_round_persistence():
    out, errors, ctl = run_hosts(two_rank_frames, [1, 1])
    assert not errors
    want = [([3.0, 6.0, 9.0], 2.0), ([2.0], 2.0), ([6.0], 2.0), ([10.0], 2.0)]
    assert out[0][0] == want and out[1][0] == want
    assert ctl.error is None and ctl.stats.rounds == 4


@pytest.mark.parametrize("bf16", [False, True])
def test_tensor_average_over_three_hosts(bf16):
    out, errors, _ = run_hosts(tensor_average, [2, 1, 1], args=(bf16,))
    assert not errors
    for host in out:
        for vals, dtype, first, last in host:
            assert dtype == torch.float32
            assert vals == [5.0, 10.0, 15.0]  # mean of 1..4 times [2,4,6]
            assert first == last == 2.5


def test_scaled_weighted_average_bf16_wire():
    out, errors, _ = run_hosts(scaled_bf16, [1, 1])
    assert not errors
    for host in out:
        assert host[0] == ([2.5, 10.0], 4.0)


def test_broadcast_from_root_three_ranks_and_distinct_shapes():
    out, errors, _ = run_hosts(broadcasts, [1, 2])
    assert not errors
    for host in out:
        for one, two, shapes in host:
            assert one == [1.5, 2.5, 3.5]
            assert shapes == [(2, 3), (4,)]
            assert two == [[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], [-1.0, -2.0, -3.0, -4.0]]


def test_realized_work_all_alive_is_1_9():
    out, errors, _ = run_hosts(realized_all_alive, [2, 1])
    assert not errors
    for host in out:
        for counts, adopted, raw in host:
            assert counts == [3.0, 5.0, 2.0]
            assert abs(adopted - 1.9) < 1e-6 and abs(raw - 1.9) < 1e-6


def test_realized_work_after_a_death_on_another_host():
    out, errors, ctl = run_hosts(realized_after_death, [2, 1], max_failures=1)
    assert not errors
    assert out[1] == [None]
    want_half = (math.sqrt(3) + 2 * math.sqrt(5)) / (math.sqrt(3) + math.sqrt(5))
    for (counts, adopted, raw), buf, (_, adopted_h, _) in out[0]:
        assert counts == [3.0, 5.0, 0.0]
        assert abs(adopted - 1.625) < 1e-6 and abs(raw - 1.625) < 1e-6
        assert abs(buf - 1.5) < 1e-6
        assert abs(adopted_h - want_half) < 1e-5
    assert ctl.dead_ranks.is_dead(2) and ctl.dead_ranks.alive() == [0, 1]


def test_a_window_that_falls_short_credits_the_same_ranks_on_every_host():
    """A rank that died between the count gather and the params round: each host knew
    only which of its own ranks the round accepted, so host A credited rank 0 and host B
    rank 1 for the same window, and their coverage and checkpoint metadata split (a
    resume then planned different windows per host and failed). One more gather gives
    every host the same set."""
    out, errors, ctl = run_hosts(dies_between_the_count_gather_and_the_params_round, [1, 2],
                                 max_failures=1)
    assert not errors, errors
    assert out[1][1] is None  # rank 2
    (here_a, short_a, all_a), = out[0]
    here_b, short_b, all_b = out[1][0]
    assert (here_a, here_b) == ((0,), (1,))  # each host's own view
    assert short_a and short_b
    assert all_a == all_b == (0, 1)


def test_ranks_dead_before_the_cohort_is_complete_stay_dead():
    """Host B's only rank dies before host A has joined, so host B's supervisor reports
    the death and leaves before the cohort is complete. The controller keeps rank 2
    claimed and dead (instead of freeing it for a relaunch that never comes), so host A
    runs the rounds on realized work, as when the death comes later. Under load the
    test above ran into this order by chance (host A then waited 120 s for rank 2)."""
    ctl = ClusterController.start("127.0.0.1:0", 3, SALT, round_timeout=60.0)

    def host(nprocs: int, first: int):
        return spawn(realized_after_death, nprocs, (), controller=f"127.0.0.1:{ctl.port}",
                     world_size=3, first_rank=first, salt=SALT, timeout=60.0, max_failures=1)

    out: dict = {}
    b = HostProcess(lambda: host(1, 2), "b")
    try:
        deadline = time.monotonic() + 60.0
        while not ctl.dead_ranks.is_dead(2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctl.dead_ranks.is_dead(2), "host B's dead rank was forgotten, not counted"
        assert b.join(60.0) == (True, [None])
        _, out["a"] = HostProcess(lambda: host(2, 0), "a").join(120.0)
    finally:
        b.kill()
        ctl.shutdown()
    assert not isinstance(out["a"], BaseException), out["a"]
    want_half = (math.sqrt(3) + 2 * math.sqrt(5)) / (math.sqrt(3) + math.sqrt(5))
    for (counts, adopted, raw), buf, (_, adopted_h, _) in out["a"]:
        assert counts == [3.0, 5.0, 0.0]
        assert abs(adopted - 1.625) < 1e-6 and abs(raw - 1.625) < 1e-6
        assert abs(buf - 1.5) < 1e-6
        assert abs(adopted_h - want_half) < 1e-5
    assert ctl.dead_ranks.alive() == [0, 1]
    assert_no_leaks()


def test_a_rank_dying_mid_run_is_excluded_cohort_wide():
    out, errors, ctl = run_hosts(rank_dies_mid_run, [2, 2], max_failures=1)
    assert not errors
    assert out[1][1] is None
    survivors = [out[0][0], out[0][1], out[1][0]]
    assert survivors[0] == survivors[1] == survivors[2], "survivors disagree"
    res = survivors[0]
    assert res[0][:3] == (1.5, 1.5, 4.0) and res[1][:3] == (2.5, 2.5, 4.0)
    assert res[2][:3] == (3.0, 3.0, 3.0) and res[3][:3] == (4.0, 4.0, 3.0)
    assert res[3][3] == [1.0, 1.0, 1.0, 0.0]
    assert ctl.dead_ranks.is_dead(3)


# --- validation and authentication --------------------------------------------------------

def test_handshake_refusals_are_named_on_both_ends(caplog):
    ctl = ClusterController.start("127.0.0.1:0", 3, SALT)
    try:
        with pytest.raises(HandshakeRejected, match="world_size 4 != the controller's world_size 3"):
            join_raw(ctl.port, {"host": "a", "ranks": [0], "world_size": 4})
        with pytest.raises(HandshakeRejected, match=r"ranks \[3\] are out of range"):
            join_raw(ctl.port, {"host": "b", "ranks": [2, 3], "world_size": 3})
        first = join_raw(ctl.port, {"host": "c", "ranks": [0, 1], "world_size": 3})
        with pytest.raises(HandshakeRejected, match="overlapping rank sets"):
            join_raw(ctl.port, {"host": "d", "ranks": [1, 2], "world_size": 3})
        with pytest.raises(HandshakeRejected, match="duplicate host"):
            join_raw(ctl.port, {"host": "c", "ranks": [2], "world_size": 3})
        # the same name AND the same ranks (a demo host started twice with one
        # --first-rank: its name holds its ranks) is an overlap, said as one
        with pytest.raises(HandshakeRejected, match=r"ranks \[0, 1\] are already carried by "
                                                    r"host 'c' \(overlapping rank sets\): give "
                                                    r"each host its own ranks \(--first-rank\)"):
            join_raw(ctl.port, {"host": "c", "ranks": [0, 1], "world_size": 3})
        with pytest.raises(FrameError, match="failed to prove the session secret"):
            join_raw(ctl.port, {"host": "e", "ranks": [2], "world_size": 3},
                       salt=b"\x00" * 16)
        first.close()
    finally:
        ctl.shutdown()
    logged = caplog.text
    assert "world_size 4" in logged and "overlapping" in logged and "duplicate host" in logged


def test_hello_ack_says_which_outer_optimizer_the_controller_steps_and_where_it_starts():
    """A controller tells each admitted host the outer optimizer it steps (none, or
    Nesterov with its lr and momentum), so ranks built with another can refuse; one
    that steps a stateful outer optimizer also says where its momentum starts (fresh:
    -1, or the sync round of the checkpoint it loaded), so resuming ranks can refuse
    another round's. With no outer step, or a momentum loaded without its round, there
    is no start to check and that field is absent."""
    from flodl_shm import OuterNesterov

    momentum = [torch.zeros(3)]
    setups = {
        "plain average": {},
        "fresh momentum": {"outer": OuterNesterov(0.7, 0.9)},
        "round 8": {"outer": OuterNesterov(0.7, 0.9), "outer_momentum": momentum,
                    "outer_round": 8},
        "unknown round": {"outer": OuterNesterov(0.7, 0.9), "outer_momentum": momentum},
    }
    starts, outers = {}, {}
    for name, kw in setups.items():
        ctl = ClusterController.start("127.0.0.1:0", 2, SALT, **kw)
        try:
            acks = []
            join_raw(ctl.port, {"host": "a", "ranks": [0], "world_size": 2},
                     on_ack=acks.append).close()
            starts[name] = acks[0].get("outer_start_round", "absent")
            outers[name] = acks[0]["outer"]
        finally:
            ctl.shutdown()
    assert starts == {"plain average": "absent", "fresh momentum": -1, "round 8": 8,
                      "unknown round": "absent"}
    nesterov = {"kind": "nesterov", "lr": 0.7, "momentum": 0.9}
    assert outers == {"plain average": {"kind": "none"}, "fresh momentum": nesterov,
                      "round 8": nesterov, "unknown round": nesterov}


def test_world_size_disagreement_refused_through_spawn():
    ctl = ClusterController.start("127.0.0.1:0", 2, SALT)
    try:
        ok, err = HostProcess(lambda: spawn(
            quick_average, 1, controller=f"127.0.0.1:{ctl.port}", world_size=3, first_rank=0,
            salt=SALT, timeout=30)).join(60.0)
    finally:
        ctl.shutdown()
    assert not ok and isinstance(err, ConnectionError) and "world_size 3" in str(err), err


def test_local_validation_happens_before_any_traffic():
    with pytest.raises(ValueError, match="do not fit world_size"):
        spawn(quick_average, 2, controller="127.0.0.1:1", world_size=3, first_rank=2, salt=SALT)
    with pytest.raises(ValueError, match="salt"):
        spawn(quick_average, 1, controller="127.0.0.1:1", world_size=2, first_rank=0)
    for world in (0, (1 << 16) + 1):  # (a probe's 99999999999: MemoryError, a traceback)
        with pytest.raises(ValueError, match=rf"world_size must be from 1 to 65,536 \(the "
                                             rf"most ranks a cohort holds\), got {world}"):
            ClusterController.start("127.0.0.1:0", world, SALT)
    with pytest.raises(ValueError, match=r"spawn: world_size=70000 is more than a cohort "
                                         r"holds \(65,536 ranks\)"):
        spawn(quick_average, 1, controller="127.0.0.1:1", world_size=70000, salt=SALT)


def test_connect_failure_names_the_address(monkeypatch, caplog):
    """And says so at the first refusal: a probe's host, given a wrong port, printed
    nothing for minutes while its relay retried."""
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.1")
    with caplog.at_level(logging.WARNING, logger="flodl_shm"), \
            pytest.raises(ConnectionError, match=r"could not connect to 127\.0\.0\.1:1 within"):
        spawn(quick_average, 1, controller="127.0.0.1:1", world_size=2, first_rank=0, salt=SALT,
              timeout=60)
    said = [r.getMessage() for r in caplog.records if "not reachable yet" in r.getMessage()]
    assert len(said) == 1 and "the controller at 127.0.0.1:1 is not reachable yet" in said[0]
    assert "trying again for up to" in said[0], said


def test_a_stop_ends_the_connect_retries_at_once():
    """A probe's SIGTERM took 11 s to end a host whose relay was retrying a wrong port:
    the retries slept through the stop (and the launcher's two 5 s joins waited)."""
    from flodl_shm.cluster.link import connect

    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(ConnectionAbortedError, match="stopped while connecting to 127.0.0.1:1"):
        connect("127.0.0.1:1", attempts=200, delay=0.5, stop=stop)
    assert time.monotonic() - t0 < 3.0


def test_the_connect_retries_end_when_they_said_they_would():
    """A listener whose accept queue is full drops the connects, so each took the 10 s
    handshake deadline to fail: a probe's relay said 'trying again for up to 14 s' and
    went on for 57 s, until the ranks' own timeout blamed a silent relay."""
    from flodl_shm.cluster.link import connect

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    try:
        for _ in range(3):  # the queue's one place taken, the rest dropped
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            queued.append(c)
        said = []
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"could not connect to 127.0.0.1:{port} "
                                                  rf"within 3 s \(\d attempts?; the last: "):
            connect(("127.0.0.1", port), attempts=7, delay=0.5,
                    on_wait=lambda e, s: said.append(s))
        took = time.monotonic() - t0
    finally:
        for c in queued:
            c.close()
        listener.close()
    assert said == [3.0]
    assert took < 4.5, took


def test_controller_survives_silence_garbage_and_a_tampered_frame(monkeypatch):
    """A silent connection, garbage bytes and a host whose frame fails its tag are all
    dropped; the real host's round completes over realized work (the tampered host's
    contribution is never mixed in)."""
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.2")  # 2 s handshake deadline
    ctl = ClusterController.start("127.0.0.1:0", 2, SALT)
    try:
        silent = socket.create_connection(("127.0.0.1", ctl.port))
        garbage = socket.create_connection(("127.0.0.1", ctl.port))
        garbage.sendall(os.urandom(4096))
        fake = join_raw(ctl.port, {"host": "fake", "ranks": [1], "world_size": 2})

        # the tampered host is declared dead: one failure of the cohort's budget
        real_host = HostProcess(lambda: spawn(
            quick_average, 1, controller=f"127.0.0.1:{ctl.port}", world_size=2, first_rank=0,
            salt=SALT, timeout=60, max_failures=1), "real")
        frame = frame_with([1000.0, 1000.0, 1000.0])
        frame.kind = RoundKind.MODEL
        # a valid record header with a frame whose payload was altered after tagging
        import flodl_shm.cluster.link as mux

        orig = mux.write_round_frame

        def tamper(stream, fr, salt, *, tag=None):
            fr.tensors[0].data = memoryview(np.array([7.0, 7.0, 7.0], np.float32)).cast("B")
            return orig(stream, fr, salt, tag=tag)

        monkeypatch.setattr(mux, "write_round_frame", tamper)
        fake.send_frame(Kind.FRAME_UP, frame)
        monkeypatch.setattr(mux, "write_round_frame", orig)
        assert real_host.join(120) == (True, [[0.0, 0.0, 0.0]]), \
            "the tampered contribution leaked in"
        assert ctl.dead_ranks.is_dead(1)
        silent.close()
        garbage.close()
        fake.close()
    finally:
        ctl.shutdown()


# --- host loss and stalls -------------------------------------------------------------------

def test_a_whole_host_vanishing_is_excluded(tmp_path):
    """Host 1 runs in its own launcher process; we SIGKILL that launcher. Its rank dies
    with it (PDEATHSIG), the controller declares it dead, and host 0 continues alone
    (its max_failures=1 covers the lost rank)."""
    box, ctl = kill_a_host_mid_run(tmp_path, max_failures=1)
    assert box.get("out") == [(0.5, 2.0), (0.5, 2.0)], box
    assert box["dead"] == [2], "the launcher names the lost host's ranks"
    assert ctl.dead_ranks.is_dead(2) and ctl.dead_ranks.alive() == [0, 1]


@pytest.mark.parametrize("round_timeout,timeout", [(1.5, 60.0), (60.0, 0.5)],
                         ids=["controller-timeout", "ranks-timeout"])
def test_stall_reaches_every_rank_with_round_and_missing_ranks(round_timeout, timeout):
    """The controller times the round by the smaller of its round_timeout and the
    deadline each host announces (its collective timeout + half the launcher's stall
    grace: after a local culprit is fenced, before the ranks give up); every rank's
    ReduceStall names rank 1, never "relay". The host of the hung rank (alone there, so
    no local fencing) reads the verdict while waiting for it and stops it: spawn
    returns long before the rank would wake."""
    from flodl_shm.launch import stall_grace

    out, errors, ctl = run_hosts(stall_on_host_one, [1, 1], round_timeout=round_timeout,
                                 timeout=timeout, join_timeout=60.0)
    assert set(errors) == {0, 1}
    want = min(round_timeout, timeout + stall_grace(timeout) / 2)
    for e in errors.values():
        assert isinstance(e, ReduceStall), repr(e)
        assert e.round == 1 and e.missing == (1,), e.missing
        assert e.timeout == want
        assert "round 1" in str(e)
    assert isinstance(ctl.error, ReduceStall) and ctl.error.missing == (1,)


# --- the training runtime's cluster side: outer optimizer and checkpoints at the controller

OUTER_SHAPES = [(40, 3), (3,), (500,)]


def outer_params(rank, window):
    g = torch.Generator().manual_seed(100 * rank + window)
    return [torch.randn(s, generator=g) for s in OUTER_SHAPES]


def outer_and_checkpoint(ctx, path):
    from flodl_shm import CheckpointMeta, ModelSchema, OuterNesterov, SaveReason

    ctx.comm.set_outer(OuterNesterov(0.7, 0.9))
    schema = ModelSchema([f"w{i}" for i in range(len(OUTER_SHAPES))], ["buf"])
    got = []
    for w in range(3):
        if w == 2:
            ctx.comm.arm_checkpoint(path, schema,
                                    CheckpointMeta.new(0, 6, 3, ctx.world_size, SaveReason.CHECKPOINT))
        p = sumcount_reduce(ctx.comm, outer_params(ctx.rank, w), 1.0, DECODE_SLOT_PARAMS,
                            outer=True)
        b = sumcount_reduce(ctx.comm, [torch.full((4,), float(ctx.rank))], 1.0, DECODE_SLOT_BUFFERS)
        got.append(([t.clone() for t in p], b[0].clone()))
    return got


def rounds_of_values(ctx):
    """Three rounds of one schema, each rank contributing 10·rank + round."""
    out = []
    for k in range(3):
        (t,), mass = ctx.comm.all_reduce_scaled([torch.full((4,), 10.0 * ctx.rank + k)], 1.0,
                                               RoundKind.MODEL, 1.0)
        out.append((t.tolist(), mass))
    return out


def test_the_first_round_waits_for_a_host_still_finishing_its_handshake(monkeypatch):
    """Host 0's handshake thread is held between its acknowledgement and joining the
    cohort while host 1 joins: every rank is claimed, yet host 0 is not a member yet.
    The cohort is complete only once both are, so round 0 takes both frames (and every
    round its own: before, host 0's round-k frame went into round k+1 and both hosts got
    a wrong consensus, silently when the rounds share a schema)."""
    from flodl_shm.cluster import admission

    real = admission.server_handshake
    host0_admitted = threading.Event()

    def held_handshake(sock, salt, peer, admit, ack=None):
        link, hello = real(sock, salt, peer, admit, ack)
        if 0 in hello["ranks"]:
            host0_admitted.set()
            time.sleep(1.0)  # this thread descheduled right after the ack
        else:
            host0_admitted.wait(30)
        return link, hello

    monkeypatch.setattr(admission, "server_handshake", held_handshake)
    out, errors, ctl = run_hosts(rounds_of_values, [1, 1], join_timeout=60.0, timeout=20.0,
                                 round_timeout=20.0)
    assert not errors, errors
    for host in out:
        assert host[0] == [([5.0 + k] * 4, 2.0) for k in range(3)], host[0]
    assert ctl.error is None


def test_outer_step_and_checkpoint_at_the_controller(tmp_path):
    """On a cluster the controller steps the outer optimizer once on the whole params
    frame and its forge writes the checkpoint a rank armed (model, momentum, meta)."""
    from flodl_shm import CheckpointMeta, OuterNesterov
    from flodl_shm.checkpoint.fdl import read_fdl
    from flodl_shm.checkpoint.meta import CheckpointBundle

    path = str(tmp_path / "cluster.fdl")
    out, errors, ctl = run_hosts(outer_and_checkpoint, [1, 1], args=(path,),
                                 controller_kwargs={"outer": OuterNesterov(0.7, 0.9)})
    assert not errors
    assert ctl.forge is not None and ctl.forge.flush(60)
    ref = OuterNesterov(0.7, 0.9)
    prev = None
    for w in range(3):
        cons = [(a + b) * np.float32(0.5) for a, b in zip(outer_params(0, w), outer_params(1, w))]
        new = ref.outer_step(cons if prev is None else prev, cons)
        prev = new
        for host in out:
            params, buf = host[0][w]
            for g, r in zip(params, new):
                assert torch.equal(g, r), f"window {w}: the controller's outer step differs"
            assert buf.tolist() == [0.5] * 4
    entries = read_fdl(path).by_name()
    for i, t in enumerate(prev):
        assert np.array_equal(entries[f"p{i}"].to_numpy(), t.numpy())
    assert entries["b0"].to_numpy().tolist() == [0.5] * 4
    mom = read_fdl(str(tmp_path / "cluster.outer.fdl")).by_name()
    for i, v in enumerate(ref.checkpoint_state()):
        assert np.array_equal(mom[f"p{i}"].to_numpy(), v.numpy())
    meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(path))
    assert (meta.global_step, meta.sync_round, meta.world_size_at_save) == (6, 3, 2)


def outer_without_controller_support(ctx):
    from flodl_shm import OuterNesterov

    ctx.comm.set_outer(OuterNesterov())
    return sumcount_reduce(ctx.comm, [torch.ones(5)], 1.0, DECODE_SLOT_PARAMS, outer=True)


def test_an_outer_step_the_controller_cannot_run_is_refused_loudly():
    out, errors, ctl = run_hosts(outer_without_controller_support, [1, 1])
    assert set(errors) == {0, 1}
    for e in errors.values():
        assert "outer" in str(e) and "--outer nesterov" in str(e), str(e)
    assert ctl.error is not None and "outer" in str(ctl.error)


def shapes_by_host(ctx):
    """Host 0's rank reduces a float32 [10] and a bfloat16 [3, 2]; host 1's a float32 [12]
    in their place: one model on each, as two hosts given different models would."""
    ts = ([torch.ones(10), torch.ones(3, 2, dtype=torch.bfloat16)] if ctx.rank == 0
          else [torch.ones(12), torch.ones(3, 2, dtype=torch.bfloat16)])
    return ctx.comm.all_reduce_tensors(ts)


def test_hosts_that_reduce_different_shapes_are_told_both_in_words(caplog):
    """Hosts whose ranks made different calls read "host 'h:1-1' sent a frame of schema
    (<RoundKind.MODEL: 0>, ((0, (12,)), (0, (3, 2)))) but the round's first frame had
    ...": Python's repr of the schema, and no word of which host sent the first. The
    controller's own line said "reduce loop failed"."""
    caplog.set_level(logging.ERROR, logger="flodl_shm")
    out, errors, ctl = run_hosts(shapes_by_host, [1, 1], timeout=20.0)
    assert set(errors) == {0, 1}, out
    said = str(ctl.error)
    for e in errors.values():
        assert said in str(e), (said, str(e))
    # (which host's frame the controller read first depends on their timing)
    me = socket.gethostname()  # (a host's name: this machine's and its ranks)
    lines = {f"host '{me}:0-0': MODEL round, 2 tensors f32 shapes [10], [3,2]",
             f"host '{me}:1-1': MODEL round, 2 tensors f32 shapes [12], [3,2]"}
    head, *rest = said.split("\n  ")
    assert head == ("round 0: the hosts' ranks made different collective calls (every rank "
                    "must make the same calls, with the same shapes and bf16_wire setting):")
    assert set(rest) == lines, said
    assert f"controller: the cohort ended: {said}" in caplog.text


def one_outer_round(ctx):
    from flodl_shm import OuterNesterov

    ctx.comm.set_outer(OuterNesterov())
    return sumcount_reduce(ctx.comm, [torch.ones(5)], 1.0, DECODE_SLOT_PARAMS, outer=True)


def test_outer_momentum_of_another_model_is_refused_not_replaced_by_fresh_momentum():
    """A controller given the momentum of another model (--outer-state of another run)
    started from fresh momentum instead, silently, under a resume that had asked for it."""
    from flodl_shm import OuterNesterov

    out, errors, ctl = run_hosts(one_outer_round, [1, 1], controller_kwargs=dict(
        outer=OuterNesterov(), outer_momentum=[torch.zeros(7)]))
    assert set(errors) == {0, 1}, (out, errors)
    for e in errors.values():
        assert "holds 7 values and the model's parameters 5" in str(e), str(e)
    assert ctl.error is not None and "another model" in str(ctl.error)
