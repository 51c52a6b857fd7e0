"""A windowed pipeline against Kafka with SASL_SSL (SCRAM-SHA-512 over TLS), credentials from
the environment; wrong credentials and a missing TLS layer end in one clear line, and the
password never shows in logs, metrics or /healthz.

The broker is one of the test's own (onceflow's local broker with `sasl_ssl`, on free ports),
whichever broker the rest of the suite uses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from onceflow.connectors.topics import create_topic, read_committed
from onceflow.local_kafka import LocalKafka
from tests.helpers import free_port, own_broker, produce, wait_until
from tests.integration.test_pipeline import BASE, click, tumbling_expected

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def secured_broker() -> Iterator[LocalKafka]:
    with own_broker(sasl_ssl=True) as broker:
        yield broker


def _pipeline(tmp_path: Path, broker: LocalKafka, topics: dict[str, str], **kafka) -> Path:
    listener = broker.secure_listener
    raw = {
        "app_id": f"secured-{topics['in']}",
        "kafka": {
            "bootstrap_servers": listener.bootstrap,
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "onceflow",
            "sasl_password": "${KAFKA_PASSWORD}",
            "ssl_ca_location": str(listener.ca_file),
            **kafka,
        },
        "source": {
            "topics": [topics["in"]],
            "starting_offsets": "earliest",
            "format": "json",
            "schema": "user STRING, url STRING, bytes LONG, ts LONG",
        },
        "event_time": {"field": "ts", "watermark_delay": "0s"},
        "window": {
            "type": "tumbling",
            "size": "10s",
            "key": "user",
            "aggregations": {"clicks": "count(*)", "bytes": "sum(bytes)"},
        },
        "sink": {"topic": topics["out"], "dead_letter_topic": topics["dlq"]},
        "checkpoint": {"location": str(tmp_path / "ck")},
        "spark": {"master": "local[2]"},
        "metrics": {"port": free_port()},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def topics(secured_broker: LocalKafka) -> dict[str, str]:
    conf = secured_broker.secure_listener.client_settings()
    suffix = os.urandom(4).hex()
    names = {role: f"{role}-{suffix}" for role in ("in", "out", "dlq")}
    for name in names.values():
        create_topic(conf, name, partitions=2)
    return names


def _onceflow(*args: str, password: str, budget_s: int = 20) -> subprocess.Popen:
    env = {**os.environ, "KAFKA_PASSWORD": password, "ONCEFLOW_KAFKA_TIMEOUT": str(budget_s)}
    return subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _failed_run(
    path: Path, password: str, budget_s: int = 20, timeout: float = 300
) -> tuple[str, str]:
    """`onceflow run --available-now` that must fail: exit 1, no traceback, the password
    nowhere in its output; returns its stderr and last line."""
    run = _onceflow("run", "--available-now", str(path), password=password, budget_s=budget_s)
    stdout, stderr = run.communicate(timeout=timeout)
    assert run.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert password not in stdout + stderr
    return stderr, stderr.strip().splitlines()[-1]


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError as exc:
        return f"({exc})"


def test_a_windowed_pipeline_over_sasl_ssl_is_exactly_once_and_never_shows_the_password(
    secured_broker, topics, tmp_path
):
    conf = secured_broker.secure_listener.client_settings()
    password = conf["sasl.password"]
    path = _pipeline(tmp_path, secured_broker, topics)
    port = yaml.safe_load(path.read_text())["metrics"]["port"]
    events = [(f"u{i % 3}", BASE + i * 97) for i in range(300)]
    produce(
        conf,
        topics["in"],
        [(u.encode(), click(u, ts), i % 2) for i, (u, ts) in enumerate(events)]
        + [(b"u0", click("u0", BASE + 1_000_000), 0)],  # closes every window above
    )
    expected = tumbling_expected(events, 10_000)

    def windows() -> list[tuple]:
        return sorted(
            (v["key"], v["window_start"], v["clicks"], v["bytes"])
            for v in map(json.loads, (m.value() for m in read_committed(conf, topics["out"])))
        )

    run = _onceflow("--log-level", "debug", "run", str(path), password=password)
    scraped: list[str] = []
    try:

        def published() -> bool:
            scraped.append(_get(f"http://127.0.0.1:{port}/metrics"))
            scraped.append(_get(f"http://127.0.0.1:{port}/healthz"))
            assert run.poll() is None, run.communicate()[1][-3000:]
            return len(windows()) >= len(expected)

        wait_until(published, timeout=180, what="the windows over SASL_SSL")
    finally:
        run.send_signal(signal.SIGTERM)
        stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 0, stderr[-3000:]

    assert windows() == sorted(
        (v["key"], v["window_start"], v["clicks"], v["bytes"]) for v in expected.values()
    )
    # The scrapes saw the pipeline at work, not just a server that had started.
    assert any('outcome="committed"} 1' in page for page in scraped), scraped[-2:]
    # verify reads the topics with the pipeline's own (secured) settings.
    check = _onceflow("verify", str(path), password=password)
    verified, problems = check.communicate(timeout=300)
    assert check.returncode == 0, verified + problems[-3000:]
    files = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    for where, text in [
        ("stdout", stdout),
        ("stderr", stderr),
        ("metrics/healthz", scraped),
        ("verify", verified + problems),
    ]:
        assert password not in str(text), f"the SASL password appears in {where}"
    assert not [f for f in files if password.encode() in f], "the password is in a file"


def test_a_wrong_password_is_refused_in_one_line_that_names_the_setting(
    secured_broker, topics, tmp_path
):
    wrong = "not-the-password-" + os.urandom(4).hex()
    path = _pipeline(tmp_path, secured_broker, topics)
    # Retrying the same password cannot help: the run ends long before this budget.
    stderr, last = _failed_run(path, wrong, budget_s=900, timeout=400)
    assert last.startswith(
        f"onceflow: KafkaUnreachableError: Kafka at {secured_broker.secure_listener.bootstrap} "
        "refused the credentials of user 'onceflow' (SCRAM-SHA-512): "
    ), stderr[-3000:]
    assert "kafka.sasl.password" in last and "Authentication failed" in last, last


def test_a_client_without_tls_is_refused_in_one_line_that_names_the_setting(
    secured_broker, topics, tmp_path
):
    password = secured_broker.secure_listener.client_settings()["sasl.password"]
    path = _pipeline(tmp_path, secured_broker, topics, security_protocol="SASL_PLAINTEXT")
    stderr, last = _failed_run(path, password)
    assert last.startswith(
        f"onceflow: KafkaUnreachableError: Kafka at {secured_broker.secure_listener.bootstrap} "
        "did not answer within 20s; the client's last error: "
    ), stderr[-3000:]
    # What librdkafka saw (the broker hung up on its first request), and the setting to fix.
    assert "in state APIVERSION_QUERY" in last, last
    assert "The broker closed the connection before answering the first request" in last, last
    assert "if that listener expects TLS, set kafka.security.protocol (SASL_PLAINTEXT)" in last
