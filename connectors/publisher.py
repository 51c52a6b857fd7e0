"""Phase 2 of the sink: publish one epoch's output and its commit marker, exactly once.

Runs on the driver (the coordinator), only after every task of the epoch succeeded. The
marker (`markers.py`) records the last epoch a sink published; it is what makes a replayed
epoch a no-op and what settles a commit whose outcome is unknown. Two publishers share
everything but the produce-and-commit step:

- `TransactionalPublisher` (exactly-once): results, side records and the marker in ONE Kafka
  transaction with a stable `transactional.id` per (app, sink), so the marker is visible to a
  `read_committed` reader if and only if the output is.
- `AtLeastOncePublisher`: the same epochs and marker without a transaction; the marker is
  produced only once every record of the epoch is acknowledged, so a crash may repeat an
  epoch's records but never loses them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Producer

from . import faults, kafka_clients
from .errors import (
    CheckpointMismatchError,
    FencedError,
    OnceflowError,
    TransactionTimedOutError,
)
from .markers import Marker, acknowledged_ends, ensure_marker_topic, last_marker, legacy_marker
from .offsets import TP
from .records import HEADER_ERROR, HEADER_SOURCE
from .stalls import reported_if_stalled

log = logging.getLogger("onceflow.sink")

DEFAULT_TRANSACTION_TIMEOUT_S = 60.0
MAX_EPOCH_ATTEMPTS = 3
# A commit that Kafka acknowledges nothing more of for this long (no further record of the
# epoch acknowledged, no answer to EndTxn) leaves its producer for a new one, once per epoch.
# librdkafka sends a transaction's requests to the coordinator it found until a request
# there times out (socket.timeout.ms) and a reconnect's first answer times out too: a
# coordinator that hangs held commits for ~10 s after Kafka had moved it. A new producer
# looks the coordinator up afresh, and its init_transactions settles the transaction left
# open (see Step 5). One second more than a broker may hold a produce for its in-sync
# replicas before it answers (the producer's request.timeout.ms).
COMMIT_STALL_AFTER_REQUEST_S = 1.0
# The commit is waited for in slices (librdkafka resumes it on each call), to watch it.
COMMIT_SLICE_S = 0.5
# A slice that returns this much later than it should: this process did not run (SIGSTOP, a
# frozen VM) for long enough that another instance may have taken the app over (its lease,
# service.lease.LEASE_S = 30 s, is renewed every 10 s). Shorter gaps only restart the count.
PAUSED_S = 10.0
LATE_SLICE_S = 1.0
Record = tuple  # (topic, partition | None, key, value, headers | None)
DEFAULT_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's default producer limit
# The headers a dead letter keeps whatever else it drops: where its input is, and why.
ONCEFLOW_HEADERS = (HEADER_SOURCE, HEADER_ERROR)


@dataclass(frozen=True)
class Epoch:
    """One micro-batch as the sink publishes it."""

    batch_id: int
    query_id: str  # names the checkpoint (Spark's query id)
    source_offsets: list  # the end offsets Spark wrote ahead for this batch, per source
    records: Iterable[Record]  # re-iterable: an aborted attempt produces them again
    plan: str = ""  # the fingerprint of the batch's plan (its start and end offset logs)
    # The last batch the checkpoint records this sink published (-1: none): the marker read
    # from Kafka must not be older (see `_marker_at_least`).
    checkpoint_published: int = -1


@dataclass
class PublisherStats:
    transactions_committed: int = 0
    transactions_aborted: int = 0
    replays_skipped: int = 0
    records_published: int = 0
    last_committed_batch: int = -1
    commit_seconds: list[float] = field(default_factory=list)


class EpochPublisher:
    """What both guarantees share: the producer's settings, the marker and the replay check,
    and the loop that produces an epoch's records."""

    def __init__(
        self,
        conf: dict[str, str],
        transactional_id: str,
        marker_topic: str,
        dead_letter_topic: str | None = None,
        transaction_timeout_s: float = DEFAULT_TRANSACTION_TIMEOUT_S,
        legacy_marker_topic: str | None = None,
    ) -> None:
        self.conf = conf
        self.transactional_id = transactional_id  # also the marker's key: the sink's name
        self.marker_topic = marker_topic
        self.legacy_marker_topic = legacy_marker_topic  # read while marker_topic has none
        self.dead_letter_topic = dead_letter_topic
        self.timeout_s = transaction_timeout_s
        self.producer: Producer | None = None
        self.last: Marker | None = None
        self.marker_topic_ensured = False
        self.marker_at: dict[TP, int] | None = None  # where the open epoch's marker went
        self.stats = PublisherStats()

    def publish(
        self, batch_id: int, query_id: str, records: Iterable[Record], source_offsets: list
    ):
        """Publish epoch `batch_id` unless it is already published; True if published now."""
        return self.publish_epoch(Epoch(batch_id, query_id, source_offsets, records))

    def publish_epoch(self, epoch: Epoch) -> bool:
        raise NotImplementedError

    # -- the producer and the marker ---------------------------------------------------------

    def producer_config(self) -> dict:
        return {
            "linger.ms": 5,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 1_000_000,
            "queue.buffering.max.kbytes": 1_048_576,
            "request.timeout.ms": kafka_clients.PRODUCE_WAIT_MS,
            **self.conf,
            "enable.idempotence": True,
        }

    def _start(self, floor: dict[TP, int] | None = None) -> Producer:
        """Step 1: a producer (the transactional one fences its predecessor), then the last
        marker, read up to the log's end: past `floor`, the offsets where this process' last
        marker was acknowledged, or else past a record written now (see last_marker)."""
        if self.producer is None:
            if not self.marker_topic_ensured:  # (not again: its controller may hang now)
                ensure_marker_topic(self.conf, self.marker_topic)
                self.marker_topic_ensured = True
            producer = Producer(kafka_clients.client_conf(self.producer_config()))
            with reported_if_stalled(f"sink {self.transactional_id!r}: starting its producer"):
                self._init(producer)
            with reported_if_stalled(f"sink {self.transactional_id!r}: reading its last marker"):
                if floor is None:
                    floor = acknowledged_ends(self.conf, self.marker_topic)
                self.last = last_marker(
                    self.conf,
                    self.marker_topic,
                    self.transactional_id,
                    2 * self.timeout_s,
                    self.legacy_marker_topic,
                    floor=floor,
                )
            self.stats.last_committed_batch = _batch(self.last)
            self.producer = producer
            log.info(
                "%s producer %s ready; last published batch %s",
                type(self).__name__,
                self.transactional_id,
                self.stats.last_committed_batch,
            )
        return self.producer

    def _init(self, producer: Producer) -> None:
        """Hook for the transactional publisher's init_transactions."""

    def _drop_producer(self) -> None:
        """Forget the producer and the marker: the next attempt starts from Step 1."""
        if self.producer is not None:
            with contextlib.suppress(Exception):
                self.producer.purge()
        self.producer = None
        self.last = None

    def already_published(self, epoch: Epoch) -> bool:
        """Steps 2 and 3 of publishing: is `epoch` of this checkpoint, and already out?

        Spark replays only its last uncommitted batch, which is the marker's batch or a later
        one. So a batch is skipped only when it IS the marker's batch: same checkpoint (query
        id), same source offsets and plan. A batch below the marker, or the marker's batch
        planned anew, means the checkpoint was restored from an older copy: skipping would
        lose what its batches now hold (windows close at other watermarks), publishing would
        double what was published. Empty epochs are checked too (see `check_replay`).
        """
        last = self._marker_at_least(epoch)
        if last is None:
            return False
        if last.query_id != epoch.query_id:
            raise CheckpointMismatchError(
                f"sink {self.transactional_id!r} last committed batch {last.batch_id} for the "
                f"checkpoint with query id {last.query_id}, but this query's checkpoint has id "
                f"{epoch.query_id}: the checkpoint was deleted or belongs to another app. "
                "Refusing to run, or output would be dropped or doubled. Restore the "
                "checkpoint, or start over on purpose with a new app id / sink name (or "
                f"delete the marker key {self.transactional_id!r} in {self.marker_topic!r})."
            )
        if epoch.batch_id > last.batch_id:
            return False
        if epoch.batch_id < last.batch_id:
            self._restored_checkpoint(
                epoch,
                f"is below batch {last.batch_id}, the last one sink "
                f"{self.transactional_id!r} published from this checkpoint (offsets "
                f"{last.source_offsets})",
            )
        same_plan = not last.plan or not epoch.plan or last.plan == epoch.plan
        if epoch.source_offsets != last.source_offsets or not same_plan:
            self._restored_checkpoint(
                epoch,
                f"differs from the plan of batch {last.batch_id} that sink "
                f"{self.transactional_id!r} published (offsets {last.source_offsets})",
            )
        self.stats.replays_skipped += 1
        log.info("batch %d is already published; replay skipped", epoch.batch_id)
        return True

    def _marker_at_least(self, epoch: Epoch) -> Marker | None:
        """Step 2a. The marker to judge `epoch` by, never older than the last batch its
        checkpoint records this sink published.

        This process' marker can be older for three reasons, told apart by reading again:
        another instance published from this checkpoint since (this one was taken over); a
        rolled-back version published later epochs to the shared topic (read there); or
        markers went missing from Kafka (the marker topic deleted, emptied or recreated, or
        `sink.marker_topic` changed under a kept checkpoint). Judged by an older marker, the
        replay of a published batch would be published again, so the run stops instead.
        """
        last, recorded = self.last, epoch.checkpoint_published
        if recorded <= _batch(last) or (last is not None and last.query_id != epoch.query_id):
            return last  # (another checkpoint's marker is refused by Step 2, naming both)
        wait_s = 2 * self.timeout_s
        with reported_if_stalled(f"sink {self.transactional_id!r}: reading its marker again"):
            floor = acknowledged_ends(self.conf, self.marker_topic)  # (see Step 1)
            newest = last_marker(
                self.conf, self.marker_topic, self.transactional_id, wait_s, floor=floor
            )
        if _batch(newest) >= recorded:
            raise self._fenced()
        if self.legacy_marker_topic:
            legacy = legacy_marker(
                self.conf, self.legacy_marker_topic, self.transactional_id, wait_s
            )
            if _batch(legacy) >= recorded:
                self.last = legacy
                self.stats.last_committed_batch = legacy.batch_id
                return legacy
        raise CheckpointMismatchError(
            f"the checkpoint records that sink {self.transactional_id!r} published batch "
            f"{recorded}, but its marker topic {self.marker_topic!r} holds "
            f"{f'batch {last.batch_id}' if last is not None else 'no marker'}: markers went "
            "missing (the marker topic was deleted or recreated, or sink.marker_topic changed "
            "since). Refusing to run, or the replayed batch would be published twice. Restore "
            "the marker topic or the previous setting; or, to start this sink over on purpose, "
            "delete the checkpoint as well."
        )

    def _fenced(self) -> FencedError:
        return FencedError(
            f"this instance was fenced: another instance started with transactional id "
            f"{self.transactional_id!r} and took over the sink. Stop one of them; two "
            "instances of one app must not run at once."
        )

    def check_replay(self, epoch: Epoch) -> None:
        """Steps 1-3 for an epoch with nothing to publish: a restored older checkpoint is
        refused even when its re-planned batch happens to be empty."""
        self._start()
        self.already_published(epoch)

    def _restored_checkpoint(self, epoch: Epoch, what: str) -> None:
        raise CheckpointMismatchError(
            f"batch {epoch.batch_id}, planned with source offsets {epoch.source_offsets}, {what}: "
            "the checkpoint was restored from an older copy (or lost its newest files) and "
            "re-plans batches that were published, so skipping them could lose records and "
            "publishing them would double records. Restore the newest copy of the checkpoint; "
            "or, to continue from what is published, start a new checkpoint whose source starts "
            f"at the marker's offsets and delete the marker key {self.transactional_id!r} in "
            f"{self.marker_topic!r}."
        )

    # -- producing ---------------------------------------------------------------------------

    def _produce_records(self, producer: Producer, records: Iterable[Record]) -> int:
        """Produce every record of the epoch; returns how many (an oversized record's dead
        letter counts, one left out for want of a dead-letter topic does not)."""
        count = 0
        for topic, partition, key, value, headers in records:
            try:
                _produce(producer, topic, partition, key, value, headers)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
                record = _Oversized(topic, key, value, headers or [], self._max_message_bytes())
                if not self._oversized(producer, records, record):
                    continue
            count += 1
        return count

    def _produce_marker(self, producer: Producer, marker: Marker, on_delivery=None) -> None:
        key, value = marker.sink.encode(), marker.encode()
        _produce(producer, self.marker_topic, None, key, value, None, on_delivery)

    def _max_message_bytes(self) -> int:
        """The producer's size limit (librdkafka's default unless configured)."""
        return int(self.conf.get("message.max.bytes", DEFAULT_MESSAGE_MAX_BYTES))

    def _oversized(self, producer: Producer, records: Iterable[Record], record: _Oversized) -> bool:
        """A record over the producer's limit: True once it is a dead letter, False if it is
        left out (no dead-letter topic). Never an error: the replayed epoch would hold the same
        record, so every restart would fail on it again.

        The dead letter drops what does not fit, the value first, then the original key and
        headers, but keeps onceflow's own headers: `onceflow.source` finds the record in its
        input, `onceflow.error` says why, and what was dropped."""
        if self.dead_letter_topic is None:
            _left_out(records, record)
            return False
        for key, headers, dropped in record.dead_letters():
            error = (HEADER_ERROR, record.reason(dropped).encode())
            try:
                _produce(producer, self.dead_letter_topic, None, key, None, [*headers, error])
                _recount(records, "dead_letter")
                return True
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
        raise OnceflowError(  # (librdkafka's limit is 1000 bytes at least: cannot happen)
            f"{record.reason([])}; not even its dead letter with only {HEADER_SOURCE} and "
            f"{HEADER_ERROR} fits: raise message.max.bytes"
        )

    def abort_open_transaction(self) -> None:
        """Called when Spark aborts an epoch: make sure nothing of it stays pending."""

    def _is_fenced(self, error: KafkaError) -> bool:
        """True if `error`, or the fatal error behind it, says another producer took over.

        A fenced producer answers produce() with _FATAL and other calls with _STATE; the
        cause (_FENCED) is raised by the producer's next poll.
        """
        fenced = (
            KafkaError._FENCED,
            KafkaError.PRODUCER_FENCED,
            KafkaError.INVALID_PRODUCER_EPOCH,
            KafkaError.TRANSACTION_COORDINATOR_FENCED,
        )
        cause = error
        if self.producer is not None and error.code() in (KafkaError._FATAL, KafkaError._STATE):
            try:
                self.producer.poll(0)
            except KafkaException as exc:
                cause = exc.args[0]
        return error.code() in fenced or cause.code() in fenced


class TransactionalPublisher(EpochPublisher):
    """Exactly-once: one transactional producer per (app, sink), kept for the process' life,
    so init_transactions is paid once, not per epoch."""

    def producer_config(self) -> dict:
        return {
            **super().producer_config(),
            "transactional.id": self.transactional_id,
            "transaction.timeout.ms": int(self.timeout_s * 1000),
        }

    def _init(self, producer: Producer) -> None:
        try:
            producer.init_transactions(self.timeout_s)
        except KafkaException as exc:
            if self._is_fenced(exc.args[0]):
                raise self._fenced() from exc
            raise

    def publish_epoch(self, epoch: Epoch) -> bool:
        """Publish `epoch` exactly once; True if published now, False if it already was.

        Step 1. Start: a producer that called init_transactions (which fences any zombie with
                our transactional id and settles the transaction it left open), then the
                last committed marker, read after that up to the log's true end (past a
                record the marker topic acknowledged, which a replaced leader cannot do).
                Only now is it known what is out.
        Step 2. The marker must describe this checkpoint (its query id), and be no older
                than the last batch the checkpoint records as published (else it is read
                again: another instance published meanwhile, fenced; or a rolled-back
                version published to the shared topic; or markers went missing, refused).
        Step 3. The marker's own batch is a replay: skip it, if its offsets and plan agree
                (a batch below the marker, or one planned anew, is refused).
        Step 4. In one transaction, produce the results, the side records, then the marker.
        Step 5. Commit, watched (see CommitWatch).
        (The sink then removes the epoch's staged side records.)

        One branch per error kind:
        - fenced: another instance took over the id (or, when the transaction outlived its
          timeout, the broker aborted it): stop with FencedError / TransactionTimedOutError;
        - fatal: the producer is unusable: drop it and fail the epoch;
        - abortable while producing (Step 4): abort, and produce the epoch again;
        - the process was paused in the commit (long enough for another instance to take
          over): stop on any failure, never settle (a new producer would fence the other);
        - any other commit error (abortable, timed out, unknown) is settled, never retried
          blindly on the same producer: a new producer's init_transactions completes or
          aborts the transaction, and the marker read after it says whether the epoch is
          out; if not, it is produced again;
        - a commit that Kafka acknowledges nothing more of for the stall time is settled
          the same way, once per epoch and not counted as an attempt (the epoch's second
          commit waits for its answer up to the transaction timeout).
        """
        error: KafkaError | None = None
        attempts = 0
        stall_s: float | None = self.commit_stall_s()
        while attempts < MAX_EPOCH_ATTEMPTS:
            attempts += 1
            # Step 1
            producer = self._start()
            # Steps 2 and 3
            if self.already_published(epoch):
                return False
            # Step 4
            began = time.monotonic()
            try:
                producer.begin_transaction()
                marker = self._produce_epoch(producer, epoch)
            except KafkaException as exc:
                error = exc.args[0]
                # An abortable transaction refuses produce() with _STATE, without the flag.
                abortable = error.txn_requires_abort() or error.code() == KafkaError._STATE
                fenced = self._is_fenced(error)
                if abortable and not fenced:
                    log.warning(
                        "epoch %d: %s; aborting and producing it again", epoch.batch_id, error
                    )
                    self._abort()
                    continue
                raise self._failure(exc, began, epoch, fenced) from exc
            except Exception:
                self._abort()  # e.g. a record that cannot be produced: leave nothing open
                raise
            # Step 5
            watch = CommitWatch(producer, epoch.batch_id, self.timeout_s, stall_s)
            try:
                faults.point("before_kafka_commit", epoch.batch_id)
                committed = self._commit_transaction(watch, epoch.batch_id)
            except KafkaException as exc:
                error = exc.args[0]
                fenced = self._is_fenced(error)  # asks librdkafka once: it raises the cause once
                if fenced or error.fatal():
                    raise self._failure(exc, began, epoch, fenced) from exc
                if watch.paused:
                    raise watch.paused_error(f"it failed ({error})") from exc
                log.warning(
                    "epoch %d: commit failed (%s); a new producer settles the transaction and "
                    "reads the marker",
                    epoch.batch_id,
                    error,
                )
            else:
                if committed:
                    faults.point("after_kafka_commit", epoch.batch_id)
                    self._committed(marker, began)
                    return True
                log.warning(
                    "epoch %d: Kafka has answered nothing of the commit for %g s; a new producer "
                    "looks up the transaction coordinator again (Kafka moves it off a broker "
                    "that hangs), settles the transaction and reads the marker",
                    epoch.batch_id,
                    stall_s,
                )
                attempts, stall_s = attempts - 1, None
            if self._settled_by_marker(epoch):
                self._committed(marker, began)
                return True
        raise OnceflowError(
            f"epoch {epoch.batch_id} could not be published in {MAX_EPOCH_ATTEMPTS} attempts "
            f"(last error: {error}); the app stops and replays it on restart. Check the "
            "broker's health."
        )

    def _produce_epoch(self, producer: Producer, epoch: Epoch) -> Marker:
        count = self._produce_records(producer, epoch.records)
        marker = _marker(self.transactional_id, epoch, count)
        self.marker_at = None
        self._produce_marker(producer, marker, self._marker_acknowledged)
        return marker

    def _marker_acknowledged(self, error: KafkaError | None, message) -> None:
        """Where the marker was written (librdkafka flushes it before it asks to commit)."""
        if error is None:
            self.marker_at = {(message.topic(), message.partition()): message.offset()}

    def _settled_by_marker(self, epoch: Epoch) -> bool:
        """After a commit of unknown outcome: True if the epoch's marker is committed.

        A commit can have landed only if the marker was acknowledged first, and then the
        marker read must reach past it: a leader that answers with an older end is one that
        hung and does not know yet that it was replaced (see last_marker)."""
        self._drop_producer()
        self._start(self.marker_at)
        self.marker_at = None
        last = self.last
        return (
            last is not None
            and (last.batch_id, last.query_id, last.plan)
            == (epoch.batch_id, epoch.query_id, epoch.plan)
            and last.source_offsets == epoch.source_offsets
        )

    def commit_stall_s(self) -> float:
        """See COMMIT_STALL_AFTER_REQUEST_S."""
        request_ms = int(self.producer_config()["request.timeout.ms"])
        return request_ms / 1000 + COMMIT_STALL_AFTER_REQUEST_S

    def _commit_transaction(self, watch: CommitWatch, batch_id: int) -> bool:
        """True once committed; False if the commit stalled (see CommitWatch.commit)."""
        faults.commit_failure("commit_abortable", batch_id)
        with reported_if_stalled(
            f"epoch {batch_id}: the Kafka commit of {self.transactional_id!r}"
        ):
            if not watch.commit():
                return False
        faults.commit_failure("commit_outcome_unknown", batch_id)
        return True

    def _committed(self, marker: Marker, began: float) -> None:
        self.last = marker
        self.stats.transactions_committed += 1
        self.stats.records_published += marker.records
        self.stats.last_committed_batch = marker.batch_id
        self.stats.commit_seconds.append(time.monotonic() - began)

    def _failure(self, exc: KafkaException, began: float, epoch: Epoch, fenced: bool) -> Exception:
        """The error that ends this publisher: fenced or timed out, or librdkafka's own."""
        self._drop_producer()
        open_s = time.monotonic() - began
        if fenced and open_s >= self.timeout_s:
            return TransactionTimedOutError(
                f"epoch {epoch.batch_id}'s transaction was open for {open_s:.0f} s, past its "
                f"timeout of {self.timeout_s:.0f} s, so the broker aborted it (nothing of it is "
                "visible). Raise sink.transaction_timeout (the broker allows up to its "
                "transaction.max.timeout.ms), or lower source.max_records_per_batch; if the "
                "process was paused, check that no other instance runs the same app."
            )
        if fenced:
            return self._fenced()
        return exc

    def abort_open_transaction(self) -> None:
        if self.producer is not None:
            self._abort()

    def _abort(self) -> None:
        assert self.producer is not None
        try:
            self.producer.abort_transaction(self.timeout_s)
            self.stats.transactions_aborted += 1
        except KafkaException as exc:
            error = exc.args[0]
            fenced = self._is_fenced(error)
            if error.code() == KafkaError._STATE and not fenced:
                return  # no transaction was open
            self._drop_producer()
            if fenced:
                raise self._fenced() from exc
            raise


class AtLeastOncePublisher(EpochPublisher):
    """`sink.guarantee: at_least_once`: the same epochs, markers and replay check, without a
    transaction. For outputs that tolerate duplicates, and to measure what exactly-once costs.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delivery_errors: list[str] = []

    def producer_config(self) -> dict:
        return {**super().producer_config(), "on_delivery": self._delivered}

    def _delivered(self, error, message) -> None:
        if error is not None:
            self.delivery_errors.append(f"{message.topic()}[{message.partition()}]: {error}")

    def publish_epoch(self, epoch: Epoch) -> bool:
        """Publish `epoch` at least once; True if published now, False if it already was.

        Step 1. Start: a producer, then the last marker.
        Steps 2 and 3. As for exactly-once: this checkpoint's marker, replays skipped.
        Step 4. Produce every record and wait until each is acknowledged.
        Step 5. Only then produce the marker, and wait for it. A crash or a failed delivery
                before Step 5 leaves the marker behind, so the epoch is published again.
        """
        producer = self._start()
        if self.already_published(epoch):
            return False
        began = time.monotonic()
        self.delivery_errors = []
        count = self._produce_records(producer, epoch.records)
        self._await_delivery(producer, epoch.batch_id, "records")
        faults.point("before_kafka_commit", epoch.batch_id)  # records out, marker not
        marker = _marker(self.transactional_id, epoch, count)
        self._produce_marker(producer, marker)
        self._await_delivery(producer, epoch.batch_id, "marker")
        faults.point("after_kafka_commit", epoch.batch_id)
        self.last = marker
        self.stats.records_published += count
        self.stats.last_committed_batch = epoch.batch_id
        self.stats.commit_seconds.append(time.monotonic() - began)
        return True

    def _await_delivery(self, producer: Producer, batch_id: int, what: str) -> None:
        if producer.flush(self.timeout_s) or self.delivery_errors:
            failed, self.delivery_errors = self.delivery_errors, []
            self._drop_producer()
            raise OnceflowError(
                f"epoch {batch_id}: its {what} were not all acknowledged ({failed[:3]} ...); "
                "its marker is not written, so Spark runs it again (at-least-once)"
            )


def _batch(marker: Marker | None) -> int:
    return marker.batch_id if marker is not None else -1


def _marker(sink: str, epoch: Epoch, records: int) -> Marker:
    return Marker(sink, epoch.batch_id, epoch.query_id, records, epoch.source_offsets, epoch.plan)


class CommitWatch:
    """One commit_transaction, waited for in slices (librdkafka resumes it on each call)."""

    def __init__(
        self, producer: Producer, batch_id: int, timeout_s: float, stall_s: float | None
    ) -> None:
        self.producer, self.batch_id = producer, batch_id
        self.timeout_s, self.stall_s = timeout_s, stall_s
        self.paused = False  # this process did not run for PAUSED_S or more meanwhile

    def commit(self) -> bool:
        """True once committed; False, the commit left unfinished, once Kafka has
        acknowledged nothing more of it (records, EndTxn) for `stall_s` seconds that this
        process ran (None: never; the transaction timeout ends the wait, raised as
        librdkafka's _TIMED_OUT). After a pause (see PAUSED_S) it is never left, and Kafka
        must answer within `COMMIT_SLICE_S + PAUSED_S` of the resume, or the run stops: a
        restart settles the transaction, or is refused while another instance holds the
        checkpoint's lease."""
        began = last = answered = time.monotonic()
        waiting = len(self.producer)
        while True:
            try:
                self.producer.commit_transaction(COMMIT_SLICE_S)
                return True
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError._TIMED_OUT:
                    raise
                timed_out = exc
            self.producer.poll(0)  # its queued log lines and errors count in len() too
            now = time.monotonic()
            late_s = now - last - COMMIT_SLICE_S
            if late_s >= PAUSED_S:
                self.paused = True
            if late_s >= LATE_SLICE_S or len(self.producer) < waiting:
                answered = now
            waiting, last = len(self.producer), now
            if self.paused and now - answered >= COMMIT_SLICE_S + PAUSED_S:
                raise self.paused_error(f"Kafka has not answered it in {now - answered:.0f} s")
            if not self.paused and self.stall_s is not None and now - answered >= self.stall_s:
                return False
            if not self.paused and now - began >= self.timeout_s:
                raise timed_out

    def paused_error(self, what: str) -> OnceflowError:
        return OnceflowError(
            f"this process was paused in epoch {self.batch_id}'s Kafka commit, and since it "
            f"resumed {what}: the run stops rather than settle the transaction with a new "
            "producer, which would fence an instance that took the app over meanwhile. A "
            "restart settles it (the checkpoint's lease refuses the restart while another "
            "instance runs the app)."
        )


def _produce(producer: Producer, topic, partition, key, value, headers, on_delivery=None) -> None:
    extra = {"on_delivery": on_delivery} if on_delivery is not None else {}
    while True:
        try:
            if partition is None:
                producer.produce(topic, value, key, headers=headers, **extra)
            else:
                producer.produce(topic, value, key, partition, headers=headers, **extra)
            return
        except BufferError:
            producer.poll(0.05)  # the local queue is full: let deliveries drain


@dataclass(frozen=True)
class _Oversized:
    """An output record that produce() refused as larger than `limit` bytes (librdkafka
    counts key, value and headers, plus their framing)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    limit: int

    @property
    def source(self) -> str:
        """The input record's position: the last `onceflow.source` (this pipeline's)."""
        found = [value for name, value in self.headers if name == HEADER_SOURCE and value]
        if not found:
            return f"{self.topic} (an output record with no {HEADER_SOURCE})"
        return found[-1].decode(errors="replace")

    def reason(self, dropped: list[str]) -> str:
        """Why it is a dead letter, with the sizes and the limit, and what the dead letter
        dropped to fit."""
        key, value, headers = _size(self.key), _size(self.value), _headers_size(self.headers)
        text = (
            f"output record for topic {self.topic} of {key + value + headers} bytes (key {key}, "
            f"value {value}, headers {headers}) exceeds the producer limit of {self.limit} bytes "
            "(message.max.bytes)"
        )
        if dropped:
            text += f"; dropped from this dead letter to fit: {', '.join(dropped)}"
        return text

    def dead_letters(self) -> Iterator[tuple[bytes | None, list, list[str]]]:
        """(key, headers, what is dropped) of each dead letter to try, in turn: without the
        value; also without the original headers, or the key, or both (onceflow's own headers
        kept); only if those alone are too large, with no header but the input's position."""
        own = [h for h in self.headers if h[0] in ONCEFLOW_HEADERS]
        position = [h for h in self.headers if h[0] == HEADER_SOURCE][-1:]
        value = [f"value ({_size(self.value)} bytes)"] if self.value else []
        key = [f"key ({_size(self.key)} bytes)"] if self.key else []
        tried: list[tuple] = []
        for kept_key, kept in [
            (self.key, self.headers),
            (self.key, own),
            (None, self.headers),
            (None, own),
            (self.key, position),  # (onceflow's headers too large: forged upstream)
            (None, position),
        ]:
            if (kept_key, kept) in tried:
                continue  # (nothing more to drop there)
            tried.append((kept_key, kept))
            dropped_bytes = _headers_size(self.headers) - _headers_size(kept)
            headers = [f"headers ({dropped_bytes} bytes)"] if kept != self.headers else []
            yield kept_key, kept, value + (key if kept_key is None else []) + headers


def _size(data: bytes | str | None) -> int:
    return len(data) if data else 0


def _headers_size(headers: list[tuple[str, bytes | None]]) -> int:
    return sum(len(name) + _size(value) for name, value in headers)


def _recount(records: Iterable[Record], now: str) -> None:
    """Tell the sink's records (`sink._Records.recount`) that the record they yielded last
    went out as `now`."""
    recount = getattr(records, "recount", None)
    if recount is not None:
        recount(now)


def _left_out(records: Iterable[Record], record: _Oversized) -> None:
    """An oversized record with no dead-letter topic: counted and logged as the sink's
    records (`sink._Records.leave_out`) do their side records of no topic, in the epoch's
    one warning per kind; records of another kind get a warning of their own."""
    reason = record.reason([])
    leave_out = getattr(records, "leave_out", None)
    if leave_out is not None:
        leave_out("dead_letter", record.source, reason, yielded=True)
        return
    log.warning(
        "dead-letter record at %s not published, since sink.dead_letter_topic is not set "
        "(set it to keep such records): %s",
        record.source,
        reason,
    )


_publishers: dict[tuple, EpochPublisher] = {}
_lock = threading.Lock()


def publisher_for(
    conf: dict[str, str],
    transactional_id: str,
    marker_topic: str,
    dead_letter_topic: str | None = None,
    exactly_once: bool = True,
    transaction_timeout_s: float = DEFAULT_TRANSACTION_TIMEOUT_S,
    legacy_marker_topic: str | None = None,
) -> EpochPublisher:
    """The process-wide publisher of a sink: its producer lives across epochs."""
    kind = TransactionalPublisher if exactly_once else AtLeastOncePublisher
    key = (
        kind,
        transactional_id,
        marker_topic,
        dead_letter_topic,
        transaction_timeout_s,
        legacy_marker_topic,
        *sorted(conf.items()),
    )
    with _lock:
        if key not in _publishers:
            _publishers[key] = kind(
                conf,
                transactional_id,
                marker_topic,
                dead_letter_topic,
                transaction_timeout_s,
                legacy_marker_topic,
            )
        return _publishers[key]
