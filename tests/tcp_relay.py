"""A TCP relay for tests: `python -m tests.tcp_relay LISTEN TARGET` (each host:port) accepts
on LISTEN and connects each client to TARGET. It lets a Spark worker in a network namespace
of its own reach the test broker, which listens on the host's loopback only."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def main(listen: str, target: str) -> None:
    host, port = listen.rsplit(":", 1)
    target_host, target_port = target.rsplit(":", 1)
    server = socket.create_server((host, int(port)))
    print("relaying", flush=True)
    while True:
        client, _ = server.accept()
        try:
            upstream = socket.create_connection((target_host, int(target_port)), timeout=10)
        except OSError:
            client.close()
            continue
        upstream.settimeout(None)
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


if __name__ == "__main__":
    main(*sys.argv[1:3])
