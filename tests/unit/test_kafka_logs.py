"""librdkafka's log through Python logging: a line repeated many times a second is shown once
per window, with a count of those held back."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from confluent_kafka import KafkaError

from onceflow.connectors import kafka_clients


def test_repeated_lines_are_held_back_and_counted(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(kafka_clients.time, "monotonic", lambda: now[0])
    repeats = kafka_clients._RepeatFilter()

    def line(text: str) -> logging.LogRecord | None:
        record = logging.LogRecord("onceflow.librdkafka", logging.ERROR, "", 0, text, (), None)
        return record if repeats.filter(record) else None

    refused = "FAIL [rdkafka#producer-1] Connect to ipv4#127.0.0.1:1 failed (after {}ms)"
    assert line(refused.format(0)) is not None
    assert [line(refused.format(ms)) for ms in (3, 12, 7)] == [None, None, None]
    assert line("FAIL [rdkafka#producer-1] Failed to resolve 'nohost:9092'") is not None
    now[0] += kafka_clients.REPEAT_WINDOW_S
    shown = line(refused.format(5))
    assert shown is not None
    assert shown.getMessage().endswith("(after 5ms) (3 more like it held back)")


def test_the_retry_budget_is_a_setting(monkeypatch):
    monkeypatch.setenv("ONCEFLOW_KAFKA_TIMEOUT", "7.5")
    assert kafka_clients.retry_budget_s() == 7.5
    monkeypatch.delenv("ONCEFLOW_KAFKA_TIMEOUT")
    assert kafka_clients.retry_budget_s() == kafka_clients.DEFAULT_RETRY_BUDGET_S


SECURED = {
    "bootstrap.servers": "b:9096",
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "app",
    "sasl.password": "hunter2",
}


def _report(conf: dict[str, str], code: int, text: str) -> None:
    """What a client of `conf` would report: an error, and the FAIL line it logs."""
    client = kafka_clients.client_conf(conf)
    client["error_cb"](KafkaError(code, text))
    client["logger"].log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#1", f"[thrd:x]: {text}")


def test_refused_credentials_are_named_by_setting_and_end_the_retries_at_once():
    since = time.monotonic()
    _report(SECURED, KafkaError._AUTHENTICATION, "SASL authentication error: Authentication failed")
    message = kafka_clients._why_unreachable(SECURED, since, "timed out")
    assert message == (
        "Kafka at b:9096 refused the credentials of user 'app' (SCRAM-SHA-512): SASL "
        "authentication error: Authentication failed. Check kafka.sasl.username, "
        "kafka.sasl.password and kafka.sasl.mechanism."
    )
    state = SimpleNamespace(seconds_since_start=0.1, args=(SECURED,), start_time=since)
    assert kafka_clients._gives_up(state)
    assert not kafka_clients._gives_up(SimpleNamespace(**{**vars(state), "args": ({},)}))


def test_a_tls_listener_hanging_up_on_a_plaintext_client_says_which_setting_to_check():
    conf = {**SECURED, "bootstrap.servers": "b:9097", "security.protocol": "SASL_PLAINTEXT"}
    since = time.monotonic()
    hung_up = "Disconnected: connection closed by peer (after 1ms in state APIVERSION_QUERY)"
    _report(conf, KafkaError._TRANSPORT, hung_up)
    kafka_clients.client_conf(conf)["error_cb"](KafkaError(KafkaError._ALL_BROKERS_DOWN))
    message = kafka_clients._why_unreachable(conf, since, "timed out")
    assert f"the client's last error: {hung_up}. The broker hung up" in message
    assert "check kafka.security.protocol (SASL_PLAINTEXT)" in message
    assert "hunter2" not in message


def test_an_error_from_before_this_request_is_not_its_cause():
    conf = {"bootstrap.servers": "b:9098"}
    _report(conf, KafkaError._SSL, "certificate verify failed")
    message = kafka_clients._why_unreachable(conf, time.monotonic() + 1, "Local: Timed out")
    assert "the client's last error: Local: Timed out." in message
