"""The metrics server answers /healthz while another client is slow to send its request."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from onceflow.metrics import PipelineListener, PipelineMetrics, serve


def test_a_slow_scrape_never_holds_up_healthz(tmp_path):
    metrics = PipelineMetrics("slow")
    server = serve(metrics, PipelineListener(metrics, str(tmp_path / "ck")), 0)
    port = server.server_port
    try:
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            # No epoch has run, so the answer is 503; what matters is that there is one.
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
            assert answer.value.code == 503 and b"starting" in answer.value.read()
    finally:
        server.shutdown()
        server.server_close()
