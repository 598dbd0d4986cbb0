"""Faults of a multi-host cohort (docs/failure-model.md, "Several hosts").

Connection floods (with few file descriptors and beyond the pending-handshake
cap), a wrong secret named on both ends, a host leaving before the cohort forms, a
host that never joins,
a lost host counted against ``max_failures``, a host that says why it stops, frames above
the frame ceiling, and the ``controller`` command's start-up errors.
"""
from __future__ import annotations

import logging
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from flodl_shm import (ClusterController, FrameError, RankFailed, ReduceStall, StartRefused,
                       spawn)
from flodl_shm.cluster import wire
from flodl_shm.errors import plural
from flodl_shm.cluster.link import HandshakeRejected, Kind, split_frame
from flodl_shm.cluster.secret import write_secret_file
from flodl_shm.frame import DTYPE_BF16, DTYPE_F32, RoundFrame, RoundKind, TensorPayload

from cluster_util import (SALT, HostProcess, join_hosts, join_raw, kill_a_host_mid_run,
                          loop_forever, quick_average, run_hosts)
from engine_util import assert_no_leaks

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
    assert_no_leaks(10)


def _hello(host, ranks, world):
    return {"host": host, "ranks": ranks, "world_size": world}


def _await_hosts(ctl, names, timeout=10.0):
    """Wait until the controller's registered hosts are ``names`` (sorted)."""
    deadline = time.monotonic() + timeout
    while sorted(h[0] for h in ctl.hosts()) != names and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(h[0] for h in ctl.hosts()) == names, ctl.hosts()


# --- connection floods ---------------------------------------------------------------------

def _start_cli(tmp_path, world, nofile=None):
    """``python -m flodl_shm controller`` in a subprocess (optionally with a lowered
    RLIMIT_NOFILE); returns (process, port, log path)."""
    secret = tmp_path / "secret.hex"
    write_secret_file(secret, SALT)
    port_file = tmp_path / "port.txt"
    log = tmp_path / "controller.log"

    def lower_limit():
        if nofile is not None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

    proc = subprocess.Popen(
        [sys.executable, "-m", "flodl_shm", "controller", "--bind", "127.0.0.1:0",
         "--world-size", str(world), "--secret-file", str(secret), "--port-file",
         str(port_file)], stdout=open(log, "w"), stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, preexec_fn=lower_limit)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if port_file.exists() and port_file.read_text().strip():
            return proc, int(port_file.read_text()), log
        time.sleep(0.05)
    proc.kill()
    proc.wait(10)
    raise AssertionError(f"the controller did not start: {log.read_text()}")


def _flood(port, n) -> list[socket.socket]:
    """``n`` idle connections (non-blocking connects), waited until the kernel
    established each (they are all in or past the accept queue)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    deadline = time.monotonic() + 60
    waiting = list(socks)
    while waiting and time.monotonic() < deadline:
        _, ready, _ = select.select([], waiting, [], 0.5)
        waiting = [s for s in waiting if s not in ready]
    return socks


@pytest.mark.parametrize("nofile,flood", [(40, 150), (None, 200)],
                         ids=["out-of-descriptors", "beyond-the-pending-cap"])
def test_a_connection_flood_does_not_disable_the_controller(tmp_path, monkeypatch, nofile, flood):
    """Idle connections past the descriptor limit (EMFILE) or past the cap of pending
    handshakes: the controller keeps accepting, drops the oldest, says so, and a
    real host still completes its handshake."""
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.5")  # the host gives up after 5 s
    proc, port, log = _start_cli(tmp_path, 1, nofile)
    socks = []
    try:
        socks = _flood(port, flood)
        link = join_raw(port, _hello("real", [0], 1))
        link.close()
        proc.wait(30)  # the one-host cohort ends when its host leaves
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    text = log.read_text()
    assert "still accepting" in text, text
    if nofile is not None:
        assert "Too many open files" in text, text
    else:
        assert "more than 64 connections mid-handshake" in text, text
    assert text.count("listening") == 1, text
    # (a probe's flood: a line per connection, most of them EBADF from the controller's own
    # close of a socket its handshake thread still read)
    assert "Bad file descriptor" not in text, text
    assert text.count("dropped connection from") <= 2, text


def test_a_flood_of_garbage_connections_is_reported_not_repeated(caplog):
    """Port-scanner traffic (an HTTP request, random bytes, a connect and close): the
    first is named, the rest counted, and a real host still joins."""
    caplog.set_level(logging.WARNING, logger="flodl_shm")
    ctl = ClusterController.start("127.0.0.1:0", 1, SALT)
    try:
        for i in range(40):
            with socket.create_connection(("127.0.0.1", ctl.port)) as s:
                s.sendall([b"GET / HTTP/1.0\r\n\r\n", os.urandom(64), b""][i % 3])
        time.sleep(0.5)
        join_raw(ctl.port, _hello("real", [0], 1)).close()
        assert ctl.join(30)
    finally:
        ctl.shutdown()
    lines = [r.getMessage() for r in caplog.records]
    said = [m for m in lines if "dropped connection from" in m]
    assert 1 <= len(said) <= 2, lines
    assert len(lines) <= 4, lines
    # the rest counted, and the count said at the end (the flood's last seconds included)
    counts = [int(m.split()[1]) for m in lines if "failed handshakes dropped" in m]
    counts += [int(m.split("(")[-1].split()[0]) for m in said if "more like it" in m]
    assert len(said) + sum(counts) == 40, lines


def test_a_handshake_thread_that_cannot_start_costs_one_connection(caplog, monkeypatch):
    """Out of threads (a container's pids limit: a probe ran the controller under a tight
    address-space limit): the accept loop died on 'can't start new thread' and nothing
    was accepted again. Now that connection is closed, the failure said, and the next
    host joins."""
    import flodl_shm.cluster.controller as controller

    class OneFailedStart(threading.Thread):
        failures = 1

        def start(self):
            if self.name == "flodl-shm-controller-handshake" and OneFailedStart.failures:
                OneFailedStart.failures -= 1
                raise RuntimeError("can't start new thread")
            super().start()

    caplog.set_level(logging.WARNING, logger="flodl_shm")
    monkeypatch.setattr(controller.threading, "Thread", OneFailedStart)
    ctl = ClusterController.start("127.0.0.1:0", 1, SALT)
    try:
        with socket.create_connection(("127.0.0.1", ctl.port)) as first:
            first.settimeout(10)
            assert first.recv(1) == b""  # closed by the controller
        join_raw(ctl.port, _hello("real", [0], 1)).close()
        assert ctl.join(30)
    finally:
        ctl.shutdown()
    assert "no thread for a handshake (can't start new thread)" in caplog.text, caplog.text


def test_a_handshake_that_never_finishes_is_dropped_after_its_deadline(monkeypatch):
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.1")  # 1 s handshakes
    ctl = ClusterController.start("127.0.0.1:0", 1, SALT)
    try:
        idle = socket.create_connection(("127.0.0.1", ctl.port))
        idle.settimeout(10)
        t0 = time.monotonic()
        assert idle.recv(1) == b"", "the controller should close an idle pre-handshake link"
        assert time.monotonic() - t0 < 9
        idle.close()
    finally:
        ctl.shutdown()


# --- wrong secret --------------------------------------------------------------------------

def test_a_wrong_secret_is_named_on_the_controller_too(caplog):
    ctl = ClusterController.start("127.0.0.1:0", 2, SALT)
    try:
        with caplog.at_level(logging.ERROR, logger="flodl_shm"):
            with pytest.raises(FrameError, match="failed to prove the session secret"):
                join_raw(ctl.port, _hello("e", [0], 2), salt=b"\x01" * 16)
            deadline = time.monotonic() + 10
            while "different secrets" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        ctl.shutdown()
    assert "different secrets" in caplog.text and "peer closed" not in caplog.text, caplog.text


# --- a host that leaves before the cohort is complete --------------------------------------

def test_a_host_that_left_before_the_cohort_formed_is_forgotten():
    """Host A joins and leaves; B joins: the cohort must not complete with A's ranks
    claimed by a dead link, and A's relaunch (same name, same ranks) is admitted."""
    ctl = ClusterController.start("127.0.0.1:0", 2, SALT)
    try:
        a = join_raw(ctl.port, _hello("a", [0], 2))
        _await_hosts(ctl, ["a"])
        a.close()
        _await_hosts(ctl, [])  # forgotten
        b = join_raw(ctl.port, _hello("b", [1], 2))
        _await_hosts(ctl, ["b"])
        a2 = join_raw(ctl.port, _hello("a", [0], 2))  # the relaunch
        _await_hosts(ctl, ["a", "b"])
        with pytest.raises(HandshakeRejected, match="already complete"):
            join_raw(ctl.port, _hello("c", [1], 2))
        a2.close()
        b.close()
    finally:
        ctl.shutdown()


def test_the_lone_relaunched_host_waits_for_the_cohort_instead_of_training_alone():
    """A left after delivering a round's partial; then B joins: B must not train on
    its own ranks with A's declared dead; A's relaunch completes the cohort."""
    ctl = ClusterController.start("127.0.0.1:0", 2, SALT)
    hosts: list[HostProcess] = []
    try:
        a = join_raw(ctl.port, _hello("a", [0], 2))
        _await_hosts(ctl, ["a"])
        a.send_frame(Kind.FRAME_UP, RoundFrame([TensorPayload(DTYPE_F32, (3,),
                                                              np.zeros(3, np.float32))], 1.0))
        a.close()
        _await_hosts(ctl, [])

        def host(first):
            return spawn(quick_average, 1, controller=f"127.0.0.1:{ctl.port}",
                         world_size=2, first_rank=first, salt=SALT, timeout=60)

        hosts.append(HostProcess(lambda: host(1), "b"))
        time.sleep(1.0)
        assert not ctl.dead_ranks.dead(), "rank 0 was declared dead with its host forgotten"
        hosts.append(HostProcess(lambda: host(0), "a"))
        got = join_hosts(hosts, time.monotonic() + 120)
    finally:
        for h in hosts:
            h.kill()
        ctl.shutdown()
    assert got == [(True, [[0.5, 0.5, 0.5]])] * 2, got


def test_a_host_waiting_for_a_host_that_never_joins_is_told_why_and_freed(capfd):
    """Host 0 never joins (not started, refused): the host that did is told, once the
    deadline it announced passes, that round 0 stalled because ranks [0] never joined the
    cohort; its ranks stop with that reason (not a later 'alive but silent' from their
    own deadline), and its ranks are free for a relaunch."""
    ctl = ClusterController.start("127.0.0.1:0", 2, SALT)
    started = time.monotonic()
    try:
        ok, err = HostProcess(lambda: spawn(
            quick_average, 1, controller=f"127.0.0.1:{ctl.port}", world_size=2,
            first_rank=1, salt=SALT, timeout=4)).join(90.0)
        elapsed = time.monotonic() - started
        _await_hosts(ctl, [])  # its ranks are free again
    finally:
        ctl.shutdown()
    assert not ok, err
    text = f"{err} {getattr(err, 'traceback', '')}"
    # the deadline the host announced: timeout 4 s + half the launcher's 10 s grace
    assert "round 0 stalled at the controller after 9.0 s" in text, text
    assert "ranks [0] never joined the cohort" in text and "alive but silent" not in text, text
    assert elapsed < 30.0, elapsed
    assert "Traceback" not in capfd.readouterr().err


def test_what_a_stopping_host_tells_the_controller_of_a_stalled_rank():
    """A ``RankStalled`` carries its message only (no parsed ``error``): the host's
    supervisor thread died on it with an AttributeError traceback, where it was to
    tell the controller why the host stopped."""
    from flodl_shm.errors import RankStalled
    from flodl_shm.launch.rank_exit import host_failure

    err = RankStalled("rank 1 gave up waiting: round 0 stalled at the controller after 9 s; "
                      "ranks [0] never joined the cohort\nmore", round=0, missing=(0,),
                      timeout=9.0, signal=None)
    assert host_failure(err) == (0, "rank 1 gave up waiting: round 0 stalled at the "
                                    "controller after 9 s; ranks [0] never joined the cohort")
    assert host_failure(RankFailed(3, "StartRefused", "Traceback ...\nflodl_shm.errors."
                                   "StartRefused: another checkpoint\n")) == (
        3, "StartRefused: another checkpoint")


def test_a_host_stopped_by_a_signal_says_so_to_the_controller(tmp_path):
    """SIGTERM to a host's launcher (an operator, a scheduler): the controller logged
    'host ... failed (connection closed; that host's output says why)'. The host now says
    how it was stopped before its link closes."""
    import signal

    from cluster_util import loop_forever

    ctl = ClusterController.start("127.0.0.1:0", 2, SALT)
    ready = tmp_path / "ready"

    def host(i):
        return spawn(loop_forever, 1, (str(ready),), controller=f"127.0.0.1:{ctl.port}",
                     world_size=2, first_rank=i, salt=SALT, timeout=60)

    hosts = [HostProcess(lambda i=i: host(i), f"host{i}") for i in range(2)]
    try:
        deadline = time.monotonic() + 90
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the hosts never ran their rounds"
        os.kill(hosts[1].pid, signal.SIGTERM)
        outcomes = join_hosts(hosts, time.monotonic() + 60)
    finally:
        for h in hosts:
            h.kill()
        ctl.shutdown()
    assert not any(ok for ok, _ in outcomes), outcomes
    said = {name.rsplit(":", 1)[1]: why for name, why in ctl.stopped_hosts.items()}
    assert said["1-1"] == (-1, "its launcher was stopped by SIGTERM"), said
    # (host 0 stops in turn, max_failures=0: it may say so before its link closes)
    inferred = (-1, "the controller declared ranks [1] dead, 1 failure exceeds max_failures=0")
    assert said.get("0-0", inferred) == inferred, said


# --- a lost host counts against max_failures -----------------------------------------------

def test_losing_a_whole_host_counts_against_max_failures(tmp_path):
    box, ctl = kill_a_host_mid_run(tmp_path, max_failures=0)
    err = box.get("error")
    assert isinstance(err, RankFailed), box
    assert err.rank == 2 and "ranks [2]" in str(err) and "max_failures=0" in str(err), str(err)
    assert ctl.dead_ranks.is_dead(2) and box["dead"] == [2]


# --- the controller is lost ----------------------------------------------------------------

def rounds_until_cut(ctx):
    for _ in range(100000):
        ctx.comm.all_reduce_tensors([torch.full((100,), float(ctx.rank))])
        time.sleep(0.005)
    raise AssertionError("the controller never went away")


def _two_hosts_whose_controller_stops(fn, rounds: int, pause: float = 0.0):
    """Two one-rank hosts running ``fn`` under a controller that is shut down once it has
    reduced ``rounds`` rounds (and ``pause`` seconds more); (the controller, each host's
    (ok, outcome)). A host that outlives its controller by a minute fails the test."""
    ctl = ClusterController.start("127.0.0.1:0", 2, SALT)

    def host(i):
        spawn(fn, 1, controller=f"127.0.0.1:{ctl.port}", world_size=2, first_rank=i,
              salt=SALT, timeout=60)

    hosts = [HostProcess(lambda i=i: host(i), f"host{i}") for i in range(2)]
    try:
        deadline = time.monotonic() + 90
        while ctl.stats.rounds < rounds and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ctl.stats.rounds >= rounds
        time.sleep(pause)
        ctl.shutdown()
        outcomes = join_hosts(hosts, time.monotonic() + 60)
    finally:
        ctl.shutdown()
        for h in hosts:
            h.kill()
    return ctl, outcomes


def test_losing_the_controller_stops_every_host():
    _, outcomes = _two_hosts_whose_controller_stops(rounds_until_cut, 3)
    for ok, e in outcomes:
        assert not ok and isinstance(e, ConnectionError) and "controller" in str(e), repr(e)


def rank_one_late_at_round_five(ctx):
    for k in range(100000):
        if k == 5 and ctx.rank == 1:
            time.sleep(4.0)  # the controller is stopped while it waits for this host
        ctx.comm.all_reduce_tensors([torch.full((100,), float(ctx.rank))])
    raise AssertionError("the controller never went away")


def test_a_controller_stopped_mid_round_sends_no_consensus_of_the_hosts_that_delivered():
    """A probe's SIGTERM to the controller (its shutdown) in the middle of a round: the
    reduce loop finished the round on what had arrived, so one host was sent a
    consensus of its own ranks alone ('rank(s) [1] left the cohort ... saving and
    stopping', nothing saved) and the other, which had delivered nothing, an
    'unexpected FRAME_DOWN record'. Both now read that the controller closed the
    connection, as when it is killed."""
    # stopped 1 s into round 5: host 0 has delivered it, host 1 sleeps
    ctl, outcomes = _two_hosts_whose_controller_stops(rank_one_late_at_round_five, 5, 1.0)
    assert ctl.stats.rounds == 5
    for ok, e in outcomes:
        assert not ok and isinstance(e, ConnectionError), repr(e)
        assert "closed the connection" in str(e) and "FRAME_DOWN" not in str(e), repr(e)


# --- frames above the frame ceiling ----------------------------------------------------------

def _frame(sizes, dtype=DTYPE_F32, weight=3.0):
    rng = np.random.default_rng(7)
    tensors = []
    for s in sizes:
        n = int(np.prod(s))
        raw = rng.standard_normal(n).astype(np.float32)
        data = raw if dtype == DTYPE_F32 else (raw.view(np.uint32) >> 16).astype(np.uint16)
        tensors.append(TensorPayload(dtype, s, data))
    return RoundFrame(tensors, weight, RoundKind.MODEL)


def _one_link_server(read) -> tuple[socket.socket, threading.Thread]:
    """A controller's end of one link: a loopback listening socket and a started thread
    that accepts one relay, completes the handshake, calls ``read(link)`` and closes it."""
    from flodl_shm.cluster.link import server_handshake

    ctl_sock = socket.create_server(("127.0.0.1", 0))

    def server():
        conn, _ = ctl_sock.accept()
        conn.settimeout(30)
        link, _ = server_handshake(conn, SALT, "relay", lambda hello, link: None)
        read(link)
        link.close()

    t = threading.Thread(target=server, daemon=True)
    t.start()
    return ctl_sock, t


@pytest.mark.parametrize("dtype", [DTYPE_F32, DTYPE_BF16])
def test_a_frame_above_the_ceiling_travels_in_parts_over_a_link(dtype):
    frame = _frame([(40, 30), (0,), (7,), (3, 1000), (1,)], dtype)
    ceiling = 1000
    parts = split_frame(frame, ceiling)
    assert len(parts) > 5 and all(wire.frame_wire_len(p) <= ceiling for p in parts)
    box = {}

    def read(link):
        box["got"] = link.recv()
        box["got2"] = link.recv(lambda i, dt, shape, nb: np.zeros(nb, np.uint8))

    ctl_sock, t = _one_link_server(read)  # (it reads once the relay has sent)
    wire.set_frame_ceiling(ceiling)
    try:
        link = join_raw(ctl_sock.getsockname()[1], _hello("h", [0], 1))
        link.send_frame(Kind.FRAME_UP, frame, flags=8)
        link.send_frame(Kind.FRAME_UP, frame, flags=16)
        t.join(30)
        link.close()
    finally:
        wire.set_frame_ceiling(None)
        ctl_sock.close()
    for key, flags in (("got", 8), ("got2", 16)):
        kind, fl, got = box[key]
        assert kind == Kind.FRAME_UP and fl == flags
        assert got == frame


def test_a_peer_gone_in_the_middle_of_a_frame_is_a_lost_connection():
    """A controller killed while it sent a round's frame: its host said "frame record
    from ... ended before its frame" (a FrameError, as for a forged frame), where the
    host that read a clean end was told the controller closed the connection."""
    box = {}

    def read(link):
        try:
            link.recv()
        except Exception as e:  # noqa: BLE001 - what the reader raised is the result
            box["error"] = e

    ctl_sock, t = _one_link_server(read)
    try:
        link = join_raw(ctl_sock.getsockname()[1], _hello("h", [0], 1))
        # a frame record's header, then the sender is gone
        link.sock.sendall(link._header(Kind.FRAME_UP, 0, 64, b"\0" * 16))
        link.close()
        t.join(30)
    finally:
        ctl_sock.close()
    err = box["error"]
    assert isinstance(err, ConnectionError), repr(err)
    assert str(err).endswith("closed the connection in the middle of a record (after 32 of "
                             "its 96 bytes): it exited or was killed, or the connection was cut")


def _frozen_mid_record(ctl, caplog):
    """Host "a" (rank 0) delivers its partial; host "b" (rank 1) sends 10 bytes of a
    record's header and stops, as a relay under SIGSTOP would. Returns b's link."""
    caplog.set_level(logging.ERROR, logger="flodl_shm")
    a = join_raw(ctl.port, _hello("a", [0], 2))
    b = join_raw(ctl.port, _hello("b", [1], 2))
    _await_hosts(ctl, ["a", "b"])
    a.send_frame(Kind.FRAME_UP, RoundFrame([TensorPayload(DTYPE_F32, (3,),
                                                          np.ones(3, np.float32))], 1.0))
    b.sock.sendall(b._header(Kind.FRAME_UP, 0, 64, b"\0" * 16)[:10])
    return a, b


def test_a_host_frozen_in_the_middle_of_a_record_fails_at_the_round_deadline(caplog):
    """A probe's relay that knew the secret sent 10 of a record's 32 header bytes and
    stopped: the controller waited on it for good (only the first byte of a record was
    bounded), and logged nothing; its --round-timeout never fired."""
    ctl = ClusterController.start("127.0.0.1:0", 2, SALT, round_timeout=1.5)
    try:
        a, b = _frozen_mid_record(ctl, caplog)
        deadline = time.monotonic() + 20
        while not ctl.dead_ranks.is_dead(1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctl.dead_ranks.is_dead(1), caplog.text
        assert not ctl.dead_ranks.is_dead(0)
        a.close()
        b.close()
    finally:
        ctl.shutdown()
    assert ("host 'b' failed (127.0.0.1:" in caplog.text
            and "stopped sending in the middle of a record: nothing for 1.5 s" in caplog.text), \
        caplog.text


def test_a_controller_stops_at_once_while_a_host_is_frozen_mid_record(caplog):
    """The same frozen relay, no round deadline: SIGTERM took the reduce thread's 10 s
    join timeout (in a probe, 11 s) where the controller stops at once otherwise."""
    ctl = ClusterController.start("127.0.0.1:0", 2, SALT, round_timeout=None)
    try:
        a, b = _frozen_mid_record(ctl, caplog)
        time.sleep(1.0)  # the reduce thread reads b's record
    finally:
        t0 = time.monotonic()
        ctl.shutdown()
        took = time.monotonic() - t0
    a.close()
    b.close()
    assert took < 3.0, took
    assert not ctl.dead_ranks.dead()  # stopped, not failed


def test_the_other_hosts_hear_how_a_stopped_host_left():
    """A host interrupted by its operator told the controller so, but the surviving
    hosts read only "the controller declared ranks [1] dead" and then "1 rank died":
    the declaration now carries how the host said it stopped."""
    from flodl_shm.cluster.control import Ctrl, ctrl_message

    ctl = ClusterController.start("127.0.0.1:0", 2, SALT)
    try:
        a = join_raw(ctl.port, _hello("a", [0], 2))
        b = join_raw(ctl.port, _hello("b", [1], 2))
        b.send_ctrl(ctrl_message(Ctrl.HOST_STOPPING, rank=-1,
                                 reason="its launcher was interrupted (Ctrl-C)"))
        b.close()
        a.send_frame(Kind.FRAME_UP, _frame([(3,)]))  # round 0: the controller reads b
        got = a.recv(timeout=30)
        a.close()
    finally:
        ctl.shutdown()
    assert got[0] == Kind.CTRL and got[2]["type"] == Ctrl.DECLARE_DEAD, got
    assert got[2]["ranks"] == [1]
    assert got[2]["why"] == "host 'b' stopped: its launcher was interrupted (Ctrl-C)"


@pytest.mark.parametrize("said", ["stall", "nothing"])
def test_a_host_that_finds_the_link_gone_reads_what_the_controller_said_last(said):
    """A host stopped for a while (SIGSTOP at start-up, in a probe) found its link gone
    when it next sent and said "lost the connection ... it stopped or its host is
    unreachable", although the controller had stalled the round on it and said so before
    it closed. The verdict stays readable after the failed send."""
    from flodl_shm.cluster.control import Ctrl, ctrl_message
    from flodl_shm.cluster.relay import last_word

    def verdict_then_close(link):
        if said == "stall":
            link.send_ctrl(ctrl_message(Ctrl.STALL, round=0, missing=[1], timeout=2.0))

    ctl_sock, t = _one_link_server(verdict_then_close)
    try:
        link = join_raw(ctl_sock.getsockname()[1], _hello("h", [1], 2))
        t.join(30)  # the controller's end is closed now
        frame = _frame([(1000,)], DTYPE_F32)
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for _ in range(100):  # the first sends may still find room in the buffers
                link.send_frame(Kind.FRAME_UP, frame)
                time.sleep(0.01)
        got = last_word(link)
        link.close()
    finally:
        ctl_sock.close()
    if said == "stall":
        assert isinstance(got, ReduceStall) and got.missing == (1,), repr(got)
        assert "round 0 stalled at the controller after 2.0 s; ranks [1]" in str(got)
    else:
        assert got is None


def big_average(ctx, bf16):
    ctx.comm.set_bf16_wire(bf16)
    out = []
    for i in range(3):
        t = torch.arange(30000, dtype=torch.float32) * (ctx.rank + 1) + i
        small = torch.tensor([float(ctx.rank)])
        r = ctx.comm.all_reduce_tensors([t, small])
        out.append((float(r[0][0]), float(r[0][-1]), float(r[1][0])))
    return out


@pytest.mark.parametrize("bf16", [False, True])
def test_a_cluster_round_above_the_frame_ceiling_is_split_transparently(bf16):
    """A 120 kB host partial under a 16 kB frame ceiling: the relay and the controller
    split every round into ceiling-sized records and the average is exact."""
    wire.set_frame_ceiling(16 << 10)
    try:
        out, errors, ctl = run_hosts(big_average, [1, 1], args=(bf16,))
    finally:
        wire.set_frame_ceiling(None)
    assert not errors, errors
    want = [(0.0 + i, 1.5 * 29999 + i, 0.5) for i in range(3)]
    for host in out:
        for got, w in zip(host[0], want):
            assert got[0] == w[0] and got[2] == w[2]
            assert abs(got[1] - w[1]) <= (0.01 * w[1] if bf16 else 0.0)
    assert ctl.stats.rounds == 3


def test_split_frame_refuses_a_ceiling_too_small_for_one_element():
    with pytest.raises(FrameError, match="cannot carry even one element"):
        split_frame(_frame([(100,)]), 40)


# --- the controller command ----------------------------------------------------------------

def test_controller_command_with_a_missing_secret_file_prints_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "flodl_shm", "controller", "--bind",
                        "127.0.0.1:0", "--world-size", "2", "--secret-file",
                        str(tmp_path / "nonexistent")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "nonexistent" in lines[0] and "--new-secret" in lines[0], p.stderr


def raises_at_once(ctx):
    raise ValueError("this host's run fails")


def test_the_controller_command_fails_when_no_rank_is_left(tmp_path):
    """The only host's ranks fail: the controller declares them dead and its loop ends.
    It used to print 'cohort finished' and exit 0, so a script chaining on its status
    took a failed run for a finished one."""
    proc, port, log = _start_cli(tmp_path, 1)
    try:
        with pytest.raises(RankFailed, match="this host's run fails"):
            spawn(raises_at_once, 1, controller=f"127.0.0.1:{port}", world_size=1, salt=SALT,
                  timeout=30)
        assert proc.wait(60) == 1, log.read_text()
    finally:
        proc.kill()
        proc.wait(10)
    text = log.read_text()
    # the host said why before its link closed (it was "every rank died or its host was
    # lost (see the hosts' output)"): the failure, and why it stops the host
    assert (f"with no rank left; host '{socket.gethostname()}:0-0' (rank 0) stopped: "
            f"ValueError: this host's run fails; 1 failure exceeds max_failures=0") in text, text
    assert "stopped (rank 0: ValueError: this host's run fails" in text, text
    assert "cohort finished" not in text, text


def refuses_to_start(ctx):
    # what the Trainer's start agreement raises on every rank of every host when the
    # hosts resume from different checkpoints (after a round across the hosts)
    ctx.comm.all_reduce_tensors([torch.ones(1)])
    raise StartRefused(f"host of rank {ctx.rank} holds another checkpoint")


def test_the_controller_names_why_each_host_stopped():
    """Every host's ranks refuse to start. The controller logged "host ... failed
    (connection closed; that host's output says why)" for each and held nothing to say
    at the end; each host now tells it the failure that stops it (``host_stopping``),
    before its link closes."""
    _, errors, ctl = run_hosts(refuses_to_start, [2, 1])
    assert sorted(errors) == [0, 1] and all(isinstance(e, RankFailed)
                                             for e in errors.values()), errors
    said = ctl.stopped_hosts
    assert sorted(name.rsplit(":", 1)[1] for name in said) == ["0-1", "2-2"], said
    refused = 0
    for host, own, other in ((":0-1", (0, 1), [2]), (":2-2", (2,), [0, 1])):
        rank, why = next(v for k, v in said.items() if k.endswith(host))
        if why.startswith("StartRefused"):
            refused += 1
            assert rank in own and why == f"StartRefused: host of rank {rank} holds another " \
                                          f"checkpoint", said
        else:  # it heard of the other host's refusal from the controller before its own
            n = len(other)
            assert rank == -1 and why == (f"the controller declared ranks {other} dead, "
                                          f"{plural(n, 'failure')} exceed{'s' * (n == 1)} "
                                          f"max_failures=0"), said
    assert refused >= 1, said


def test_a_host_done_after_a_tolerated_death_is_not_taken_for_a_lost_host():
    """Host 0 loses rank 1 within max_failures=1 and finishes. Its relay, finding a fenced
    rank, closed the link without saying the host was done: the controller declared ranks
    0 and 1 dead, and host 1, still in its function, stopped with RankFailed (2 deaths past
    max_failures=1) and lost its result."""
    from cluster_util import one_dies_then_host_1_lingers, run_hosts

    results, errors, ctl = run_hosts(one_dies_then_host_1_lingers, [2, 1], max_failures=1)
    assert not errors, errors
    assert results == [[0, None], [2]]
    assert ctl.dead_ranks.alive() == [0, 2], ctl.dead_ranks.alive()


def test_a_broadcast_whose_root_died_raises_on_the_other_hosts():
    """On a cluster a broadcast is a reduce to which only the root contributes: with the
    root dead before it arrived, the others received the sum of nothing, zeros, as the
    root's tensors (a Trainer's replicas then trained from zeroed weights, silently)."""
    from flodl_shm import RankFailed

    from cluster_util import root_dies_before_broadcast, run_hosts

    results, errors, _ = run_hosts(root_dies_before_broadcast, [1, 1], max_failures=1)
    assert results[0] == [None], results
    assert isinstance(errors.get(1), RankFailed), (results, errors)
    assert "the root, rank 0, died before its tensors arrived" in str(errors[1])


# --- a controller that serves for days -------------------------------------------------

def test_a_controller_keeps_the_last_rounds_times_only(monkeypatch):
    """A soak probe: ControllerStats.round_s kept one float per round for good (32 bytes
    a round: 2.6 GiB a day at 1,000 rounds/s)."""
    import flodl_shm.cluster.controller as controller

    monkeypatch.setattr(controller, "ROUND_TIMES_KEPT", 5)
    ctl = ClusterController.start("127.0.0.1:0", 1, SALT)
    try:
        link = join_raw(ctl.port, _hello("a", [0], 1))
        for _ in range(20):
            link.send_frame(Kind.FRAME_UP, _frame([(3,)], weight=1.0))
            kind, _, back = link.recv(timeout=30)
            assert kind == Kind.FRAME_DOWN and back.weight == 1.0
        link.close()
        assert ctl.join(30)
    finally:
        ctl.shutdown()
    assert ctl.stats.rounds == 20 and len(ctl.stats.round_s) == 5


def test_a_host_refused_again_and_again_is_logged_once_then_counted(caplog):
    """A soak probe's host with a wrong world size, relaunched in a loop, wrote an ERROR
    line per attempt (19 KB of log a minute) while garbage peers were throttled."""
    caplog.set_level(logging.ERROR, logger="flodl_shm")
    ctl = ClusterController.start("127.0.0.1:0", 2, SALT)
    try:
        for _ in range(6):
            with pytest.raises(HandshakeRejected, match="world_size"):
                join_raw(ctl.port, _hello("loop", [0], 3))
    finally:
        ctl.shutdown()
    lines = [r.getMessage() for r in caplog.records]
    said = [m for m in lines if "refused host 'loop'" in m]
    assert len(said) == 1 and "world_size" in said[0], lines
    assert "controller: 5 more hosts refused since the last report" in lines, lines


def test_the_connect_retries_make_their_last_attempt_on_time():
    """A regression probe: attempts=2 said it would retry for 0.5 s, then gave up after one
    attempt (the last one fell a hair past the deadline)."""
    from flodl_shm.cluster.link import connect

    said = []
    with pytest.raises(ConnectionError, match=r"within 0\.5 s \(2 attempts; "):
        connect("127.0.0.1:1", attempts=2, delay=0.5, on_wait=lambda e, s: said.append(s))
    with pytest.raises(ConnectionError, match=r"within 0\.4 s \(3 attempts; "):
        connect("127.0.0.1:1", attempts=3, delay=0.2)
    assert said == [0.5]


@pytest.mark.parametrize("salt", [b"a", b"", 5, "0" * 32], ids=["short", "empty", "int", "str"])
def test_a_bad_salt_leaves_a_secret_file_as_it_was(tmp_path, salt):
    """An API probe's write_secret_file(good_file, b"a") wrote `61` over a good secret, then
    failed on reading it back: the good secret was lost."""
    from flodl_shm.cluster.secret import read_secret_file

    path = tmp_path / "secret.hex"
    write_secret_file(path, SALT)
    with pytest.raises(ValueError, match=r"session salt must be 16 bytes"):
        write_secret_file(path, salt)
    assert read_secret_file(path) == SALT


def test_a_frozen_controller_is_named_not_the_other_hosts_ranks(tmp_path):
    """A probe SIGSTOPped the controller mid-run: each host's ranks gave up blaming the
    other host's ranks ("ranks that had not arrived: [2, 3] (alive but silent ...)"),
    and nothing said the controller had stopped answering. Without its verdict by the
    ranks' deadline, the stall now names the controller first. A link fuzz found that a
    host allowed a failure returned [None] instead: its rank's giving up counted as a
    death within budget, though no rank of it could go on."""
    port_file, ready = tmp_path / "port", tmp_path / "ready"

    def controller():
        ctl = ClusterController.start("127.0.0.1:0", 2, SALT, round_timeout=60.0)
        port_file.write_text(str(ctl.port))
        ctl.join()

    ctl_proc = HostProcess(controller, "controller")
    hosts = []
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        addr = f"127.0.0.1:{port_file.read_text()}"

        def host(first: int):
            # (max_failures=1: a rank that gave up on the controller is no death to go on
            # without; each host returned [None], as if its rank had died within budget)
            return spawn(loop_forever, 1, (str(ready),), controller=addr, world_size=2,
                         first_rank=first, salt=SALT, timeout=2.0, max_failures=1)

        hosts = [HostProcess(lambda i=i: host(i), f"host{i}") for i in range(2)]
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the hosts never ran their rounds"
        os.kill(ctl_proc.pid, signal.SIGSTOP)
        outcomes = join_hosts(hosts, time.monotonic() + 90)
    finally:
        for h in hosts:
            h.kill()
        ctl_proc.kill()  # (SIGKILL ends a stopped process too)
    for ok, err in outcomes:
        assert not ok and isinstance(err, RankFailed), repr(err)
        text = str(err)
        assert "no consensus from the controller within the" in text, text
        assert "The controller is likely not answering (its process stopped" in text, text
        # (the probe passed --timeout 15 and read of a 30 s timeout, unexplained)
        assert ("did not deliver (spawn's timeout=2 s; a rank's own deadline trails it by "
                "10 s, in which the launcher gives its own verdict)") in text, text
    assert "ranks on other hosts ([1]) did not deliver" in str(outcomes[0][1])
    assert "ranks on other hosts ([0]) did not deliver" in str(outcomes[1][1])
    # (host 1's error said [0] and carried missing (1,), rank 1: its own rank; the
    # launcher shifted global ranks as if they were the host's local ones)
    assert [(err.missing, err.rank) for _, err in outcomes] == [((1,), 1), ((0,), 0)]


def test_a_controller_frozen_inside_a_consensus_record_is_named_not_the_closed_link():
    """The test above failed once: SIGSTOP caught the controller between a consensus
    record's length prefix and its frame, and the host raised "this host's relay failed:
    stream ended inside a len-framed RoundFrame body": the relay's own link, closed as
    the host stopped at its ranks' deadline, ended the read it was blocked in. Here the
    controller's end freezes there every time."""
    frozen = threading.Event()
    release = threading.Event()

    def freeze_inside_the_consensus(link):
        while True:  # the relay's partial of round 0 (control records may come first)
            got = link.recv(timeout=60)
            if got is None or got[0] == Kind.FRAME_UP:
                break
        # a consensus record's header and length prefix, then silence
        link.sock.sendall(link._header(Kind.FRAME_DOWN, 0, 4 + 64, b"\0" * 16)
                          + (64).to_bytes(4, "little"))
        frozen.set()
        release.wait(60)

    ctl_sock, t = _one_link_server(freeze_inside_the_consensus)
    try:
        with pytest.raises(RankFailed) as info:
            spawn(quick_average, 1, controller=f"127.0.0.1:{ctl_sock.getsockname()[1]}",
                  world_size=1, salt=SALT, timeout=2.0)
    finally:
        release.set()
        t.join(30)
        ctl_sock.close()
    assert frozen.is_set()
    text = str(info.value)
    assert "no consensus from the controller within the" in text, text
    # (this host holds the whole world: it read "Otherwise the ranks on other hosts ([])
    # did not deliver", and of "the 12 s collective timeout" with no word of spawn's 2 s)
    assert info.value.traceback.rstrip().endswith("check it and its output"), text
    assert "other hosts" not in text, text
    assert text.startswith("rank 0 gave up waiting: round 0 stalled: "), text
    assert ("check it and its output (spawn's timeout=2 s; a rank's own deadline trails it "
            "by 10 s, in which the launcher gives its own verdict) (exc_type=ReduceStall, "
            "signal=None)") in text, text
    assert (info.value.rank, info.value.exc_type) == (0, "ReduceStall")


def test_the_controller_s_last_line_says_how_the_lost_ranks_left_once():
    """A probe read "without ranks [2, 3] (they died, or their host was lost); host 'b'
    stopped on: its launcher was interrupted (Ctrl-C): the ranks left saved ...": a
    guess beside what the host said, and a chain of colons."""
    from flodl_shm.cli.controller import _why_hosts_stopped, _without

    why = _why_hosts_stopped({"b": (-1, "its launcher was interrupted (Ctrl-C)")})
    assert _without([2, 3], why) == (", without ranks [2, 3]; host 'b' stopped: its launcher "
                                     "was interrupted (Ctrl-C)")
    assert _without([2, 3], "") == ", without ranks [2, 3] (they died, or their host was lost)"
    assert _without([], why) == "; host 'b' stopped: its launcher was interrupted (Ctrl-C)"
    assert _without([], "") == ""
