"""librdkafka's log through Python logging: a line repeated many times a second is shown once
per window, with a count of those held back."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

from onceflow.connectors import kafka_clients
from onceflow.connectors.errors import KafkaUnreachableError


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


REFUSED = (
    "SASL authentication error: Authentication failed during authentication due to invalid "
    "credentials with SASL mechanism SCRAM-SHA-512"
)


def test_refused_credentials_are_named_by_setting_and_end_the_retries_after_a_grace():
    since = time.monotonic()
    _report(SECURED, KafkaError._AUTHENTICATION, REFUSED)
    message = kafka_clients._why_unreachable(SECURED, since, "timed out")
    assert message == (
        f"Kafka at b:9096 refused the credentials of user 'app' (SCRAM-SHA-512): {REFUSED}. "
        "Check kafka.sasl.username, kafka.sasl.password and kafka.sasl.mechanism."
    )
    grace = kafka_clients.REFUSAL_GRACE_S
    state = SimpleNamespace(seconds_since_start=grace, args=(SECURED,), start_time=since)
    assert kafka_clients._gives_up(state)
    # A user created a moment ago is refused in the same words until it reaches the broker.
    assert not kafka_clients._gives_up(SimpleNamespace(**{**vars(state), "seconds_since_start": 1}))
    assert not kafka_clients._gives_up(SimpleNamespace(**{**vars(state), "args": ({},)}))


def test_an_authentication_cut_short_by_the_network_is_retried():
    """librdkafka reports a connection lost during the SASL handshake as an authentication
    error too; only the broker's refusal ends the retries early."""
    conf = {**SECURED, "bootstrap.servers": "b:9099"}
    since = time.monotonic()
    lost = (
        "SASL SCRAM-SHA-512 mechanism handshake failed: Local: Broker transport failure: "
        "broker's supported mechanisms: (n/a)"
    )
    _report(conf, KafkaError._AUTHENTICATION, lost)
    state = SimpleNamespace(seconds_since_start=30, args=(conf,), start_time=since)
    assert not kafka_clients._gives_up(state)
    message = kafka_clients._why_unreachable(conf, since, "timed out")
    assert message.startswith(
        f"Kafka at b:9099 did not answer within 60s; the client's last error: {lost}."
    )


def test_a_tls_listener_hanging_up_on_a_plaintext_client_says_which_setting_to_check():
    conf = {**SECURED, "bootstrap.servers": "b:9097", "security.protocol": "SASL_PLAINTEXT"}
    since = time.monotonic()
    hung_up = "Disconnected: connection closed by peer (after 1ms in state APIVERSION_QUERY)"
    _report(conf, KafkaError._TRANSPORT, hung_up)
    kafka_clients.client_conf(conf)["error_cb"](KafkaError(KafkaError._ALL_BROKERS_DOWN))
    message = kafka_clients._why_unreachable(conf, since, "timed out")
    assert f"the client's last error: {hung_up}. The broker closed the connection" in message
    assert "set kafka.security.protocol (SASL_PLAINTEXT) to SSL or SASL_SSL" in message
    assert "hunter2" not in message


def test_an_error_from_before_a_request_that_was_answered_is_not_the_cause(monkeypatch):
    conf = {"bootstrap.servers": "b:9098"}
    _report(conf, KafkaError._SSL, "certificate verify failed")
    monkeypatch.setitem(kafka_clients._last_answers, kafka_clients._key(conf), time.monotonic())
    message = kafka_clients._why_unreachable(conf, time.monotonic() + 1, "Local: Timed out")
    assert "the client's last error: Local: Timed out." in message


def test_a_connection_failure_just_before_the_request_is_its_cause():
    """librdkafka logs a failure, then its identical repeats once per 30 s: a client that
    keeps a connection to every broker logs the refusal as the broker goes, before the
    look-up that then fails, and logs nothing new while it is retried."""
    conf = {"bootstrap.servers": "b:9097"}
    _report(conf, KafkaError._TRANSPORT, "Connect to ipv4#10.0.0.1:9097 failed: Connection refused")
    message = kafka_clients._why_unreachable(conf, time.monotonic() + 5, "Local: Timed out")
    assert "Connection refused" in message


def test_an_error_queued_before_a_request_is_not_taken_for_its_cause(monkeypatch):
    """librdkafka queues a client's errors until it is polled, and they are stamped when
    delivered: a refusal queued before this request must not be named as its cause."""
    conf = {"bootstrap.servers": "b:9100", "sasl.username": "app", "sasl.mechanism": "PLAIN"}
    remember = kafka_clients.client_conf(conf)["error_cb"]
    queued = [KafkaError(KafkaError._AUTHENTICATION, REFUSED)]

    class QueuingAdmin:
        def poll(self, timeout: float) -> None:
            while queued:
                remember(queued.pop())

    monkeypatch.setattr(kafka_clients, "admin", lambda conf: QueuingAdmin())
    monkeypatch.setenv("ONCEFLOW_KAFKA_TIMEOUT", "0.2")

    @kafka_clients.kafka_request
    def look_up(conf: dict[str, str]) -> None:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Local: Broker transport failure"))

    with pytest.raises(KafkaUnreachableError) as failed:
        look_up(conf)
    assert str(failed.value).startswith("Kafka at b:9100 did not answer within 0.2s"), failed.value


def test_the_admin_clients_look_ups_never_create_a_topic(monkeypatch):
    """librdkafka's admin client is a producer, whose metadata look-up of a missing topic
    creates it where the broker allows auto-creation (Kafka's default): a misspelled source
    topic would then be created empty instead of refused."""
    made = []
    monkeypatch.setattr(kafka_clients, "AdminClient", lambda conf: made.append(conf) or conf)
    monkeypatch.setattr(kafka_clients, "_admins", {})
    kafka_clients.admin({"bootstrap.servers": "b:9092"})
    assert made[0]["allow.auto.create.topics"] is False


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.NOT_COORDINATOR,
    ],
)
def test_a_cluster_moving_its_leaders_is_retried_like_a_broker_that_did_not_answer(code):
    """A rolling restart answered the source's offset look-up with FENCED_LEADER_EPOCH, not
    marked retriable, and the run died although two of three nodes were up."""
    assert kafka_clients.retriable(KafkaException(KafkaError(code)))
    assert not kafka_clients.retriable(
        KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    )
