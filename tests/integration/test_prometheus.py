"""A real Prometheus scrapes a running pipeline; the series are checked through its HTTP API."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml

from tests.helpers import free_port, produce, wait_until
from tests.prometheus_server import INSTALL_HINT, PrometheusServer

BATCH = 500


@pytest.fixture
def prometheus_binary() -> str:
    binary = PrometheusServer.binary()
    if binary is None:
        pytest.skip(f"no prometheus binary on PATH; install it with: {INSTALL_HINT}")
    return binary


def _get(url: str) -> tuple[int, str] | None:
    """(status, body) of a GET, or None while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode().strip()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode().strip()
    except OSError:
        return None


def _wave(bootstrap: str, topic: str, start: int, count: int) -> int:
    """Produce `count` records over 3 partitions; return their key + value bytes."""
    records = [
        (f"u{i % 7}".encode(), json.dumps({"user": f"u{i % 7}", "n": i}).encode(), i % 3)
        for i in range(start, start + count)
    ]
    produce(bootstrap, topic, records)
    return sum(len(k) + len(v) for k, v, _ in records)


def test_prometheus_sees_throughput_committed_batches_and_lag_return_to_zero(
    kafka_bootstrap, new_topic, tmp_path, prometheus_binary
):
    source, sink = new_topic(partitions=3), new_topic(partitions=3)
    produced_bytes = _wave(kafka_bootstrap, source, 0, 20_000)  # a backlog of 40 epochs
    app, metrics_port = f"prom-{source}", free_port()
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "app_id": app,
                "kafka": {"bootstrap_servers": kafka_bootstrap},
                "source": {
                    "topics": [source],
                    "starting_offsets": "earliest",
                    "format": "raw",
                    "max_records_per_batch": BATCH,
                },
                "sink": {"topic": sink},
                "checkpoint": {"location": str(tmp_path / "ck"), "interval": "200ms"},
                "spark": {"master": "local[2]"},
                "metrics": {"port": metrics_port},
            }
        )
    )
    prometheus = PrometheusServer(prometheus_binary, tmp_path, f"127.0.0.1:{metrics_port}")
    log = tmp_path / "service.log"
    with open(log, "wb") as out:
        service = subprocess.Popen(
            [sys.executable, "-m", "onceflow.cli", "run", str(pipeline)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        prometheus.wait_ready()
        selector = f'{{app="{app}"}}'
        records = f"onceflow_input_records_total{selector}"
        batch = f"onceflow_last_committed_batch_id{selector}"
        lag = f"sum(onceflow_source_lag_records{selector})"

        health = f"http://127.0.0.1:{metrics_port}/healthz"
        wait_until(lambda: _get(health) is not None, 120, "the metrics port to answer")
        status, reason = _get(health)
        assert status == 200 or (status == 503 and reason.startswith("starting")), reason

        # While the backlog drains, the series move and the lag is visibly above zero.
        wait_until(lambda: (prometheus.query(records) or 0) > 0, 120, "first scraped epoch")
        assert _get(health) == (200, "ok")
        first_records, first_batch = prometheus.query(records), prometheus.query(batch) or 0
        wait_until(lambda: (prometheus.query(lag) or 0) > 0, 60, "a scrape during the backlog")
        wait_until(lambda: prometheus.query(records) > first_records, 60, "throughput")
        wait_until(lambda: (prometheus.query(batch) or 0) > first_batch, 60, "committed batches")
        assert prometheus.query(f"rate(onceflow_input_records_total{selector}[10s])") > 0

        # Caught up: every record read, lag back to zero.
        wait_until(lambda: prometheus.query(records) == 20_000, 180, "the backlog drained")
        wait_until(lambda: prometheus.query(lag) == 0, 60, "lag back to zero")
        input_bytes = f"onceflow_input_bytes_total{selector}"
        assert prometheus.query(input_bytes) == produced_bytes

        # A second wave moves the series again, and the lag returns to zero again.
        caught_up_batch = prometheus.query(batch)
        produced_bytes += _wave(kafka_bootstrap, source, 20_000, 5_000)
        wait_until(lambda: prometheus.query(records) == 25_000, 120, "the second wave read")
        wait_until(lambda: prometheus.query(batch) > caught_up_batch, 60, "new batches")
        wait_until(lambda: prometheus.query(lag) == 0, 60, "lag back to zero again")
        assert prometheus.query(input_bytes) == produced_bytes
        results = f'onceflow_output_records_total{{app="{app}",kind="result"}}'
        wait_until(lambda: prometheus.query(results) == 25_000, 60, "published records")
        assert (
            prometheus.query(f'onceflow_transactions_total{{app="{app}",outcome="aborted"}}') == 0
        )

        # The scraped history itself shows the catch-up: lag rose, then fell to zero.
        history = prometheus.query_range(lag, time.time() - 600, time.time())
        values = [float(v) for _, v in history[0]["values"]]
        assert max(values) > 0 and values[-1] == 0
    finally:
        service.send_signal(signal.SIGTERM)
        code = service.wait(120)
        prometheus.stop()
    assert code == 0, log.read_text()[-3000:]
