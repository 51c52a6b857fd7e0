"""The Kafka source against a real broker: exact record sets, gaps, open transactions, loss."""

from __future__ import annotations

import itertools
import time
import uuid
from collections import Counter

import pytest
from confluent_kafka import Producer, TopicPartition
from pyspark.errors import StreamingQueryException

from onceflow.connectors import kafka_clients, offsets
from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.connectors.source import OffsetRange
from tests.helpers import (
    aborted_records_before_an_open_transaction,
    drain,
    produce,
    source_reader,
    started,
    wait_until,
)

pytestmark = pytest.mark.integration


def records_of(rows) -> dict[int, list[tuple[int, bytes]]]:
    """(offset, value) per partition, in the order the source emitted them."""
    by_partition: dict[int, list[tuple[int, bytes]]] = {}
    for r in rows:
        by_partition.setdefault(r.partition, []).append((r.offset, bytes(r.value)))
    return by_partition


def test_exact_records_and_order_per_partition_across_many_batches(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=3)
    produce(
        kafka_bootstrap,
        topic,
        ((str(i).encode(), f"v{i}".encode(), i % 3) for i in range(3000)),
    )
    df = source_reader(spark, kafka_bootstrap, topic, maxOffsetsPerTrigger="250")
    rows, progress = drain(df, str(tmp_path / "ck"))

    batches = [p["numInputRows"] for p in progress if p["numInputRows"]]
    assert len(batches) >= 12 and max(batches) <= 250 + 3
    expected = {p: [(i // 3, f"v{i}".encode()) for i in range(p, 3000, 3)] for p in range(3)}
    # Memory-sink rows keep batch order, so this checks per-partition order too.
    assert records_of(rows) == expected
    assert {r.topic for r in rows} == {topic}
    assert all(r.timestampType == 0 and r.timestamp is not None for r in rows)


def test_aborted_transactions_never_appear_and_nothing_is_skipped(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=2)
    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"t-{uuid.uuid4()}"}
    )
    producer.init_transactions(30)
    expected: dict[int, list[bytes]] = {0: [], 1: []}
    for txn in range(12):
        producer.begin_transaction()
        for i in range(25):
            value = f"txn{txn}-{i}".encode()
            producer.produce(topic, value=value, partition=i % 2)
            if txn % 3 != 1:
                expected[i % 2].append(value)
        if txn % 3 == 1:
            producer.flush(30)
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(30)

    # Small batches end inside aborted ranges and on transaction markers.
    df = source_reader(spark, kafka_bootstrap, topic, maxOffsetsPerTrigger="17")
    rows, _ = drain(df, str(tmp_path / "ck"))
    got = {p: [v for _, v in recs] for p, recs in records_of(rows).items()}
    assert got == expected


def test_a_read_ending_on_a_transaction_marker_does_not_wait_for_a_record(
    kafka_bootstrap, new_topic
):
    """A transaction's commit marker takes an offset but is never delivered, so every range
    of a topic written in transactions (the output of another pipeline) ends on one. The
    read ends when the consumer's position passes it; it used to wait out a consume call
    that asked for one record more than came: 1 s per range."""
    from onceflow.connectors.source import read_range

    topic = new_topic(partitions=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": topic})
    producer.init_transactions(30)
    for txn in range(4):  # offsets 6k..6k+4 the records, 6k+5 the marker
        producer.begin_transaction()
        for i in range(5):
            producer.produce(topic, value=f"t{txn}-{i}".encode(), partition=0)
        if txn == 2:
            producer.flush(30)
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(30)
    conf = {"bootstrap.servers": kafka_bootstrap}
    list(read_range(conf, OffsetRange(topic, 0, 0, 1), True))  # the consumer, connected

    took, values = [], Counter()
    for lo, hi in ((0, 6), (6, 12), (12, 18), (18, 24), (0, 24)):
        start = time.monotonic()
        batches = list(read_range(conf, OffsetRange(topic, 0, lo, hi), True))
        took.append(round(time.monotonic() - start, 3))
        values.update(v for b in batches for v in b.column("value").to_pylist())
    expected = Counter(f"t{txn}-{i}".encode() for txn in (0, 1, 3) for i in range(5))
    assert values == expected + expected  # each range once, then all of them again
    assert max(took) < 0.5, f"seconds per read: {took}"


def test_a_range_ending_in_aborted_records_before_an_open_transaction_is_read_to_its_end(
    kafka_bootstrap, new_topic, monkeypatch
):
    """Aborted records just before another producer's open transaction: none is delivered
    and their abort marker lies past the stable end, so the consumer's position stays at
    their start. The partition's end event says the range is read; the read used to wait for
    a position that moved only once the other transaction ended, and failed as stalled."""
    from onceflow.connectors import source
    from onceflow.connectors.source import read_range

    monkeypatch.setattr(source, "READ_STALL_TIMEOUT_S", 5.0)
    topic = new_topic(partitions=1)
    conf = {"bootstrap.servers": kafka_bootstrap}
    produce(kafka_bootstrap, topic, [(None, b"before", 0)])  # offset 0
    with aborted_records_before_an_open_transaction(kafka_bootstrap, topic) as stable_end:
        assert stable_end == 4  # offsets 1-3 aborted
        batches = list(read_range(conf, OffsetRange(topic, 0, 0, stable_end), True))
        assert [v for b in batches for v in b.column("value").to_pylist()] == [b"before"]


def test_open_input_transaction_holds_back_only_its_partition(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=2)
    produce(kafka_bootstrap, topic, ((None, f"before-{i}".encode(), i % 2) for i in range(20)))
    open_txn = Producer(
        {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"open-{uuid.uuid4()}"}
    )
    open_txn.init_transactions(30)
    open_txn.begin_transaction()
    for i in range(5):
        open_txn.produce(topic, value=f"pending-{i}".encode(), partition=0)
    open_txn.flush(30)

    name = f"open_{uuid.uuid4().hex[:8]}"
    query = started(
        source_reader(spark, kafka_bootstrap, topic)
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(processingTime="200 milliseconds")
    )
    try:

        def values():
            return sorted(
                bytes(r.value).decode() for r in spark.sql(f"select value from {name}").collect()
            )

        wait_until(lambda: len(values()) == 20, what="records before the open transaction")
        # Partition 1 keeps flowing while partition 0 has an open transaction.
        produce(kafka_bootstrap, topic, ((None, f"after-{i}".encode(), 1) for i in range(10)))
        wait_until(lambda: len(values()) == 30, what="partition 1 to progress")
        assert not [v for v in values() if v.startswith("pending")]

        open_txn.commit_transaction(30)
        wait_until(lambda: len(values()) == 35, what="the committed transaction to be read")
        expected = (
            [f"before-{i}" for i in range(20)]
            + [f"after-{i}" for i in range(10)]
            + [f"pending-{i}" for i in range(5)]
        )
        assert values() == sorted(expected)
    finally:
        query.stop()


def test_partition_added_mid_stream_joins_from_earliest(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    from confluent_kafka.admin import NewPartitions

    topic = new_topic(partitions=1)
    checkpoint = str(tmp_path / "ck")
    produce(kafka_bootstrap, topic, ((None, f"a{i}".encode(), 0) for i in range(10)))
    rows1, _ = drain(source_reader(spark, kafka_bootstrap, topic), checkpoint)

    admin = kafka_clients.admin({"bootstrap.servers": kafka_bootstrap})
    admin.create_partitions([NewPartitions(topic, 2)])[topic].result(30)
    wait_until(
        lambda: len(admin.list_topics(topic, timeout=5).topics[topic].partitions) == 2,
        what="the new partition",
    )
    produce(kafka_bootstrap, topic, ((None, f"b{i}".encode(), 1) for i in range(7)))
    produce(kafka_bootstrap, topic, ((None, f"c{i}".encode(), 0) for i in range(3)))
    rows2, _ = drain(source_reader(spark, kafka_bootstrap, topic), checkpoint)

    assert sorted(bytes(r.value).decode() for r in rows1) == sorted(f"a{i}" for i in range(10))
    assert records_of(rows2) == {
        0: [(10 + i, f"c{i}".encode()) for i in range(3)],
        1: [(i, f"b{i}".encode()) for i in range(7)],
    }


def test_restart_from_checkpoint_resumes_where_the_last_batch_ended(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=2)
    checkpoint = str(tmp_path / "ck")
    produce(kafka_bootstrap, topic, ((None, f"first-{i}".encode(), i % 2) for i in range(500)))
    rows1, _ = drain(
        source_reader(spark, kafka_bootstrap, topic, maxOffsetsPerTrigger="120"), checkpoint
    )
    produce(kafka_bootstrap, topic, ((None, f"second-{i}".encode(), i % 2) for i in range(300)))
    rows2, _ = drain(
        source_reader(spark, kafka_bootstrap, topic, maxOffsetsPerTrigger="120"), checkpoint
    )

    first = {(r.partition, r.offset) for r in rows1}
    second = {(r.partition, r.offset) for r in rows2}
    assert len(first) == len(rows1) == 500 and len(second) == len(rows2) == 300
    assert not first & second
    assert sorted(bytes(r.value).decode() for r in rows2) == sorted(
        f"second-{i}" for i in range(300)
    )


def _delete_before(bootstrap: str, topic: str, partition: int, offset: int) -> None:
    admin = kafka_clients.admin({"bootstrap.servers": bootstrap})
    futures = admin.delete_records([TopicPartition(topic, partition, offset)])
    for f in futures.values():
        f.result(30)


def _lose_unread_offsets(spark, kafka_bootstrap, topic: str, checkpoint: str) -> None:
    """Read offsets 0..9, produce 10..19, then delete 10..14 before the query reads them."""
    produce(kafka_bootstrap, topic, ((None, f"a{i}".encode(), 0) for i in range(10)))
    drain(source_reader(spark, kafka_bootstrap, topic), checkpoint)
    produce(kafka_bootstrap, topic, ((None, f"b{i}".encode(), 0) for i in range(10)))
    _delete_before(kafka_bootstrap, topic, 0, 15)


def _data_loss_message(spark, bootstrap: str, topic: str, checkpoint: str) -> str:
    """The failure of a run from `checkpoint` (default options), which must be data loss on
    partition 0 of `topic`."""
    with pytest.raises(StreamingQueryException) as info:
        drain(source_reader(spark, bootstrap, topic), checkpoint)
    message = str(info.value)
    assert f"data loss on topic {topic} partition 0" in message
    return message


def test_retention_loss_fails_the_query_by_default(spark, kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic(partitions=1)
    checkpoint = str(tmp_path / "ck")
    _lose_unread_offsets(spark, kafka_bootstrap, topic, checkpoint)

    message = _data_loss_message(spark, kafka_bootstrap, topic, checkpoint)
    assert "expected offset 10" in message and "earliest available offset is 15" in message


def test_retention_loss_skips_ahead_when_allowed_and_counts_the_lost_offsets(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=1)
    checkpoint = str(tmp_path / "ck")
    _lose_unread_offsets(spark, kafka_bootstrap, topic, checkpoint)

    reader = source_reader(
        spark, kafka_bootstrap, topic, failOnDataLoss="false", checkpointLocation=checkpoint
    )
    rows, _ = drain(reader, checkpoint)
    assert records_of(rows) == {0: [(10 + i, f"b{i}".encode()) for i in range(5, 10)]}
    assert CheckpointDir(checkpoint).source_stats() == {(topic, 0): 5}  # for the metrics endpoint


def test_unknown_topic_fails_fast_naming_the_option(spark, kafka_bootstrap, tmp_path):
    df = source_reader(spark, kafka_bootstrap, "no-such-topic-" + uuid.uuid4().hex[:6])
    with pytest.raises(StreamingQueryException, match=r"option 'subscribe'.*do not exist"):
        drain(df, str(tmp_path / "ck"))


def test_malformed_starting_offsets_fails_naming_the_option(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic()
    df = source_reader(spark, kafka_bootstrap, topic, startingOffsets='{"oops": ')
    with pytest.raises(Exception, match=r"option 'startingOffsets'.*not valid JSON"):
        drain(df, str(tmp_path / "ck"))


def test_parallelism_reads_each_batch_in_that_many_equal_tasks(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=3)
    produce(kafka_bootstrap, topic, ((None, f"v{i}".encode(), i % 3) for i in range(2_999)))
    df = source_reader(spark, kafka_bootstrap, topic, parallelism="2")
    rows, _ = drain(df.selectExpr("*", "spark_partition_id() AS task"), str(tmp_path / "ck"))
    for p, count in enumerate((1_000, 1_000, 999)):
        assert sorted(r.offset for r in rows if r.partition == p) == list(range(count))
    per_task = Counter(r.task for r in rows)
    assert sorted(per_task.values()) == [1_499, 1_500]


# -- offsets that go backwards, gone offsets, partitions that come and go (issue: no holes) --


def _recreate(bootstrap: str, topic: str, partitions: int) -> None:
    """Delete `topic` and create it again, empty: its offsets start over at 0."""
    from onceflow.connectors.topics import create_topic

    admin = kafka_clients.admin({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic])[topic].result(30)
    wait_until(lambda: topic not in admin.list_topics(timeout=5).topics, what="topic deleted")

    def created() -> bool:
        try:
            create_topic(bootstrap, topic, partitions)
            return True
        except Exception:  # the deletion may still be in progress on the broker
            return False

    wait_until(created, what="topic created again")


def _read_then_recreate(
    spark, bootstrap: str, topic: str, checkpoint: str, read: int = 500, **options
) -> None:
    """Read offsets 0..read-1 of partition 0, then recreate the topic with 300 new records."""
    produce(bootstrap, topic, ((None, f"old{i}".encode(), 0) for i in range(read)))
    drain(source_reader(spark, bootstrap, topic, **options), checkpoint)
    _recreate(bootstrap, topic, 1)
    produce(bootstrap, topic, ((None, f"new{i}".encode(), 0) for i in range(300)))


def test_a_recreated_topic_is_data_loss_naming_both_offsets(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=1)
    checkpoint = str(tmp_path / "ck")
    _read_then_recreate(spark, kafka_bootstrap, topic, checkpoint)

    message = _data_loss_message(spark, kafka_bootstrap, topic, checkpoint)
    assert "deleted and created again" in message
    assert "expected offset 500 next" in message and "holds offsets [0, 300)" in message


def test_a_recreated_topic_refilled_past_the_checkpoint_is_data_loss(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    """The new topic already holds more records than the checkpoint's offset: only the
    topic's id, written ahead beside the offsets, tells the two topics apart."""
    topic = new_topic(partitions=1)
    checkpoint = str(tmp_path / "ck")
    _read_then_recreate(spark, kafka_bootstrap, topic, checkpoint, read=100)

    message = _data_loss_message(spark, kafka_bootstrap, topic, checkpoint)
    assert "deleted and created again" in message and "expected offset 100 next" in message


def test_a_recreated_topic_refilled_past_the_checkpoint_is_read_whole_when_allowed(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=1)
    checkpoint = str(tmp_path / "ck")
    options = {"failOnDataLoss": "false", "checkpointLocation": checkpoint}
    _read_then_recreate(spark, kafka_bootstrap, topic, checkpoint, read=100, **options)

    rows, _ = drain(source_reader(spark, kafka_bootstrap, topic, **options), checkpoint)
    assert records_of(rows) == {0: [(i, f"new{i}".encode()) for i in range(300)]}
    assert CheckpointDir(checkpoint).source_stats() == {(topic, 0): 100}


def test_a_recreated_topic_restarts_from_earliest_when_allowed(
    spark, kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=1)
    checkpoint = str(tmp_path / "ck")
    options = {"failOnDataLoss": "false", "checkpointLocation": checkpoint}
    _read_then_recreate(spark, kafka_bootstrap, topic, checkpoint, **options)

    rows, _ = drain(source_reader(spark, kafka_bootstrap, topic, **options), checkpoint)
    # Every new record exactly once, in order; the rewind (500 offsets) is counted.
    assert records_of(rows) == {0: [(i, f"new{i}".encode()) for i in range(300)]}
    assert CheckpointDir(checkpoint).source_stats() == {(topic, 0): 500}
    produce(kafka_bootstrap, topic, ((None, f"later{i}".encode(), 0) for i in range(5)))
    rows, _ = drain(source_reader(spark, kafka_bootstrap, topic, **options), checkpoint)
    assert records_of(rows) == {0: [(300 + i, f"later{i}".encode()) for i in range(5)]}


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_a_batch_replayed_after_its_topic_was_recreated_reads_nothing_of_the_new_topic(
    kafka_bootstrap, new_topic, tmp_path, fail_on_data_loss
):
    """The app stopped after batch N was written ahead; the topic was recreated and refilled
    past N's end before it came back. Replaying N must not read the new topic's records at
    the old offsets (the next batch restarts the partition from its earliest offset and
    would read them again)."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from onceflow.connectors.errors import DataLossError
    from onceflow.connectors.source import KafkaStreamReader

    topic = new_topic(partitions=1)
    produce(kafka_bootstrap, topic, ((None, f"old{i}".encode(), 0) for i in range(50)))
    checkpoint = CheckpointDir(tmp_path / "ck")
    reader = KafkaStreamReader(
        {
            "kafka.bootstrap.servers": kafka_bootstrap,
            "subscribe": topic,
            "startingOffsets": "earliest",
            "failOnDataLoss": str(fail_on_data_loss).lower(),
            "checkpointLocation": str(tmp_path / "ck"),
        }
    )
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadAllAvailable())  # batch N: [0, 50), written ahead
    _recreate(kafka_bootstrap, topic, 1)
    produce(kafka_bootstrap, topic, ((None, f"new{i}".encode(), 0) for i in range(80)))

    if fail_on_data_loss:
        with pytest.raises(DataLossError, match=r"after this batch planned to read offsets"):
            reader.partitions(start, end)
        return
    assert reader.partitions(start, end) == []
    assert reader.partitions(start, end) == []  # a replay again: counted once, further below
    restart = reader.latestOffset(end, ReadAllAvailable())  # N+1 restarts the partition at 0
    assert offsets.positions(restart) == {(topic, 0): 0}
    assert checkpoint.source_stats() == {(topic, 0): 50}
    assert reader.partitions(end, restart) == []
    (task,) = reader.partitions(restart, reader.latestOffset(restart, ReadAllAvailable()))
    assert task.ranges == (OffsetRange(topic, 0, 0, 80, 0, 0),)  # every new record, once


def test_a_read_never_delivers_an_offset_outside_its_range(
    kafka_bootstrap, new_topic, tmp_path, monkeypatch
):
    """A range whose offsets are gone when it is read (the topic was recreated after the
    batch was planned): nothing below its start is delivered, and the gone offsets count.
    (Past the end of the leader's log they count once the read has waited for a leader that
    holds them: one second here.)"""
    from onceflow.connectors import source
    from onceflow.connectors.source import OffsetRange, read_range

    monkeypatch.setattr(source, "BEHIND_LEADER_WAIT_S", 1.0)

    topic = new_topic(partitions=1)
    produce(kafka_bootstrap, topic, ((None, f"v{i}".encode(), 0) for i in range(20)))
    conf = {"bootstrap.servers": kafka_bootstrap}
    checkpoint = CheckpointDir(tmp_path / "ck")

    batches = list(read_range(conf, OffsetRange(topic, 0, 50, 60), False, checkpoint))
    assert sum(b.num_rows for b in batches) == 0
    assert checkpoint.source_stats() == {(topic, 0): 10}

    _delete_before(kafka_bootstrap, topic, 0, 15)
    batches = list(read_range(conf, OffsetRange(topic, 0, 10, 18), False, checkpoint))
    offsets = [o for b in batches for o in b.column("offset").to_pylist()]
    assert offsets == [15, 16, 17]
    assert checkpoint.source_stats() == {(topic, 0): 15}

    with pytest.raises(Exception, match=r"offset 10 of the batch's range \[10, 18\) is gone"):
        list(read_range(conf, OffsetRange(topic, 0, 10, 18), True, checkpoint))


def test_a_new_partition_starts_in_the_offset_log_before_it_is_read(kafka_bootstrap, new_topic):
    """The batch that discovers a partition logs its earliest offset as the end and reads
    nothing of it; the next batch's start is then in the offset log, so a replay cannot
    ask the broker again (retention may have moved the earliest offset meanwhile)."""
    from confluent_kafka.admin import NewPartitions
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from onceflow.connectors.source import KafkaStreamReader

    topic = new_topic(partitions=1)
    produce(kafka_bootstrap, topic, ((None, b"a", 0) for _ in range(4)))
    admin = kafka_clients.admin({"bootstrap.servers": kafka_bootstrap})
    admin.create_partitions([NewPartitions(topic, 2)])[topic].result(30)
    wait_until(
        lambda: len(admin.list_topics(topic, timeout=5).topics[topic].partitions) == 2,
        what="the new partition",
    )
    produce(kafka_bootstrap, topic, ((None, b"b", 1) for _ in range(6)))
    reader = KafkaStreamReader({"kafka.bootstrap.servers": kafka_bootstrap, "subscribe": topic})
    start = {topic: {"0": 1}}
    end = reader.latestOffset(start, ReadAllAvailable())
    assert offsets.positions(end) == {(topic, 0): 4, (topic, 1): 0}
    assert offsets.leader_epochs(end) == {(topic, 0): 0, (topic, 1): 0}  # of one broker
    (task,) = reader.partitions(start, end)
    assert task.ranges == (OffsetRange(topic, 0, 1, 4, None, 0),)  # `start` has no epochs
    after = reader.latestOffset(end, ReadAllAvailable())
    assert offsets.positions(after) == {(topic, 0): 4, (topic, 1): 6}


def test_a_long_read_is_never_taken_for_a_stall(kafka_bootstrap, new_topic, monkeypatch):
    """Progress is every offset read, not only the consumer's position: here each look at
    the clock is 61 s later, so a read that missed its own progress would fail as stalled."""
    from onceflow.connectors import source
    from onceflow.connectors.source import read_range

    topic = new_topic(partitions=1)
    produce(kafka_bootstrap, topic, ((None, b"v", 0) for _ in range(60_000)))
    clock = itertools.count(0, 61)  # thread-safe: other threads may read the clock too
    monkeypatch.setattr(source.time, "monotonic", lambda: next(clock))
    range_consumer = kafka_clients.range_consumer
    monkeypatch.setattr(
        kafka_clients, "range_consumer", lambda conf: _RecordsEveryCall(range_consumer(conf))
    )
    conf = {"bootstrap.servers": kafka_bootstrap}
    batches = list(read_range(conf, OffsetRange(topic, 0, 0, 60_000), True))
    assert [o for b in batches for o in b.column("offset").to_pylist()] == list(range(60_000))


class _RecordsEveryCall:
    """A consumer whose consume calls come back only with records: a call that came back
    empty (a fetch still on its way) is no progress, and with a clock that jumps 61 s per
    look it would count as a stall."""

    def __init__(self, consumer) -> None:
        self._consumer = consumer

    def consume(self, count: int, timeout: float) -> list:
        for _ in range(3_000):
            if messages := self._consumer.consume(count, timeout):
                return messages
        raise AssertionError(f"no record came in {3_000 * timeout:.0f} s")

    def __getattr__(self, name: str):
        return getattr(self._consumer, name)


def test_where_a_log_was_cut_is_the_leaders_end_of_the_asked_epoch(kafka_bootstrap, new_topic):
    """`_where_cut` against a real leader, asked about offsets past its log: the end of the
    epoch asked about (one leader, one epoch: the log's end), and nothing for an epoch it
    never had. Asked for several partitions in turn on the process' one range consumer,
    whose assignment starts a fetch out of range before each question is asked."""
    from onceflow.connectors.source import _where_cut

    topic = new_topic(partitions=3)
    produce(kafka_bootstrap, topic, ((b"k", b"v", p) for p in range(3) for _ in range(p + 5)))
    conf = {"bootstrap.servers": kafka_bootstrap}
    epochs = kafka_clients.stable_ends_and_epochs(conf, [(topic, p) for p in range(3)])
    for _, p in itertools.product(range(3), range(3)):
        end, epoch = epochs[(topic, p)]
        assert end == p + 5
        assert _where_cut(conf, (topic, p), end + 10, epoch + 1) is None  # "No epoch found"
        assert _where_cut(conf, (topic, p), end + 10, epoch) == end
