"""A TCP proxy for tests, with the network faults a link between a service and its brokers
has: added latency, every open connection cut mid-request, and one direction stopped (a
one-way partition: the connection stays open and nothing arrives, as when packets are
dropped). `Proxy` runs on threads of the test process; `python -m tests.tcp_proxy LISTEN
TARGET` (each host:port) runs a plain relay, which lets a Spark worker in a network namespace
of its own reach the test broker, which listens on the host's loopback only.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import sys
import threading
import time

TO_SERVER, TO_CLIENT = "to server", "to client"


class Proxy:
    """Relays every connection made to `port` to `target` (host, port)."""

    def __init__(self, port: int, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self.address = f"{host}:{port}"
        self.latency_s = 0.0
        self._flowing = {TO_SERVER: threading.Event(), TO_CLIENT: threading.Event()}
        for flowing in self._flowing.values():
            flowing.set()
        self._lock = threading.Lock()
        self._open: list[tuple[socket.socket, socket.socket]] = []
        self._server = socket.create_server((host, port))
        threading.Thread(target=self._accept, name=f"proxy {port}", daemon=True).start()

    # -- faults ------------------------------------------------------------------------------

    def delay(self, seconds: float) -> None:
        """Hold every chunk this long before passing it on, both ways (0: none)."""
        self.latency_s = seconds

    def hold(self, direction: str) -> None:
        """Stop passing data `direction` (TO_SERVER or TO_CLIENT); what arrives waits."""
        self._flowing[direction].clear()

    def release(self) -> None:
        """Pass data both ways again, what waited first."""
        for flowing in self._flowing.values():
            flowing.set()

    def cut(self) -> int:
        """Reset every open connection, both sides, as a broken link does; how many."""
        with self._lock:
            pairs, self._open = self._open, []
        for pair in pairs:
            for s in pair:
                _reset(s)
        return len(pairs)

    def close(self) -> None:
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
            pair = (client, upstream)
            with self._lock:
                self._open.append(pair)
            for source, sink, direction in (
                (client, upstream, TO_SERVER),
                (upstream, client, TO_CLIENT),
            ):
                threading.Thread(
                    target=self._pipe, args=(source, sink, direction, pair), daemon=True
                ).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, direction: str, pair) -> None:
        try:
            while data := source.recv(65536):
                while not self._flowing[direction].wait(0.1):
                    if source.fileno() < 0:  # cut while held
                        return
                if self.latency_s:
                    time.sleep(self.latency_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                if pair in self._open:
                    self._open.remove(pair)
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def _reset(s: socket.socket) -> None:
    """Close with an RST, not a FIN: the peer's next read or write fails at once."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked reading it
    s.close()


def main(listen: str, target: str) -> None:
    host, port = listen.rsplit(":", 1)
    target_host, target_port = target.rsplit(":", 1)
    Proxy(int(port), (target_host, int(target_port)), host)
    print("relaying", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(*sys.argv[1:3])
