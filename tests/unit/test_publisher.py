"""The publishers' decisions, with a fake producer and a fake marker store (pure logic).

What the real broker does with the same calls is covered by tests/integration/test_sink.py
and the fault suite; here each branch of the protocol is driven on purpose.
"""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from onceflow.connectors import kafka_clients
from onceflow.connectors import publisher as publishing
from onceflow.connectors.errors import CheckpointMismatchError, FencedError, OnceflowError
from onceflow.connectors.markers import Marker

MARKERS = "markers"
SINK = "onceflow-app-out"
OFFSETS = [{"in": {"0": 10, "1": 12}}]


class FakeClock:
    """The publisher's time: a blocked call moves it on, so waits of seconds take none."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeBroker:
    """What the fake producers log, and the marker a `read_committed` reader would see."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.marker: Marker | None = None
        self.producers: list[FakeProducer] = []
        self.undeliverable: set[str] = set()  # topics whose records are never acknowledged
        self.commit_errors: list[KafkaError] = []  # raised by commit_transaction, in turn
        self.commit_lands = False  # a failing commit_transaction still committed
        # Per producer (by index), its commit_transaction calls that time out, in turn: how
        # long each blocks and how many messages still wait for an answer after it.
        self.unanswered: dict[int, list[tuple[float, int]]] = {}
        self.clock = FakeClock()
        self.offsets: dict[str, int] = {}  # the last offset acknowledged, per topic
        self.marker_reads: list[dict | None] = []  # each read's floor
        self.end_probes: list[int] = []  # len(calls) when a start wrote its end probe


class FakeProducer:
    def __init__(self, broker: FakeBroker, config: dict) -> None:
        self.broker, self.config = broker, config
        self.pending: list[tuple] = []
        self.transaction: list[tuple] = []
        self.waiting = 0  # messages the producer holds (len(producer))
        broker.producers.append(self)

    def _log(self, *call) -> None:
        self.broker.calls.append((len(self.broker.producers) - 1, *call))

    def init_transactions(self, timeout) -> None:
        self._log("init_transactions")

    def begin_transaction(self) -> None:
        self._log("begin")
        self.transaction = []

    def produce(
        self, topic, value=None, key=None, partition=None, headers=None, on_delivery=None
    ) -> None:
        self._log("produce", topic, value)
        self.pending.append((topic, key, value))
        self.transaction.append((topic, key, value))
        if on_delivery is not None:  # acknowledged at once, at the next offset of partition 0
            self.broker.offsets[topic] = self.broker.offsets.get(topic, -1) + 1
            on_delivery(None, _Message(topic, self.broker.offsets[topic]))

    def poll(self, timeout=0) -> int:
        return 0

    def flush(self, timeout=None) -> int:
        self._log("flush")
        deliver = self.config.get("on_delivery")
        for topic, _key, value in self.pending:
            error = (
                KafkaError(KafkaError._MSG_TIMED_OUT)
                if topic in self.broker.undeliverable
                else None
            )
            if error is None and topic == MARKERS:
                self.broker.marker = Marker.decode(value)
            if deliver:
                deliver(error, _Message(topic))
        self.pending = []
        return 0

    def __len__(self) -> int:
        return self.waiting

    def commit_transaction(self, timeout=None) -> None:
        self._log("commit")
        unanswered = self.broker.unanswered.get(self.broker.producers.index(self), [])
        if unanswered:
            if self.broker.commit_lands:  # the EndTxn reached the coordinator; its answer not
                self._land()
            blocked_s, self.waiting = unanswered.pop(0)
            self.broker.clock.sleep(blocked_s)
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "timed out", retriable=True))
        if self.broker.commit_errors:
            error = self.broker.commit_errors.pop(0)
            if self.broker.commit_lands:
                self._land()
            raise KafkaException(error)
        self._land()

    def _land(self) -> None:
        for topic, _key, value in self.transaction:
            if topic == MARKERS:
                self.broker.marker = Marker.decode(value)
        self.pending = []

    def abort_transaction(self, timeout=None) -> None:
        self._log("abort")
        self.pending = []

    def purge(self) -> None:
        self.pending = []


class _Message:
    def __init__(self, topic: str, offset: int = 0) -> None:
        self._topic, self._offset = topic, offset

    def offset(self) -> int:
        return self._offset

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0


@pytest.fixture
def broker(monkeypatch) -> FakeBroker:
    broker = FakeBroker()
    monkeypatch.setattr(publishing, "Producer", lambda config: FakeProducer(broker, config))
    monkeypatch.setattr(publishing, "time", broker.clock)
    monkeypatch.setattr(publishing, "ensure_marker_topic", lambda conf, topic: None)

    def last_marker(*_args, floor=None):
        broker.marker_reads.append(floor)
        return broker.marker

    def acknowledged_ends(_conf, topic):
        broker.end_probes.append(len(broker.calls))
        broker.offsets[topic] = broker.offsets.get(topic, -1) + 1
        return {(topic, 0): broker.offsets[topic]}

    monkeypatch.setattr(publishing, "last_marker", last_marker)
    monkeypatch.setattr(publishing, "acknowledged_ends", acknowledged_ends)
    return broker


def records(n: int, topic: str = "out") -> list[tuple]:
    return [(topic, None, None, f"r{i}".encode(), None) for i in range(n)]


def exactly_once(timeout_s: float = 60.0) -> publishing.TransactionalPublisher:
    conf = {"bootstrap.servers": "fake:9092"}
    return publishing.TransactionalPublisher(conf, SINK, MARKERS, transaction_timeout_s=timeout_s)


def at_least_once() -> publishing.AtLeastOncePublisher:
    return publishing.AtLeastOncePublisher({"bootstrap.servers": "fake:9092"}, SINK, MARKERS)


def produced(broker: FakeBroker, topic: str) -> list:
    return [c[3] for c in broker.calls if c[1] == "produce" and c[2] == topic]


# -- at-least-once: the marker only after every record is acknowledged ----------------------


def test_at_least_once_produces_the_marker_only_after_the_records_are_acknowledged(broker):
    assert at_least_once().publish(0, "q", records(3), OFFSETS)
    steps = [(c[1], c[2] if len(c) > 2 else None) for c in broker.calls]
    assert steps == [
        ("produce", "out"),
        ("produce", "out"),
        ("produce", "out"),
        ("flush", None),
        ("produce", MARKERS),
        ("flush", None),
    ]


def test_at_least_once_writes_no_marker_when_a_record_is_not_acknowledged(broker):
    broker.undeliverable = {"out"}
    with pytest.raises(OnceflowError, match="not all acknowledged"):
        at_least_once().publish(0, "q", records(3), OFFSETS)
    assert produced(broker, MARKERS) == []
    assert broker.marker is None  # so a restart publishes the epoch again: never lost


# -- the replay check -----------------------------------------------------------------------


def test_a_replay_with_the_markers_offsets_is_skipped(broker):
    assert exactly_once().publish(3, "q", records(2), OFFSETS)
    restarted = exactly_once()
    assert not restarted.publish(3, "q", records(2), OFFSETS)
    assert restarted.stats.replays_skipped == 1
    assert len(produced(broker, "out")) == 2


def test_the_read_again_for_a_checkpoint_ahead_of_the_marker_reaches_the_logs_end(broker):
    """Step 2's second read (the checkpoint records a later batch than the marker) has a
    floor too: from a replaced leader, another instance's newer marker would look missing,
    and the run would stop with advice to delete the checkpoint instead of as fenced."""
    assert exactly_once().publish(2, "q", records(1), OFFSETS)
    ahead = publishing.Epoch(3, "q", OFFSETS, records(1), checkpoint_published=3)
    with pytest.raises(CheckpointMismatchError):
        exactly_once().publish_epoch(ahead)
    assert broker.marker_reads[-1] == {(MARKERS, 0): 3}  # past a record written just now


def test_a_replay_planned_with_other_offsets_is_refused_naming_both(broker):
    """A checkpoint restored from an older copy re-plans batch 3 with other offsets."""
    assert exactly_once().publish(3, "q", records(2), OFFSETS)
    replanned = [{"in": {"0": 10, "1": 20}}]
    with pytest.raises(CheckpointMismatchError) as info:
        exactly_once().publish(3, "q", records(2), replanned)
    message = str(info.value)
    assert "batch 3, planned with source offsets [{'in': {'0': 10, '1': 20}}]" in message
    assert "plan of batch 3 that sink 'onceflow-app-out' published" in message
    assert "(offsets [{'in': {'0': 10, '1': 12}}])" in message
    assert "restored from an older copy" in message and "Restore the newest copy" in message


def test_a_batch_below_the_marker_is_refused_even_with_offsets_inside_it(broker):
    """Spark replays only its last uncommitted batch (the marker's or a later one): a lower
    batch id comes from a checkpoint restored from an older copy, whose re-planned batches
    close windows at other watermarks, so skipping them could lose results."""
    assert exactly_once().publish(5, "q", records(2), OFFSETS)
    with pytest.raises(CheckpointMismatchError, match="batch 4, planned .* is below batch 5"):
        exactly_once().publish(4, "q", records(2), [{"in": {"0": 9, "1": 12}}])


def test_the_markers_batch_planned_anew_is_refused_though_its_offsets_agree(broker):
    publisher = exactly_once()
    epoch = publishing.Epoch(3, "q", OFFSETS, records(1), plan="plan-a")
    assert publisher.publish_epoch(epoch)
    replanned = publishing.Epoch(3, "q", OFFSETS, records(1), plan="plan-b")
    with pytest.raises(CheckpointMismatchError, match="differs from the plan of batch 3"):
        exactly_once().publish_epoch(replanned)
    assert not exactly_once().publish_epoch(epoch)


def test_an_empty_epoch_below_the_marker_is_refused_too(broker):
    assert exactly_once().publish(5, "q", records(2), OFFSETS)
    with pytest.raises(CheckpointMismatchError, match="is below batch 5"):
        exactly_once().check_replay(publishing.Epoch(4, "q", OFFSETS, []))
    exactly_once().check_replay(publishing.Epoch(6, "q", OFFSETS, []))


def test_another_checkpoints_marker_is_refused(broker):
    assert exactly_once().publish(0, "q1", records(1), OFFSETS)
    with pytest.raises(CheckpointMismatchError, match="was deleted or belongs to another app"):
        exactly_once().publish(0, "q2", records(1), OFFSETS)


# -- exactly-once: one branch per error kind ------------------------------------------------


def test_an_epoch_is_one_transaction_with_the_marker_last(broker):
    assert exactly_once().publish(0, "q", records(2), OFFSETS)
    steps = [(c[1], c[2] if len(c) > 2 else None) for c in broker.calls]
    assert steps == [
        ("init_transactions", None),
        ("begin", None),
        ("produce", "out"),
        ("produce", "out"),
        ("produce", MARKERS),
        ("commit", None),
    ]
    assert broker.marker == Marker(SINK, 0, "q", 2, OFFSETS)


def test_a_start_reads_its_last_marker_past_a_record_written_after_it_fenced_its_predecessor(
    broker,
):
    """A process that starts has no marker of its own acknowledged: its read's floor is a
    record the marker topic acknowledged after init_transactions (a replaced leader that
    still answers reads cannot acknowledge one), so the end it reads to is the log's."""
    publisher = exactly_once()
    assert publisher.publish(0, "q", records(1), OFFSETS)
    init = broker.calls.index((0, "init_transactions"))
    assert broker.end_probes == [init + 1]  # once, right after init_transactions
    assert broker.marker_reads == [{(MARKERS, 0): 0}]


def test_a_commit_of_unknown_outcome_that_landed_is_settled_by_the_marker(broker):
    broker.commit_errors = [KafkaError(KafkaError._TIMED_OUT, "timed out", retriable=True)]
    broker.commit_lands = True
    publisher = exactly_once(timeout_s=0.0)  # the timeout is over: not waited for again
    assert publisher.publish(0, "q", records(2), OFFSETS)
    # A new producer (init_transactions) read the marker; nothing was produced twice.
    assert [c for c in broker.calls if c[1] == "init_transactions"] == [
        (0, "init_transactions"),
        (1, "init_transactions"),
    ]
    assert len(produced(broker, "out")) == 2
    assert publisher.stats.transactions_committed == 1
    # The first read reaches past the start's end probe (offset 0), the read after the
    # commit past where the marker was acknowledged (offset 1).
    assert broker.marker_reads == [{(MARKERS, 0): 0}, {(MARKERS, 0): 1}]


def test_a_commit_of_unknown_outcome_that_did_not_land_is_produced_again(broker):
    broker.commit_errors = [KafkaError(KafkaError._TIMED_OUT, "timed out", retriable=True)]
    assert exactly_once(timeout_s=0.0).publish(0, "q", records(2), OFFSETS)
    assert len(broker.producers) == 2  # never retried on the producer whose commit failed
    assert [c[0] for c in broker.calls if c[1] == "commit"] == [0, 1]
    assert broker.marker == Marker(SINK, 0, "q", 2, OFFSETS)


def test_an_abortable_commit_error_is_settled_by_the_marker_too(broker):
    """librdkafka's abortable error after the commit request reached the broker must not
    lead to a second publish: a new producer and the marker decide."""
    broker.commit_errors = [KafkaError(KafkaError._STATE, "refused", txn_requires_abort=True)]
    assert exactly_once().publish(0, "q", records(1), OFFSETS)
    steps = [(c[0], c[1]) for c in broker.calls if c[1] != "produce"]
    assert steps == [
        (0, "init_transactions"),
        (0, "begin"),
        (0, "commit"),
        (1, "init_transactions"),
        (1, "begin"),
        (1, "commit"),
    ]
    assert len(produced(broker, "out")) == 2  # the first attempt did not land: again, once


def test_a_fenced_commit_is_the_fenced_error(broker):
    broker.commit_errors = [KafkaError(KafkaError._FENCED, "fenced", fatal=True)]
    with pytest.raises(FencedError, match="another instance started"):
        exactly_once().publish(0, "q", records(1), OFFSETS)


def test_fencing_raised_by_the_next_poll_is_the_fenced_error(broker):
    """A fenced producer answers commit with _STATE; librdkafka raises the fatal cause
    (_FENCED) from the producer's next poll."""
    publisher = exactly_once()
    broker.commit_errors = [KafkaError(KafkaError._STATE, "Operation not valid in state")]

    causes = [KafkaError(KafkaError._FENCED, "fenced", fatal=True)]

    def fenced_on_poll(timeout=0) -> int:  # librdkafka raises the fatal error once
        if causes:
            raise KafkaException(causes.pop())
        return 0

    publisher._start().poll = fenced_on_poll
    with pytest.raises(FencedError):
        publisher.publish(0, "q", records(1), OFFSETS)
    assert publisher.producer is None  # dropped: the next epoch starts with a new producer


def test_a_produce_refused_in_an_abortable_state_aborts_and_produces_again(broker):
    publisher = exactly_once()
    producer = publisher._start()
    real_produce = producer.produce
    refusals = [KafkaError(KafkaError._STATE, "Operation not valid in state")]

    def produce(*args, **kwargs):
        if refusals:
            raise KafkaException(refusals.pop())
        return real_produce(*args, **kwargs)

    producer.produce = produce
    assert publisher.publish(0, "q", records(1), OFFSETS)
    steps = [c[1] for c in broker.calls]
    assert steps == ["init_transactions", "begin", "abort", "begin", "produce", "produce", "commit"]


def test_a_transaction_that_outlived_its_timeout_says_so(broker, monkeypatch):
    clock = iter([100.0, 200.0, 200.0, 200.0])
    monkeypatch.setattr(publishing.time, "monotonic", lambda: next(clock))
    broker.commit_errors = [KafkaError(KafkaError._FENCED, "fenced", fatal=True)]
    with pytest.raises(OnceflowError) as info:
        exactly_once().publish(0, "q", records(1), OFFSETS)
    assert type(info.value).__name__ == "TransactionTimedOutError"
    assert "open for 100 s, past its timeout of 60 s" in str(info.value)


# -- a commit that Kafka leaves unanswered -------------------------------------------------


STALL = exactly_once().commit_stall_s()  # the producer's request.timeout.ms (4 s) + 1 s
SLICE = publishing.COMMIT_SLICE_S


def test_a_commit_kafka_leaves_unanswered_goes_to_a_new_producer_once_per_epoch(broker):
    """Its coordinator hangs: the first producer's commit is never answered. A new producer
    (which looks the coordinator up again) produces the epoch again and commits it; its own
    commit, the epoch's second, waits for the answer however long it takes."""
    broker.unanswered = {0: [(SLICE, 3)] * 100, 1: [(SLICE, 3)] * 20}  # 50 s, then 10 s
    publisher = exactly_once()
    assert publisher.publish(0, "q", records(2), OFFSETS)
    assert broker.clock.now - 1000 == STALL + 20 * SLICE
    assert [c[0] for c in broker.calls if c[1] == "init_transactions"] == [0, 1]
    commits = [c[0] for c in broker.calls if c[1] == "commit"]
    assert commits == [0] * int(STALL / SLICE) + [1] * 21  # left once, then waited for
    assert broker.marker == Marker(SINK, 0, "q", 2, OFFSETS)
    assert publisher.stats.transactions_committed == 1


def test_a_commit_left_unanswered_that_landed_is_not_published_again(broker):
    """The EndTxn reached the coordinator, which committed; its answer never came back. The
    new producer's marker read (which must reach past the marker's acknowledged offset)
    finds the epoch out: nothing is produced twice."""
    broker.unanswered = {0: [(SLICE, 0)] * 100}
    broker.commit_lands = True
    publisher = exactly_once()
    assert publisher.publish(0, "q", records(2), OFFSETS)
    assert len(broker.producers) == 2
    assert len(produced(broker, "out")) == 2
    assert broker.marker_reads == [{(MARKERS, 0): 0}, {(MARKERS, 0): 1}]
    assert publisher.stats.transactions_committed == 1


def test_a_commit_kafka_answers_bit_by_bit_is_waited_for(broker):
    """A slow link: each slice some records are acknowledged, for longer than a stall."""
    broker.unanswered = {0: [(SLICE, 100 - n) for n in range(int(4 * STALL / SLICE))]}
    assert exactly_once().publish(0, "q", records(2), OFFSETS)
    assert len(broker.producers) == 1


def test_a_pause_of_the_process_is_not_kafka_leaving_the_commit_unanswered(broker):
    """SIGSTOP in a commit (a slice that returns late): on resume the commit is waited for
    again, and answered, by the same producer."""
    before, after = int(STALL / SLICE) - 2, int(STALL / SLICE) - 2
    broker.unanswered = {0: [(SLICE, 3)] * before + [(75.0, 3)] + [(SLICE, 3)] * after}
    assert exactly_once().publish(0, "q", records(2), OFFSETS)
    assert len(broker.producers) == 1


def test_a_commit_paused_then_unanswered_stops_the_run_rather_than_fence_a_successor(broker):
    """Another instance may have taken the app over during the pause: a new producer's
    init_transactions would fence it. Its restart settles the transaction instead."""
    broker.unanswered = {0: [(SLICE, 3)] + [(75.0, 3)] + [(SLICE, 3)] * 100}
    with pytest.raises(
        OnceflowError, match="paused in epoch 0's Kafka commit, and since it resumed Kafka has not"
    ):
        exactly_once().publish(0, "q", records(2), OFFSETS)
    assert len(broker.producers) == 1  # no new producer, no init_transactions


def test_a_commit_paused_then_failed_stops_the_run_rather_than_fence_a_successor(broker):
    broker.unanswered = {0: [(SLICE, 3), (75.0, 3)]}
    broker.commit_errors = [KafkaError(KafkaError._STATE, "refused", txn_requires_abort=True)]
    with pytest.raises(OnceflowError, match="paused in epoch 0's Kafka commit, and since it"):
        exactly_once().publish(0, "q", records(2), OFFSETS)
    assert len(broker.producers) == 1


def test_a_short_gap_in_the_commit_only_restarts_the_count(broker):
    """A slice 2.5 s late (a busy machine, a short freeze) cannot let another instance in:
    the count of Kafka's silence starts again, and the commit goes on as before."""
    under = int(STALL / SLICE) - 2  # slices of silence, short of a stall
    broker.unanswered = {0: [(SLICE, 3)] * under + [(3.0, 3)] + [(SLICE, 3)] * under}
    assert exactly_once().publish(0, "q", records(2), OFFSETS)
    assert len(broker.producers) == 1


def test_the_stall_time_follows_the_producers_request_timeout():
    """A broker holds a produce for its replicas up to request.timeout.ms: a live cluster
    that is slow is waited for."""
    conf = {"bootstrap.servers": "fake:9092", "request.timeout.ms": "30000"}
    assert publishing.TransactionalPublisher(conf, SINK, MARKERS).commit_stall_s() == 31.0


# -- the producer's timeouts --------------------------------------------------------------


def test_a_broker_holding_a_produce_for_its_replicas_answers_before_the_producer_gives_up():
    """A broker waits up to request.timeout.ms for the in-sync replicas (Kafka's default
    30 s); a client that gave up first (socket.timeout.ms) would drop a live connection."""
    for publisher in (exactly_once(), at_least_once()):
        conf = kafka_clients.client_conf(publisher.producer_config())
        assert conf["request.timeout.ms"] < conf["socket.timeout.ms"]
    own = publishing.TransactionalPublisher(
        {"bootstrap.servers": "fake:9092", "request.timeout.ms": "9000"}, SINK, MARKERS
    )
    assert own.producer_config()["request.timeout.ms"] == "9000"  # the user's own wins
