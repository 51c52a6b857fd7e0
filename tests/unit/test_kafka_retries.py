"""How the offset look-ups the source plans with are retried when a partition has no leader
for a moment, and how a run ends when no broker answers any more.

The admin client is a stand-in here: what is under test is the classification of librdkafka's
answers, which a real broker gives only in a race (a broker between leaders while it shuts
down; tests/integration/test_pipeline.py has that run).
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from confluent_kafka import KafkaError, KafkaException

from onceflow.connectors import kafka_clients
from onceflow.connectors.errors import KafkaUnreachableError

CONF = {"bootstrap.servers": "stand-in:9092"}
NO_LEADER = KafkaError(KafkaError._NOENT, "Failed to query partition leaders: No leaders found")


class StandInAdmin:
    """Answers list_offsets with the next of `answers` (an offset or a KafkaError) and
    list_topics with `metadata_error` if set."""

    def __init__(self, answers: list, metadata_error: KafkaError | None = None) -> None:
        self.answers = answers
        self.metadata_error = metadata_error
        self.requests = 0

    def list_offsets(self, request, **_):
        answer = self.answers[min(self.requests, len(self.answers) - 1)]
        self.requests += 1
        futures = {}
        for tp in request:
            future: Future = Future()
            if isinstance(answer, KafkaError):
                future.set_exception(KafkaException(answer))
            else:
                future.set_result(type("Offset", (), {"offset": answer})())
            futures[tp] = future
        return futures

    def list_topics(self, *_, **__):
        if self.metadata_error is not None:
            raise KafkaException(self.metadata_error)

    def poll(self, _):
        return 0


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setenv("ONCEFLOW_KAFKA_TIMEOUT", "2")

    def install(client: StandInAdmin) -> StandInAdmin:
        monkeypatch.setattr(kafka_clients, "admin", lambda conf: client)
        return client

    return install


def test_a_partition_between_leaders_is_asked_again_until_it_has_one(stand_in):
    client = stand_in(StandInAdmin([NO_LEADER, NO_LEADER, 42]))
    assert kafka_clients.stable_ends(CONF, [("in", 0)]) == {("in", 0): 42}
    assert client.requests == 3


def test_brokers_that_stopped_answering_end_the_run_as_unreachable(stand_in):
    """The partitions lost their leader as the brokers went down; then nobody answers the
    metadata request either: the run ends saying Kafka did not answer, not "no leaders"."""
    stand_in(StandInAdmin([NO_LEADER], KafkaError(KafkaError._TRANSPORT, "Connection refused")))
    with pytest.raises(KafkaUnreachableError) as raised:
        kafka_clients.stable_ends(CONF, [("in", 0)])
    assert str(raised.value).startswith("Kafka at stand-in:9092 did not answer within 2s")


def test_a_partition_that_stays_leaderless_is_named_as_such(stand_in):
    stand_in(StandInAdmin([NO_LEADER]))
    with pytest.raises(KafkaUnreachableError) as raised:
        kafka_clients.stable_ends(CONF, [("in", 0)])
    assert "No leaders found" in str(raised.value)
    assert "Check that every partition of the subscribed topics has a leader" in str(raised.value)
