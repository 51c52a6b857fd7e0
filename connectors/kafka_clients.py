"""Kafka clients cached per Python process, and the offset look-ups the source plans with.

Readers and writers are pickled to executors for every batch, so they must not hold clients.
Instead each Python process (a Spark worker, or the driver-side source/sink runner, both of
which Spark reuses across batches) keeps its clients here, keyed by their configuration.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable

from confluent_kafka import (
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec
from tenacity import (
    retry,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

log = logging.getLogger("onceflow.kafka")

TP = tuple[str, int]
REQUEST_TIMEOUT_S = 15
PREFETCH_MESSAGES = 20_000
RETRY_BUDGET_S = 60

_lock = threading.Lock()
_admins: dict[tuple, AdminClient] = {}
_consumers: dict[tuple, Consumer] = {}


def _key(conf: dict[str, str], *extra: object) -> tuple:
    return (*sorted(conf.items()), *extra)


def _retriable(exc: BaseException) -> bool:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0].retriable() or exc.args[0].code() in (
            KafkaError._TRANSPORT,
            KafkaError._TIMED_OUT,
            KafkaError._ALL_BROKERS_DOWN,
        )
    return False


def _unreachable(retry_state) -> None:
    exc = retry_state.outcome.exception()
    raise KafkaException(
        f"Kafka did not answer within {RETRY_BUDGET_S}s ({exc}); check the option "
        "'kafka.bootstrap.servers' and that the broker is up"
    ) from exc


kafka_retry = retry(
    retry=retry_if_exception(_retriable),
    wait=wait_exponential(multiplier=0.2, max=5),
    stop=stop_after_delay(RETRY_BUDGET_S),
    retry_error_callback=_unreachable,
    reraise=False,
)


def admin(conf: dict[str, str]) -> AdminClient:
    with _lock:
        key = _key(conf)
        if key not in _admins:
            _admins[key] = AdminClient(conf)
        return _admins[key]


@kafka_retry
def metadata(conf: dict[str, str]):
    try:
        return admin(conf).list_topics(timeout=REQUEST_TIMEOUT_S)
    except KafkaException:
        raise
    except Exception as exc:  # confluent-kafka raises KafkaException, but be explicit
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, str(exc))) from exc


@kafka_retry
def topic_ids(conf: dict[str, str], topics: Iterable[str]) -> dict[str, str]:
    """The id of each topic: a topic deleted and created again under its name gets a new one.

    A topic deleted since the metadata was read is left out.
    """
    names = sorted(set(topics))
    if not names:
        return {}
    futures = admin(conf).describe_topics(TopicCollection(names), request_timeout=REQUEST_TIMEOUT_S)
    ids = {}
    for name, future in futures.items():
        try:
            ids[name] = str(future.result().topic_id)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise
    return ids


@kafka_retry
def _list_offsets(
    conf: dict[str, str],
    tps: Iterable[TP],
    spec: OffsetSpec,
    isolation: IsolationLevel = IsolationLevel.READ_COMMITTED,
) -> dict[TP, int]:
    request = {TopicPartition(t, p): spec for t, p in tps}
    if not request:
        return {}
    futures = admin(conf).list_offsets(
        request, isolation_level=isolation, request_timeout=REQUEST_TIMEOUT_S
    )
    return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}


def earliest(conf: dict[str, str], tps: Iterable[TP]) -> dict[TP, int]:
    """The first offset still stored for each partition (retention moves it forward)."""
    return _list_offsets(conf, tps, OffsetSpec.earliest())


def stable_ends(conf: dict[str, str], tps: Iterable[TP]) -> dict[TP, int]:
    """The last stable offset: as far as a read_committed reader can get right now.

    A batch ending here never waits on somebody else's open transaction.
    """
    return _list_offsets(conf, tps, OffsetSpec.latest())


def high_watermarks(conf: dict[str, str], tps: Iterable[TP]) -> dict[TP, int]:
    """The end of each partition's log, open transactions included."""
    return _list_offsets(conf, tps, OffsetSpec.latest(), IsolationLevel.READ_UNCOMMITTED)


def range_consumer(conf: dict[str, str]) -> Consumer:
    """A read_committed consumer for assigned offset ranges, reused across tasks.

    Offsets that are gone raise an error (auto.offset.reset=error) instead of moving the
    consumer elsewhere: the source decides what a gone offset means (see source.read_range).
    """
    key = _key(conf, "range")
    with _lock:
        if key not in _consumers:
            _consumers[key] = Consumer(
                {
                    "fetch.min.bytes": 1,
                    "fetch.wait.max.ms": 50,
                    # Prefetch about one Arrow batch: what is fetched past a range's end is
                    # thrown away when the task unassigns the partition.
                    "queued.min.messages": PREFETCH_MESSAGES,
                    # librdkafka postpones a partition's next fetch by this much once its queue
                    # was full, and remembers that across unassign/assign: with the default
                    # (1 s) one task in three of an epoch waited a second before its first fetch.
                    "fetch.queue.backoff.ms": 10,
                    **conf,
                    # Never part of a group: offsets come from Spark's offset log.
                    "group.id": f"onceflow-range-reader-{uuid.uuid4()}",
                    "isolation.level": "read_committed",
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "enable.partition.eof": True,
                    "auto.offset.reset": "error",
                }
            )
        return _consumers[key]


def commit_group_offsets(conf: dict[str, str], group_id: str, offsets: dict[TP, int]) -> None:
    """Commit `offsets` for `group_id`, so that lag tooling shows the query's progress.

    Best effort: Spark's offset log is the truth; a failure here is logged, not raised.
    """
    key = _key(conf, "group", group_id)
    with _lock:
        if key not in _consumers:
            _consumers[key] = Consumer({**conf, "group.id": group_id, "enable.auto.commit": False})
        consumer = _consumers[key]
    try:
        consumer.commit(
            offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
            asynchronous=False,
        )
    except KafkaException as exc:
        log.warning("could not commit offsets to consumer group %s: %s", group_id, exc)
