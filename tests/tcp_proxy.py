"""A TCP proxy for tests, with the network faults a link between a service and its brokers
has: latency, one direction held (what is sent waits, the connection stays open), every
open connection cut (reset), and faults sprung by the Kafka request that passes: the answer
to a request lost, or its connection cut once it is sent. `Proxy` runs on threads of the
test process; `python -m tests.tcp_proxy LISTEN TARGET` (each host:port) runs a plain relay,
which lets a Spark worker in a network namespace of its own reach the test broker, which
listens on the host's loopback only.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

TO_SERVER, TO_CLIENT = "to server", "to client"
LOSE_ANSWERS, CUT = "lose answers", "cut"
# Kafka's request api keys (the protocol's request header), for `arm`.
INIT_PRODUCER_ID, END_TXN = 22, 26


@dataclass
class _Connection:
    client: socket.socket
    upstream: socket.socket
    cut: bool = False
    requests: _RequestFrames = field(default_factory=lambda: _RequestFrames())
    _ended: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def shut_reading(self) -> None:
        """Cut: wake both relaying threads (their reads end) without sending anything; the
        last of them resets both sides (`ended`)."""
        self.cut = True
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RD)

    def ended(self) -> bool:
        """One relaying thread is done; the second closes both sockets (with an RST if cut),
        so that no socket is closed while the other thread may still use it. True then."""
        with self._lock:
            self._ended += 1
            if self._ended < 2:
                return False
        for s in (self.client, self.upstream):
            if self.cut:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        return True


class _RequestFrames:
    """The api key of each Kafka request in a client's byte stream (size-prefixed frames)."""

    def __init__(self) -> None:
        self.skip = 0  # bytes left of the current frame
        self.head = b""  # the start of a frame: its size (int32) and api key (int16)

    def api_keys(self, data: bytes) -> list[int]:
        keys, i = [], 0
        while i < len(data):
            if self.skip:
                n = min(self.skip, len(data) - i)
                self.skip, i = self.skip - n, i + n
                continue
            taken = data[i : i + 6 - len(self.head)]
            self.head, i = self.head + taken, i + len(taken)
            if len(self.head) == 6:
                size, key = struct.unpack(">ih", self.head)
                keys.append(key)
                self.skip, self.head = size - 2, b""
        return keys


class Proxy:
    """Relays every connection made to `port` to `target` (host, port)."""

    def __init__(self, port: int, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self.address = f"{host}:{port}"
        self.latency_s = 0.0
        self.sprung: list[tuple[int, str]] = []  # (api key, fault) of each armed fault sprung
        self._armed: tuple[int, str] | None = None
        self._flowing = {TO_SERVER: threading.Event(), TO_CLIENT: threading.Event()}
        for flowing in self._flowing.values():
            flowing.set()
        self._lock = threading.Lock()
        self._open: list[_Connection] = []
        self._server = socket.create_server((host, port))
        self._accepting = threading.Thread(target=self._accept, name=f"proxy {port}", daemon=True)
        self._accepting.start()

    # -- faults ------------------------------------------------------------------------------

    def delay(self, seconds: float) -> None:
        """Pass on what arrives `seconds` later, both ways (0: at once)."""
        self.latency_s = seconds

    def hold(self, direction: str) -> None:
        """Stop passing data `direction` (TO_SERVER or TO_CLIENT); what arrives waits."""
        self._flowing[direction].clear()

    def release(self) -> None:
        """Pass data both ways again, what waited first."""
        for flowing in self._flowing.values():
            flowing.set()

    def cut(self) -> int:
        """Reset every open connection, both sides (RST, no FIN); how many."""
        with self._lock:
            connections = [c for c in self._open if not c.cut]
        for connection in connections:
            connection.shut_reading()
        return len(connections)

    def arm(self, api_key: int | None, fault: str = LOSE_ANSWERS) -> None:
        """On the next request with `api_key` that passes (None: disarm): LOSE_ANSWERS holds
        every answer from then on (as `hold(TO_CLIENT)`), so that the request reaches the
        broker and its answer does not come back; CUT resets its connection once it is sent.
        Recorded in `sprung`."""
        with self._lock:
            self._armed = None if api_key is None else (api_key, fault)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._accepting.join(5)
        self._server.close()
        self.release()
        self.cut()

    # -- relaying ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            connection = _Connection(client, upstream)
            with self._lock:
                self._open.append(connection)
            for source, sink, direction in (
                (client, upstream, TO_SERVER),
                (upstream, client, TO_CLIENT),
            ):
                threading.Thread(
                    target=self._relay, args=(source, sink, direction, connection), daemon=True
                ).start()

    def _relay(self, source, sink, direction: str, connection: _Connection) -> None:
        """Read `source` and pass what it sends to a thread that writes `sink` when due."""
        due: queue.Queue = queue.Queue()
        writer = threading.Thread(
            target=self._write, args=(sink, direction, connection, due), daemon=True
        )
        writer.start()
        try:
            while data := source.recv(65536):
                fault = self._sprung(data, connection) if direction == TO_SERVER else None
                if fault == LOSE_ANSWERS:
                    self.hold(TO_CLIENT)  # before the request can reach the broker
                due.put((time.monotonic() + self.latency_s, data, fault))
        except OSError:
            pass
        finally:
            due.put(None)
            writer.join()
            if not connection.cut:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)  # the end of the stream, passed on
            if connection.ended():
                with self._lock:
                    if connection in self._open:
                        self._open.remove(connection)

    def _write(self, sink, direction: str, connection: _Connection, due: queue.Queue) -> None:
        """Write what the reading thread queued, each when due and when `direction` flows."""
        try:
            while (item := due.get()) is not None:
                at, data, fault = item
                time.sleep(max(0.0, at - time.monotonic()))
                while not self._flowing[direction].wait(0.1):
                    if connection.cut:
                        return
                if connection.cut:
                    return
                sink.sendall(data)
                if fault == CUT:
                    connection.shut_reading()
        except OSError:  # the other side is gone: so goes this one
            connection.shut_reading()

    def _sprung(self, data: bytes, connection: _Connection) -> str | None:
        keys = connection.requests.api_keys(data)
        with self._lock:
            if self._armed is None or self._armed[0] not in keys:
                return None
            (api_key, fault), self._armed = self._armed, None
        self.sprung.append((api_key, fault))
        return fault


def main(listen: str, target: str) -> None:
    host, port = listen.rsplit(":", 1)
    target_host, target_port = target.rsplit(":", 1)
    Proxy(int(port), (target_host, int(target_port)), host)
    print("relaying", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(*sys.argv[1:3])
