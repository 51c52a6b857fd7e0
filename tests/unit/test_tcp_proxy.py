"""The fault proxy of the cluster tests does what they rely on: latency, a held direction,
a cut, and faults sprung by a Kafka request's api key (an echo server stands for a broker)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import pytest

from tests.helpers import free_port
from tests.tcp_proxy import CUT, END_TXN, LOSE_ANSWERS, TO_CLIENT, Proxy, _RequestFrames


def _frame(api_key: int, body: bytes = b"x" * 10) -> bytes:
    payload = struct.pack(">h", api_key) + body
    return struct.pack(">i", len(payload)) + payload


@pytest.fixture
def proxy():
    server = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # a cut resets it
            while data := conn.recv(65536):
                conn.sendall(data)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    proxy = Proxy(free_port(), server.getsockname())
    yield proxy
    proxy.close()
    server.close()


def _client(proxy: Proxy) -> socket.socket:
    host, port = proxy.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _answer(client: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += client.recv(size - len(data))
    return data


def test_request_frames_are_found_across_chunk_boundaries():
    stream = _frame(3) + _frame(END_TXN, b"y" * 100) + _frame(1)
    frames = _RequestFrames()
    keys = [k for i in range(0, len(stream), 7) for k in frames.api_keys(stream[i : i + 7])]
    assert keys == [3, END_TXN, 1]


def test_latency_is_added_once_per_direction_not_once_per_chunk(proxy):
    proxy.delay(0.2)
    with _client(proxy) as client:
        started = time.monotonic()
        client.sendall(b"a" * 300_000)  # several chunks
        assert _answer(client, 300_000) == b"a" * 300_000
        took = time.monotonic() - started
    assert 0.4 <= took < 2.0  # one delay each way, not one per chunk


def test_a_held_direction_delivers_nothing_until_released(proxy):
    with _client(proxy) as client:
        proxy.hold(TO_CLIENT)
        client.sendall(b"ping")
        client.settimeout(0.5)
        with pytest.raises(TimeoutError):
            client.recv(4)
        proxy.release()
        client.settimeout(5)
        assert _answer(client, 4) == b"ping"


def test_a_cut_resets_the_connection(proxy):
    with _client(proxy) as client:
        client.sendall(b"ping")
        assert _answer(client, 4) == b"ping"
        assert proxy.cut() == 1
        with pytest.raises(ConnectionResetError):
            client.recv(4)


def test_an_armed_request_loses_its_answer_but_reaches_the_server(proxy):
    request = _frame(END_TXN)
    with _client(proxy) as client:
        client.sendall(_frame(3))
        assert _answer(client, len(_frame(3))) == _frame(3)  # other requests pass
        proxy.arm(END_TXN, LOSE_ANSWERS)
        client.sendall(request)
        client.settimeout(0.5)
        with pytest.raises(TimeoutError):
            client.recv(1)
        assert proxy.sprung == [(END_TXN, LOSE_ANSWERS)]
        proxy.release()  # the server got it and answered: the answer waited in the proxy
        client.settimeout(5)
        assert _answer(client, len(request)) == request


def test_an_armed_cut_resets_the_connection_after_the_request_is_sent(proxy):
    with _client(proxy) as client:
        proxy.arm(END_TXN, CUT)
        client.sendall(_frame(END_TXN))
        with pytest.raises(ConnectionResetError):
            while client.recv(65536):  # the echo may come first, then the reset
                pass
        assert proxy.sprung == [(END_TXN, CUT)]
