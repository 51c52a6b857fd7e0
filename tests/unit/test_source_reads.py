"""How a read task (source.read_range) answers what its consumer reports, with a fake consumer
that replays librdkafka's events: records, and the errors it reports as _AUTO_OFFSET_RESET
under auto.offset.reset=error (the range consumer's setting)."""

import pytest
from confluent_kafka import KafkaError, KafkaException

from onceflow.connectors import kafka_clients, source
from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.connectors.errors import DataLossError
from onceflow.connectors.source import OffsetRange, read_range

TOPIC = "t"


class _Message:
    def __init__(self, offset: int, err: KafkaError | None = None, epoch: int = 3) -> None:
        self._offset, self._err, self._epoch = offset, err, epoch

    def leader_epoch(self):
        return self._epoch

    def error(self):
        return self._err

    def offset(self):
        return None if self._offset < 0 else self._offset  # as confluent_kafka's Message does

    def key(self):
        return b"k"

    def value(self):
        return f"v{self._offset}".encode()

    def topic(self):
        return TOPIC

    def partition(self):
        return 0

    def timestamp(self):
        return (1, 1)

    def headers(self):
        return None


def _reset_error(offset: int, reason: str, cause: int) -> _Message:
    """A consumer error as librdkafka's rd_kafka_offset_reset reports it with
    auto.offset.reset=error: code _AUTO_OFFSET_RESET, the reset's position as its offset, and
    "<reason>: <err2str(cause)> (broker <id>)" as its string (src/rdkafka_offset.c)."""
    text = f"{reason}: {KafkaError(cause).str()} (broker 1)"
    return _Message(offset, KafkaError(KafkaError._AUTO_OFFSET_RESET, text))


# librdkafka's two reports of a truncated log (KIP-320 offset validation,
# src/rdkafka_offset.c rd_kafka_offset_validate_op_cb): the leader's log of the epoch of the
# read position ends below it, or the leader knows no such epoch.
TRUNCATED = _reset_error(
    -1001,  # the "Reset to INVALID" branch reports OFFSET_INVALID as the offset
    "Partition log truncation detected at offset 100 (leader epoch 2): broker end offset is "
    "60 (offset leader epoch 2). Reset to INVALID.",
    KafkaError._LOG_TRUNCATION,
)
NO_EPOCH = _reset_error(
    100,
    "No epoch found less or equal to offset 100 (leader epoch 2): broker end offset is -1 "
    "(offset leader epoch -1). Reset using configured policy.",
    KafkaError._LOG_TRUNCATION,
)
# A fetch answered OFFSET_OUT_OF_RANGE (src/rdkafka_fetcher.c): a stale leader, or gone offsets.
OUT_OF_RANGE = _reset_error(
    100,
    "fetch failed due to requested offset not available on the broker",
    KafkaError.OFFSET_OUT_OF_RANGE,
)


class FakeConsumer:
    """Delivers offsets 0..99 of the range, then `event`, then (once assigned anew) whatever
    the log holds from the assigned offset up to `log_end`; the leader's watermarks are
    `watermarks`."""

    def __init__(self, event: _Message, log_end: int = 200, watermarks=(0, 200)) -> None:
        self.event, self.log_end, self.watermarks = event, log_end, watermarks
        self.calls = 0
        self.pos = 0
        self.assigned: list[int] = []
        self.seeks: list[tuple[int, int]] = []  # (offset, leader epoch) of each seek taken
        self.refusals = 0  # seeks to refuse first, as before the assignment reached librdkafka

    def assign(self, tps):
        self.pos = tps[0].offset
        self.assigned.append(self.pos)

    def seek(self, tp):
        if self.refusals:
            self.refusals -= 1
            raise KafkaException(KafkaError(KafkaError._STATE))
        self.seeks.append((tp.offset, tp.leader_epoch))

    def unassign(self):
        pass

    def consume(self, n, timeout):
        self.calls += 1
        if self.calls == 1:
            self.pos = 100
            return [_Message(o) for o in range(100)]
        if self.calls == 2:
            return [self.event]
        out = [_Message(o) for o in range(self.pos, self.log_end)]
        self.pos = max(self.pos, self.log_end)
        return out

    def position(self, tps):
        class Position:
            offset = self.pos

        return [Position()]

    def list_topics(self, *args, **kwargs):
        pass

    def get_watermark_offsets(self, tp, timeout):
        return self.watermarks


@pytest.fixture
def consumer_of(monkeypatch):
    monkeypatch.setattr(source, "BEHIND_LEADER_RETRY_S", 0.0)

    def use(consumer: FakeConsumer) -> FakeConsumer:
        monkeypatch.setattr(kafka_clients, "range_consumer", lambda conf: consumer)
        return consumer

    return use


def _offsets(batches) -> list[int]:
    return [o for b in batches for o in b.column("offset").to_pylist()]


def test_a_log_truncation_librdkafka_detects_fails_the_read_as_data_loss(consumer_of):
    # Offsets 0..99 read; an unclean leader election leaves the new leader's log ending at
    # 60, and producers append new records at 60..199: the leader's log holds offset 100
    # again, but not the record the batch planned to read there.
    consumer = consumer_of(FakeConsumer(TRUNCATED))
    read: list = []
    with pytest.raises(DataLossError) as info:
        read.extend(read_range({}, OffsetRange(TOPIC, 0, 0, 200), fail_on_data_loss=True))
    message = str(info.value)
    assert f"topic {TOPIC} partition 0" in message
    assert "offset 100" in message and "[0, 200)" in message  # where, and the batch's range
    assert "truncat" in message  # what happened
    assert "failOnDataLoss=false" in message and "restore the input topic" in message
    assert consumer.assigned == [0]  # never read on over the leader's new records


def test_with_fail_on_data_loss_false_a_truncated_range_is_counted_and_skipped(
    consumer_of, tmp_path
):
    consumer_of(FakeConsumer(TRUNCATED))
    checkpoint = CheckpointDir(tmp_path)
    batches = list(read_range({}, OffsetRange(TOPIC, 0, 0, 200), False, checkpoint))
    assert _offsets(batches) == list(range(100))  # none of the leader's new records
    assert checkpoint.source_stats() == {(TOPIC, 0): 100}  # the range's offsets not read


@pytest.mark.parametrize("event", [OUT_OF_RANGE, NO_EPOCH], ids=["out-of-range", "no-epoch"])
def test_an_answer_from_a_broker_behind_the_leader_still_reads_on(consumer_of, event):
    """A leader paused past its session timeout answers a fetch OFFSET_OUT_OF_RANGE, or an
    offset validation with no epoch as new as the read position's ("No epoch found", Kafka's
    LeaderEpochFileCache.endOffsetFor for an epoch newer than any it knows): the leader is
    asked again, and holds the offsets; nothing is lost."""
    consumer = consumer_of(FakeConsumer(event))
    batches = list(read_range({}, OffsetRange(TOPIC, 0, 0, 200), fail_on_data_loss=True))
    assert _offsets(batches) == list(range(200))
    assert consumer.assigned == [0, 100]


def test_a_read_validates_its_start_in_the_start_epoch_and_later_positions_in_the_end_epoch(
    consumer_of,
):
    """KIP-320: the leader is asked where its log of the offset's epoch ends before a record
    is taken (librdkafka does so on a seek, never on an assignment). The range's start was
    in the log of `start_epoch`; every offset up to its end in the log of `end_epoch`."""
    consumer = consumer_of(FakeConsumer(OUT_OF_RANGE))
    consumer.refusals = 2  # the assignment has not reached the partition yet: asked again
    batches = list(read_range({}, OffsetRange(TOPIC, 0, 0, 200, 1, 3), fail_on_data_loss=True))
    assert _offsets(batches) == list(range(200))
    assert consumer.seeks == [(0, 1), (100, 3)]


def test_a_range_planned_without_epochs_is_read_without_validation(consumer_of):
    consumer = consumer_of(FakeConsumer(OUT_OF_RANGE))
    assert _offsets(read_range({}, OffsetRange(TOPIC, 0, 0, 200), True)) == list(range(200))
    assert consumer.seeks == []


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_a_record_written_after_the_batch_was_planned_is_not_taken_for_the_planned_one(
    consumer_of, tmp_path, fail_on_data_loss
):
    """The batch was planned in leader epoch 3, when every offset below its end was written.
    librdkafka validates a read's position only on a seek or a leader change, so after an
    unclean election under the read it can deliver the new leader's records first: one
    written in epoch 4 at offset 100 replaced the record the batch planned there."""
    consumer_of(FakeConsumer(_Message(100, epoch=4)))
    checkpoint = CheckpointDir(tmp_path)
    r = OffsetRange(TOPIC, 0, 0, 200, 3, 3)
    if fail_on_data_loss:
        with pytest.raises(DataLossError, match="offset 100 holds a record written in leader "):
            list(read_range({}, r, True, checkpoint))
        return
    assert _offsets(read_range({}, r, False, checkpoint)) == list(range(100))
    assert checkpoint.source_stats() == {(TOPIC, 0): 100}


class TruncatedAtStart(FakeConsumer):
    """Reports `event` first, at the range's start; then, assigned anew, the log from there."""

    def consume(self, n, timeout):
        self.calls += 1
        if self.calls == 1:
            return [self.event]
        out = [_Message(o) for o in range(self.pos, self.log_end)]
        self.pos = max(self.pos, self.log_end)
        return out


def test_with_fail_on_data_loss_false_a_truncation_before_the_batch_reads_the_batch_on(
    consumer_of, tmp_path
):
    """The log was truncated to 60 after the last batch read up to 100, and grew back: this
    batch was planned on the new log in epoch 3. What is lost are the new leader's records
    below 100, which no batch reads (counted: 40); the batch's own are read, validated
    against the epoch it was planned in. (They were skipped as lost too.)"""
    consumer = consumer_of(TruncatedAtStart(TRUNCATED))
    checkpoint = CheckpointDir(tmp_path)
    r = OffsetRange(TOPIC, 0, 100, 200, 1, 3)
    assert _offsets(read_range({}, r, False, checkpoint)) == list(range(100, 200))
    assert consumer.seeks == [(100, 1), (100, 3)]
    assert checkpoint.source_stats() == {(TOPIC, 0): 40}
    consumer_of(TruncatedAtStart(TRUNCATED))
    with pytest.raises(DataLossError, match="truncated below offset 100 after the last batch"):
        list(read_range({}, r, True, checkpoint))


class NoEpochForSeeks(FakeConsumer):
    """A leader that holds the log but no epoch as new as the batch's: "No epoch found" for
    every position sought in an epoch, the log from a position assigned without one."""

    def assign(self, tps):
        super().assign(tps)
        self.sought = False

    def seek(self, tp):
        super().seek(tp)
        self.sought = True

    def consume(self, n, timeout):
        if self.sought:
            return [self.event]
        out = [_Message(o) for o in range(self.pos, self.log_end)]
        self.pos = max(self.pos, self.log_end)
        return out


def test_no_epoch_found_from_a_leader_that_holds_the_offsets_is_read_on_after_the_wait(
    consumer_of, monkeypatch, tmp_path
):
    """A broker that keeps no epochs (a message format before 0.11) answers "No epoch found"
    for ever, and so does a topic recreated while the batch ran (which the next batch's
    planning finds by its id). (The read asked again until it stalled after 120 s, failing
    as if the broker were unreachable.)"""
    monkeypatch.setattr(source, "BEHIND_LEADER_WAIT_S", 0.0)
    monkeypatch.setattr(source, "READ_STALL_TIMEOUT_S", 1.0)  # the stall it was taken for
    monkeypatch.setattr(source, "FETCH_STALL_S", 60.0)
    consumer = consumer_of(NoEpochForSeeks(NO_EPOCH))
    checkpoint = CheckpointDir(tmp_path)
    r = OffsetRange(TOPIC, 0, 100, 200, 3, 3)
    assert _offsets(read_range({}, r, True, checkpoint)) == list(range(100, 200))
    assert consumer.assigned == [100, 100] and checkpoint.source_stats() == {}


class Log(FakeConsumer):
    """Delivers the log from the offset assigned or sought, ten records a call."""

    def seek(self, tp):
        super().seek(tp)
        self.pos = tp.offset

    def consume(self, n, timeout):
        out = [_Message(o) for o in range(self.pos, min(self.pos + 10, self.log_end))]
        self.pos += len(out)
        return out


def test_a_seek_refused_until_the_partition_fetches_is_asked_again_at_its_first_record(
    consumer_of, monkeypatch
):
    """A slow assignment (a stop still ending, a busy librdkafka thread) refuses the seek
    that asks the leader: the read must not take records it has not asked about."""
    monkeypatch.setattr(source, "SEEK_WAIT_S", 0.0)
    consumer = consumer_of(Log(OUT_OF_RANGE))
    consumer.refusals = 1
    r = OffsetRange(TOPIC, 0, 0, 200, 1, 3)
    assert _offsets(read_range({}, r, True)) == list(range(200))  # each once
    assert consumer.seeks == [(0, 1)]


class TruncatedThenOutOfRange(TruncatedAtStart):
    """The truncation at the range's start, then an out-of-range answer there, then the log."""

    def consume(self, n, timeout):
        if self.calls == 1:
            self.calls += 1
            return [OUT_OF_RANGE]
        return super().consume(n, timeout)


def test_after_reading_a_batch_on_from_the_new_log_every_fetch_asks_about_its_epoch(
    consumer_of, tmp_path
):
    """Once the batch is read from the new log, asking about the last batch's epoch again
    (a new consumer, an out-of-range answer) would find the same truncation and skip the
    batch as if its records were gone."""
    consumer = consumer_of(TruncatedThenOutOfRange(TRUNCATED))
    checkpoint = CheckpointDir(tmp_path)
    r = OffsetRange(TOPIC, 0, 100, 200, 1, 3)
    assert _offsets(read_range({}, r, False, checkpoint)) == list(range(100, 200))
    assert consumer.seeks == [(100, 1), (100, 3), (100, 3)]


class _Reported:
    def __init__(self, text: str) -> None:
        self.text = text

    def str(self) -> str:
        return self.text


def test_a_cut_is_the_end_of_the_asked_epoch_only():
    """Kafka answers OffsetsForLeaderEpoch for the newest epoch the leader has at or below
    the asked one. A leader that never had the asked epoch answers where its own older epoch
    ends, past which its records may differ from those read: no cut is known there."""
    from onceflow.connectors.source import _end_of_epoch

    report = (
        "Partition log truncation detected at offset 10 (leader epoch 4): broker end offset "
        "is 8 (offset leader epoch {}). Reset to INVALID."
    )
    assert _end_of_epoch(_Reported(report.format(4)), 4) == 8
    assert _end_of_epoch(_Reported(report.format(3)), 4) is None
    assert _end_of_epoch(_Reported("Partition log truncation detected"), 4) is None
