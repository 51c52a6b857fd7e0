"""Reading a sink's last marker from its topic's end, against a real broker."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from confluent_kafka import Producer

from onceflow.connectors.markers import (
    FIRST_SPAN,
    Marker,
    ensure_marker_topic,
    last_marker,
    marker_topic_for,
)
from onceflow.connectors.publisher import TransactionalPublisher
from onceflow.connectors.sink import KafkaStreamWriter
from onceflow.connectors.topics import read_committed
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def transactional_producer(conf: dict, txn_id: str) -> Producer:
    producer = Producer({**conf, "transactional.id": txn_id})
    producer.init_transactions(30)
    return producer


def test_the_last_marker_is_found_behind_aborted_attempts_and_other_sinks_markers(
    kafka_bootstrap,
):
    conf = {"bootstrap.servers": kafka_bootstrap}
    topic, me = f"markers-{uuid.uuid4().hex[:8]}", "sink-me"
    ensure_marker_topic(conf, topic)
    producer = transactional_producer(conf, f"writer-{uuid.uuid4().hex[:8]}")
    for batch_id in range(3):
        producer.begin_transaction()
        producer.produce(topic, Marker(me, batch_id, "q", 1).encode(), me.encode())
        producer.commit_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, Marker(me, 3, "q", 1).encode(), me.encode())
    producer.abort_transaction(30)  # an epoch that never became visible
    # More of other sinks' markers than the first read from the end covers.
    producer.begin_transaction()
    for i in range(3 * FIRST_SPAN):
        producer.produce(topic, Marker(f"other-{i}", 9, "q", 1).encode(), f"other-{i}".encode())
    producer.commit_transaction(30)

    assert last_marker(conf, topic, me, wait_s=30) == Marker(me, 2, "q", 1)
    assert last_marker(conf, topic, "never-published", wait_s=30) is None
    producer.begin_transaction()
    producer.produce(topic, None, me.encode())  # a tombstone: start over on purpose
    producer.commit_transaction(30)
    assert last_marker(conf, topic, me, wait_s=30) is None


def test_a_sink_has_a_marker_topic_of_its_own_unless_one_is_named(
    kafka_bootstrap, new_topic, tmp_path
):
    from pyspark.sql.types import BinaryType, StructField, StructType

    sink = new_topic(prefix="out")
    options = {
        "kafka.bootstrap.servers": kafka_bootstrap,
        "topic": sink,
        "appId": f"own-{uuid.uuid4().hex[:8]}",
        "checkpointLocation": str(tmp_path / "ck"),
    }
    schema = StructType([StructField("value", BinaryType())])
    writer = KafkaStreamWriter(options, schema)
    txn_id = f"onceflow-{options['appId']}-{sink}"
    assert writer.marker_topic == marker_topic_for(txn_id) == f"onceflow.commits.{txn_id}"
    named = KafkaStreamWriter({**options, "markerTopic": "shared-markers"}, schema)
    assert (named.marker_topic, named.legacy_marker_topic) == ("shared-markers", None)


def test_an_upgraded_sink_finds_its_last_marker_in_the_shared_topic_it_wrote_before(
    kafka_bootstrap, new_topic
):
    """Before per-sink topics every sink wrote `onceflow.commits`: the replay of the last
    epoch an upgraded app published there must be skipped, not published again."""
    sink = new_topic(prefix="out")
    conf = {"bootstrap.servers": kafka_bootstrap}
    txn_id = f"upgraded-{uuid.uuid4().hex[:8]}"
    shared, own = f"shared-{uuid.uuid4().hex[:8]}", marker_topic_for(txn_id)

    def epoch(publisher, batch_id: int, value: bytes) -> bool:
        return publisher.publish(batch_id, "q", [(sink, None, None, value, None)], [])

    before = TransactionalPublisher(conf, txn_id, shared)
    assert epoch(before, 0, b"e0") and epoch(before, 1, b"e1")

    upgraded = TransactionalPublisher(conf, txn_id, own, legacy_marker_topic=shared)
    assert not epoch(upgraded, 1, b"e1-replayed")
    assert epoch(upgraded, 2, b"e2")
    assert last_marker(conf, own, txn_id, wait_s=30).batch_id == 2

    restarted = TransactionalPublisher(conf, txn_id, own, legacy_marker_topic=shared)
    assert not epoch(restarted, 2, b"e2-replayed")
    assert epoch(restarted, 3, b"e3")
    expected = Counter([b"e0", b"e1", b"e2", b"e3"])
    wait_until(
        lambda: Counter(m.value() for m in read_committed(kafka_bootstrap, sink)) == expected,
        30,
        "each epoch once",
    )


def test_a_tombstone_in_a_sinks_own_topic_keeps_its_shared_markers_from_counting(
    kafka_bootstrap,
):
    conf = {"bootstrap.servers": kafka_bootstrap}
    sink = f"reset-{uuid.uuid4().hex[:8]}"
    shared, own = f"shared-{uuid.uuid4().hex[:8]}", marker_topic_for(sink)
    for topic in (shared, own):
        ensure_marker_topic(conf, topic)
    producer = transactional_producer(conf, f"writer-{uuid.uuid4().hex[:8]}")
    producer.begin_transaction()
    producer.produce(shared, Marker(sink, 5, "q", 1).encode(), sink.encode())
    producer.commit_transaction(30)
    assert last_marker(conf, own, sink, 30, legacy_topic=shared) == Marker(sink, 5, "q", 1)

    producer.begin_transaction()
    producer.produce(own, None, sink.encode())  # the app reset on purpose
    producer.commit_transaction(30)
    assert last_marker(conf, own, sink, 30, legacy_topic=shared) is None
