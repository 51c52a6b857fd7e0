"""Reading a sink's last marker from its topic's end, against a real broker."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from onceflow.connectors import kafka_clients, publisher
from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.connectors.errors import (
    CheckpointMismatchError,
    FencedError,
    OnceflowError,
    OptionError,
)
from onceflow.connectors.markers import (
    FIRST_SPAN,
    Marker,
    ensure_marker_topic,
    last_marker,
    marker_topic_for,
)
from onceflow.connectors.publisher import Epoch, TransactionalPublisher
from onceflow.connectors.sink import KafkaStreamWriter, PreparedRecords, _prepare
from onceflow.connectors.topics import create_topic, read_committed
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def transactional_producer(conf: dict, txn_id: str) -> Producer:
    producer = Producer({**conf, "transactional.id": txn_id})
    producer.init_transactions(30)
    return producer


def test_a_marker_read_ends_at_the_commit_marker_after_the_last_marker(kafka_bootstrap):
    """A sink's markers are written in transactions, so its topic ends on a commit marker,
    which takes an offset but is never delivered. A read ends when the consumer's position
    passes it; it used to wait out a consume call for records that never came (0.2 s per
    read, on every start)."""
    conf = {"bootstrap.servers": kafka_bootstrap}
    topic, me = f"markers-{uuid.uuid4().hex[:8]}", "sink-me"
    ensure_marker_topic(conf, topic)
    producer = transactional_producer(conf, f"writer-{uuid.uuid4().hex[:8]}")
    producer.begin_transaction()
    producer.produce(topic, Marker(me, 7, "q", 1).encode(), me.encode())
    producer.commit_transaction(30)
    assert last_marker(conf, topic, me, 30).batch_id == 7  # the clients, connected

    start = time.monotonic()
    found = [last_marker(conf, topic, me, 30).batch_id for _ in range(10)]
    took = time.monotonic() - start
    assert found == [7] * 10
    assert took < 1.0, f"10 reads took {took:.2f} s"


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


def test_a_restart_reads_its_last_marker_to_the_logs_end_not_a_replaced_leaders(
    kafka_bootstrap, new_topic, monkeypatch, caplog
):
    """A leader that was replaced and does not know it yet (resumed after a hang, or cut off
    from the controller while clients still reach it) answers look-ups with its log's old
    end. A sink that restarts after Kafka committed epoch 1 but before its checkpoint
    recorded that, reading its marker there, would find epoch 0's and publish epoch 1 twice.
    Here the stale answers are given to the look-ups made through the admin client that
    existed at the restart, whose metadata names the replaced leader; the reads and writes
    are the broker's."""
    sink = new_topic(prefix="out")
    conf = {"bootstrap.servers": kafka_bootstrap}
    txn_id = f"replaced-{uuid.uuid4().hex[:8]}"
    topic = marker_topic_for(txn_id)

    def epoch(publisher, batch_id: int, value: bytes) -> bool:
        return publisher.publish(batch_id, "q", [(sink, None, None, value, None)], [])

    crashed = TransactionalPublisher(conf, txn_id, topic)
    assert epoch(crashed, 0, b"e0")
    old_end = kafka_clients.high_watermarks(conf, [(topic, 0)])[topic, 0]
    assert epoch(crashed, 1, b"e1")  # committed; the crash came before the checkpoint knew

    names_the_replaced_leader = kafka_clients.admin(conf)

    def as_the_replaced_leader(look_up):
        def answer(conf, tps):
            ends = look_up(conf, tps)
            if kafka_clients.admin(conf) is not names_the_replaced_leader:
                return ends
            return {tp: min(end, old_end) if tp[0] == topic else end for tp, end in ends.items()}

        return answer

    monkeypatch.setattr(kafka_clients, "ADMIN_REPLACED_EVERY_S", 0.0)
    for look_up in ("high_watermarks", "stable_ends"):
        replaced = as_the_replaced_leader(getattr(kafka_clients, look_up))
        monkeypatch.setattr(kafka_clients, look_up, replaced)
    restarted = TransactionalPublisher(conf, txn_id, topic)
    with caplog.at_level("WARNING", logger="onceflow.sink"):
        assert not epoch(restarted, 1, b"e1-replayed")
    assert "a leader that was replaced and does not know it yet" in caplog.text
    assert epoch(restarted, 2, b"e2")
    expected = Counter([b"e0", b"e1", b"e2"])
    wait_until(
        lambda: Counter(m.value() for m in read_committed(kafka_bootstrap, sink)) == expected,
        30,
        "each epoch once",
    )


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


class DriverSink:
    """The sink's phase 2 as Spark's driver runs it (`KafkaStreamWriter.commit`), over a
    checkpoint written the way Spark writes it, without a query: each `restart()` is a new
    driver process, whose publisher reads its marker from Kafka anew."""

    def __init__(
        self, bootstrap: str, sink_topic: str, checkpoint: Path, guarantee: str = "exactly_once"
    ) -> None:
        from pyspark.sql.types import BinaryType, StructField, StructType

        self.topic, self.checkpoint = sink_topic, checkpoint
        (checkpoint / "offsets").mkdir(parents=True)
        (checkpoint / "metadata").write_text(json.dumps({"id": f"q-{uuid.uuid4()}"}))
        options = {
            "kafka.bootstrap.servers": bootstrap,
            "topic": sink_topic,
            "appId": f"lost-{uuid.uuid4().hex[:8]}",
            "checkpointLocation": str(checkpoint),
            "guarantee": guarantee,
        }
        self.writer = KafkaStreamWriter(options, StructType([StructField("value", BinaryType())]))
        self.writer.legacy_marker_topic = f"shared-{uuid.uuid4().hex[:8]}"  # not the real one

    def plan(self, batch_id: int) -> None:
        """Spark's offset log of batch `batch_id`, which reads offset `batch_id` of the input."""
        offsets = self.checkpoint / "offsets" / str(batch_id)
        if not offsets.exists():
            meta = {"batchWatermarkMs": 0, "batchTimestampMs": 0}
            offsets.write_text(f"v1\n{json.dumps(meta)}\n" + json.dumps({"in": {"0": batch_id}}))

    def commit(self, batch_id: int, value: bytes) -> None:
        """Batch `batch_id`, planned if it is not yet, outputs `value`."""
        self.plan(batch_id)
        table = pa.table({"value": [value]})
        prepared = _prepare(table.to_batches()[0], self.topic, pa)
        self.writer.commit([PreparedRecords(prepared, 1)], batch_id)

    def restart(self) -> None:
        publisher._publishers.clear()

    def epoch(self, batch_id: int) -> Epoch:
        plan = CheckpointDir(self.checkpoint).batch_plan(batch_id)
        query_id = CheckpointDir(self.checkpoint).query_id()
        return Epoch(batch_id, query_id, plan.source_offsets, [], plan.fingerprint)


def test_a_replay_after_the_marker_topic_was_deleted_is_refused_not_published_again(
    kafka_bootstrap, new_topic, tmp_path
):
    """The marker topic holds no marker of a batch the checkpoint records as published: the
    replay of that batch must stop the run, not be published a second time."""
    from confluent_kafka.admin import AdminClient

    sink = DriverSink(kafka_bootstrap, new_topic(prefix="out"), tmp_path / "ck")
    sink.commit(0, b"e0")
    sink.commit(1, b"e1")  # then a crash before Spark's commit log: batch 1 is replayed
    marker_topic = sink.writer.marker_topic
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.delete_topics([marker_topic])[marker_topic].result(30)
    wait_until(
        lambda: marker_topic not in admin.list_topics(timeout=10).topics, 30, "topic deleted"
    )

    sink.restart()
    with pytest.raises(CheckpointMismatchError, match="records that sink .* published batch 1"):
        sink.commit(1, b"e1")
    assert Counter(m.value() for m in read_committed(kafka_bootstrap, sink.topic)) == Counter(
        [b"e0", b"e1"]
    )


def test_epochs_a_rolled_back_version_published_to_the_shared_topic_are_not_published_again(
    kafka_bootstrap, new_topic, tmp_path
):
    """Upgrade, roll back, upgrade again: the epochs the older version published went to the
    shared marker topic, behind the sink's own topic's last marker; the replay of the last of
    them must be skipped, not published a second time."""
    sink = DriverSink(kafka_bootstrap, new_topic(prefix="out"), tmp_path / "ck")
    conf = {"bootstrap.servers": kafka_bootstrap}
    sink.commit(0, b"e0")  # this version: the marker in the sink's own topic

    sink.restart()  # the older version, which knows only the shared topic
    writer = sink.writer
    older = TransactionalPublisher(conf, writer.transactional_id, writer.legacy_marker_topic)
    for batch_id, value in ((1, b"e1"), (2, b"e2")):
        sink.plan(batch_id)
        epoch = replace(sink.epoch(batch_id), records=[(sink.topic, None, None, value, None)])
        assert older.publish_epoch(epoch)
    # The older version's sink stats, written after its last commit; then it crashed.
    CheckpointDir(sink.checkpoint).write_sink_stats({"last_committed_batch": 2})

    sink.restart()  # upgraded again; Spark replays batch 2
    sink.commit(2, b"e2")
    sink.restart()  # killed before Spark's commit log: batch 2 is replayed once more
    sink.commit(2, b"e2")
    sink.commit(3, b"e3")
    wait_until(
        lambda: (
            Counter(m.value() for m in read_committed(kafka_bootstrap, sink.topic))
            == Counter([b"e0", b"e1", b"e2", b"e3"])
        ),
        30,
        "each epoch once",
    )


def test_marker_offsets_deleted_while_they_are_read_fail_the_read_never_skip_the_marker(
    kafka_bootstrap, monkeypatch
):
    """The log start of a marker topic moves past the offset the read starts from (records
    deleted after the read looked up the topic's start): the read must not jump to the end,
    past the sink's marker, and answer "no marker" (its replay would be published again)."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    from onceflow.connectors import kafka_clients

    conf = {"bootstrap.servers": kafka_bootstrap}
    topic, me = f"markers-{uuid.uuid4().hex[:8]}", "sink-me"
    create_topic(conf, topic, 1, {})  # named in sink.marker_topic, with delete retention
    producer = transactional_producer(conf, f"writer-{uuid.uuid4().hex[:8]}")
    producer.begin_transaction()
    for i in range(10):
        producer.produce(topic, Marker(f"other-{i}", 0, "q", 1).encode(), f"other-{i}".encode())
    producer.produce(topic, Marker(me, 7, "q", 1).encode(), me.encode())
    for i in range(2 * FIRST_SPAN):
        producer.produce(topic, Marker(f"other-{i}", 1, "q", 1).encode(), f"other-{i}".encode())
    producer.commit_transaction(30)
    admin = AdminClient(conf)
    admin.delete_records([TopicPartition(topic, 0, 5)])[TopicPartition(topic, 0, 5)].result(30)
    monkeypatch.setattr(kafka_clients, "earliest", lambda conf, tps: {tp: 0 for tp in tps})

    with pytest.raises(OnceflowError, match="were deleted while they were read"):
        last_marker(conf, topic, me, wait_s=30)


@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
def test_an_instance_whose_checkpoint_another_instance_published_from_is_fenced(
    kafka_bootstrap, new_topic, tmp_path, guarantee
):
    """A paused instance resumes after another took over its checkpoint and published: it
    stops as fenced (another instance took over), not with "markers went missing" (whose
    advice, to delete the checkpoint, would hurt the live instance)."""
    sink = DriverSink(kafka_bootstrap, new_topic(prefix="out"), tmp_path / "ck", guarantee)
    sink.commit(0, b"e0")
    paused = publisher._publishers.copy()

    sink.restart()  # the other instance
    sink.commit(1, b"e1")
    publisher._publishers.clear()
    publisher._publishers.update(paused)  # the first one resumes, its marker read long ago
    with pytest.raises(FencedError):
        sink.commit(2, b"e2")
    assert Counter(m.value() for m in read_committed(kafka_bootstrap, sink.topic)) == Counter(
        [b"e0", b"e1"]
    )


def test_a_marker_topic_whose_markers_could_expire_is_refused_at_start(kafka_bootstrap):
    conf = {"bootstrap.servers": kafka_bootstrap}
    topic = f"markers-{uuid.uuid4().hex[:8]}"
    create_topic(conf, topic, 1, {})  # made elsewhere, with delete retention
    with pytest.raises(OptionError, match=f"the marker topic '{topic}' has cleanup.policy=delete"):
        TransactionalPublisher(conf, f"sink-{uuid.uuid4().hex[:8]}", topic).publish(0, "q", [], [])
