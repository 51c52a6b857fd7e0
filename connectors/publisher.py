"""Phase 2 of the sink: publish one epoch's output and its commit marker in ONE transaction.

Runs on the driver (the coordinator), only after every task of the epoch succeeded. A stable
`transactional.id` per (app, sink) makes `init_transactions` fence any zombie and resolve any
transaction a crashed predecessor left open; the marker makes a replayed epoch a no-op.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Producer

from onceflow.connectors import faults
from onceflow.connectors.markers import Marker, ensure_marker_topic, last_marker

log = logging.getLogger("onceflow.sink")

TRANSACTION_TIMEOUT_S = 60.0
MAX_EPOCH_ATTEMPTS = 3


class FencedError(RuntimeError):
    """Another instance with the same transactional id took over; this one must stop."""


class CheckpointMismatchError(RuntimeError):
    """The sink's markers belong to a different checkpoint than the running query's."""


@dataclass
class PublisherStats:
    transactions_committed: int = 0
    transactions_aborted: int = 0
    replays_skipped: int = 0
    records_published: int = 0
    last_committed_batch: int = -1
    commit_seconds: list[float] = field(default_factory=list)


class TransactionalPublisher:
    """One transactional producer for one (app, sink), kept for the life of the process."""

    def __init__(
        self,
        conf: dict[str, str],
        transactional_id: str,
        marker_topic: str,
        dead_letter_topic: str | None = None,
    ) -> None:
        self.conf = conf
        self.transactional_id = transactional_id
        self.marker_topic = marker_topic
        self.dead_letter_topic = dead_letter_topic
        self.producer: Producer | None = None
        self.last: Marker | None = None
        self.stats = PublisherStats()

    def _start(self) -> Producer:
        """init_transactions first (fences zombies, ends their open transaction), then read
        the last marker: only then do we know what is already published."""
        if self.producer is None:
            ensure_marker_topic(self.conf, self.marker_topic)
            producer = Producer(
                {
                    "linger.ms": 5,
                    "batch.size": 1_000_000,
                    "queue.buffering.max.messages": 1_000_000,
                    "queue.buffering.max.kbytes": 1_048_576,
                    **self.conf,
                    "transactional.id": self.transactional_id,
                    "transaction.timeout.ms": int(TRANSACTION_TIMEOUT_S * 1000),
                }
            )
            try:
                producer.init_transactions(TRANSACTION_TIMEOUT_S)
            except KafkaException as exc:
                raise self._explain(exc) from exc
            self.last = last_marker(self.conf, self.marker_topic, self.transactional_id)
            self.stats.last_committed_batch = self.last.batch_id if self.last else -1
            self.producer = producer
            log.info(
                "transactional producer %s ready; last committed batch %s",
                self.transactional_id,
                self.stats.last_committed_batch,
            )
        return self.producer

    def publish(
        self,
        batch_id: int,
        query_id: str,
        records: Iterable[tuple],
        source_offsets: list,
    ) -> bool:
        """Publish epoch `batch_id` unless it is already published; True if published now.

        `records` are (topic, partition|None, key, value, headers) tuples, re-iterable.
        """
        self._start()
        if self.last is not None:
            if self.last.query_id != query_id:
                raise CheckpointMismatchError(
                    f"sink {self.transactional_id!r} last committed batch {self.last.batch_id} "
                    f"for the checkpoint with query id {self.last.query_id}, but this query's "
                    f"checkpoint has id {query_id}: the checkpoint was deleted or belongs to "
                    "another app. Refusing to run, or output would be dropped or doubled. "
                    "Restore the checkpoint, or start over on purpose with a new app id / sink "
                    f"name (or delete the marker key {self.transactional_id!r} in "
                    f"{self.marker_topic!r})."
                )
            if batch_id <= self.last.batch_id:
                self.stats.replays_skipped += 1
                log.info("batch %d is already published; replay skipped", batch_id)
                return False
        marker = Marker(self.transactional_id, batch_id, query_id, 0, source_offsets)
        for attempt in range(1, MAX_EPOCH_ATTEMPTS + 1):
            try:
                marker = self._publish_once(marker, records)
                break
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if _is_fenced(error) or error.fatal() or not error.txn_requires_abort():
                    self._close()
                    raise self._explain(exc) from exc
                log.warning("epoch %d: %s; aborting and publishing it again", batch_id, error)
                self._abort()
                if attempt == MAX_EPOCH_ATTEMPTS:
                    raise
            except Exception:
                self._abort()  # e.g. a record that cannot be produced: leave nothing open
                raise
        self.last = marker
        self.stats.last_committed_batch = batch_id
        return True

    def _publish_once(self, marker: Marker, records: Iterable[tuple]) -> Marker:
        producer = self.producer
        assert producer is not None
        t0 = time.monotonic()
        producer.begin_transaction()
        marker = self._produce_epoch(producer, marker, records)
        faults.point("before_kafka_commit", marker.batch_id)
        self._commit(producer)
        faults.point("after_kafka_commit", marker.batch_id)
        self.stats.transactions_committed += 1
        self.stats.records_published += marker.records
        self.stats.commit_seconds.append(time.monotonic() - t0)
        return marker

    def _produce_epoch(self, producer: Producer, marker: Marker, records: Iterable[tuple]):
        """Produce the epoch's records, then its marker; the marker counts the records."""
        count = 0
        for topic, partition, key, value, headers in records:
            try:
                _produce(producer, topic, partition, key, value, headers)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
                self._oversized(producer, topic, key, value, headers)
            count += 1
        marker = Marker(marker.sink, marker.batch_id, marker.query_id, count, marker.source_offsets)
        _produce(producer, self.marker_topic, None, marker.sink.encode(), marker.encode(), None)
        return marker

    def _oversized(self, producer: Producer, topic: str, key, value, headers) -> None:
        """A record too big to publish becomes a dead letter without its value, never a loop
        of failing epochs; its input stays readable at the offset in `onceflow.source`."""
        size = len(key or b"") + len(value or b"")
        limit = self.conf.get("message.max.bytes", "1000000")
        reason = (
            f"output record for topic {topic} of {size} bytes exceeds the producer limit of "
            f"{limit} bytes (message.max.bytes); value omitted from this dead letter"
        )
        if self.dead_letter_topic is None:
            raise ValueError(reason + "; configure a dead-letter topic to route such records")
        error_header = [("onceflow.error", reason.encode())]
        _produce(producer, self.dead_letter_topic, None, key, None, (headers or []) + error_header)

    @staticmethod
    def _commit(producer: Producer) -> None:
        """commit_transaction, retried while librdkafka says the same call may succeed."""
        deadline = time.monotonic() + TRANSACTION_TIMEOUT_S
        while True:
            try:
                producer.commit_transaction(TRANSACTION_TIMEOUT_S)
                return
            except KafkaException as exc:
                if not exc.args[0].retriable() or time.monotonic() > deadline:
                    raise
                log.warning("commit_transaction: %s; retrying", exc.args[0])
                time.sleep(0.5)

    def abort_open_transaction(self) -> None:
        """Called when Spark aborts an epoch: make sure nothing of it stays pending."""
        if self.producer is not None:
            self._abort()

    def _abort(self) -> None:
        assert self.producer is not None
        try:
            self.producer.abort_transaction(TRANSACTION_TIMEOUT_S)
            self.stats.transactions_aborted += 1
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._STATE:  # no transaction was open
                self._close()
                raise

    def _close(self) -> None:
        """Drop the producer; the next epoch (after Spark's restart) starts a fresh one."""
        self.producer = None
        self.last = None

    def _explain(self, exc: KafkaException) -> Exception:
        error: KafkaError = exc.args[0]
        if _is_fenced(error):
            return FencedError(
                f"this instance was fenced: another instance started with transactional id "
                f"{self.transactional_id!r} and took over the sink. Stop one of them; two "
                "instances of one app must not run at once."
            )
        return exc


class AtLeastOncePublisher(TransactionalPublisher):
    """`sink.guarantee: at_least_once`: the same epochs, markers and replay check, without the
    transaction. A crash between an epoch's records and its marker repeats those records on
    restart. For outputs that tolerate duplicates, and to measure what exactly-once costs."""

    def _start(self) -> Producer:
        if self.producer is None:
            ensure_marker_topic(self.conf, self.marker_topic)
            self.delivery_errors: list[str] = []
            self.producer = Producer(
                {
                    "linger.ms": 5,
                    "batch.size": 1_000_000,
                    "queue.buffering.max.messages": 1_000_000,
                    "queue.buffering.max.kbytes": 1_048_576,
                    **self.conf,
                    "enable.idempotence": True,
                    "on_delivery": self._delivered,
                }
            )
            self.last = last_marker(self.conf, self.marker_topic, self.transactional_id)
            self.stats.last_committed_batch = self.last.batch_id if self.last else -1
        return self.producer

    def _delivered(self, error, message) -> None:
        if error is not None:
            self.delivery_errors.append(f"{message.topic()}[{message.partition()}]: {error}")

    def _publish_once(self, marker: Marker, records: Iterable[tuple]) -> Marker:
        producer = self.producer
        assert producer is not None
        t0 = time.monotonic()
        marker = self._produce_epoch(producer, marker, records)
        if producer.flush(TRANSACTION_TIMEOUT_S) or self.delivery_errors:
            failed, self.delivery_errors = self.delivery_errors, []
            raise RuntimeError(
                f"epoch {marker.batch_id} was not fully delivered ({failed[:3]} ...); Spark "
                "will run it again (at-least-once)"
            )
        self.stats.records_published += marker.records
        self.stats.commit_seconds.append(time.monotonic() - t0)
        return marker

    def _abort(self) -> None:
        """Nothing to abort without a transaction: what was delivered stays."""


def _is_fenced(error: KafkaError) -> bool:
    return error.code() in (
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.TRANSACTION_COORDINATOR_FENCED,
    )


def _produce(producer: Producer, topic, partition, key, value, headers) -> None:
    while True:
        try:
            if partition is None:
                producer.produce(topic, value, key, headers=headers)
            else:
                producer.produce(topic, value, key, partition, headers=headers)
            return
        except BufferError:
            producer.poll(0.05)  # the local queue is full: let deliveries drain


_publishers: dict[tuple, TransactionalPublisher] = {}
_lock = threading.Lock()


def publisher_for(
    conf: dict[str, str],
    transactional_id: str,
    marker_topic: str,
    dead_letter_topic: str | None = None,
    exactly_once: bool = True,
) -> TransactionalPublisher:
    """The process-wide publisher of a sink: init_transactions is paid once, not per epoch."""
    key = (transactional_id, marker_topic, dead_letter_topic, exactly_once, *sorted(conf.items()))
    kind = TransactionalPublisher if exactly_once else AtLeastOncePublisher
    with _lock:
        if key not in _publishers:
            _publishers[key] = kind(conf, transactional_id, marker_topic, dead_letter_topic)
        return _publishers[key]
