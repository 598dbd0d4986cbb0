"""A loopback TCP proxy that puts one fault on a relay's link to the controller.

A host connects to ``LinkProxy.port`` instead of the controller's; the proxy forwards
both directions of the first connection it accepts until ``at`` bytes have passed in
``direction`` ("up": relay -> controller, "down": controller -> relay), then does
``action``:

- ``"reset"``: both ends get a TCP reset (a dropped connection, a rebooted middlebox);
- ``"close"``: both ends get an orderly close (FIN);
- ``"stall"``: nothing moves either way for ``seconds``, then everything flows again
  (a congested or briefly flapping path);
- ``"flip"``: bit ``bit`` of the byte at that offset is flipped, the rest passes (what
  the records' authentication tags must catch).

Later connections (a relaunched host) pass untouched. One thread serves a connection,
both directions, so a close here reaches the peers at once (a socket another thread
is blocked in would not close until that call returns).
"""
from __future__ import annotations

import select
import socket
import struct
import threading
import time

ACTIONS = ("reset", "close", "stall", "flip")


class LinkProxy:
    def __init__(self, controller_port: int, direction: str, at: int, action: str, *,
                 seconds: float = 0.0, bit: int = 0) -> None:
        assert direction in ("up", "down") and action in ACTIONS, (direction, action)
        self.target = controller_port
        self.direction, self.at, self.action = direction, at, action
        self.seconds, self.bit = seconds, bit
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        first = True
        while not self._stop.is_set():
            try:
                relay, _ = self._listener.accept()
            except OSError:
                return
            controller = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [relay, controller]
            self._spawn(self._serve, relay, controller, first)
            first = False

    def _serve(self, relay: socket.socket, controller: socket.socket, faulty: bool) -> None:
        ends = {"up": (relay, controller), "down": (controller, relay)}
        passed = {"up": 0, "down": 0}
        flowing = {"up", "down"}
        try:
            while flowing and not self._stop.is_set():
                readable, _, _ = select.select([ends[d][0] for d in flowing], [], [], 0.05)
                for d in list(flowing):
                    src, dst = ends[d]
                    if src not in readable:
                        continue
                    data = src.recv(1 << 16)
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        flowing.discard(d)
                        continue
                    if (faulty and d == self.direction and not self.fired.is_set()
                            and passed[d] + len(data) > self.at):
                        k = self.at - passed[d]
                        self.fired.set()
                        if self.action == "flip":
                            data = data[:k] + bytes([data[k] ^ (1 << self.bit)]) + data[k + 1:]
                        else:
                            dst.sendall(data[:k])
                            if self.action != "stall":
                                _close(relay, controller, reset=self.action == "reset")
                                return
                            time.sleep(self.seconds)
                            passed[d] += k
                            data = data[k:]
                    dst.sendall(data)
                    passed[d] += len(data)
        except OSError:
            _close(relay, controller, reset=False)

    def close(self) -> None:
        self._stop.set()
        try:  # (wakes the accept: a close alone would not)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for t in self._threads:
            t.join(5)
        for s in self._socks:
            s.close()


def _close(*socks: socket.socket, reset: bool) -> None:
    for s in socks:
        try:
            if reset:  # (an abortive close: the peer reads ECONNRESET)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
