"""Commit markers: which epoch each sink last published, stored in Kafka.

A marker is produced in the same Kafka transaction as the epoch's output, so for a
`read_committed` reader the marker is visible if and only if the output is.

Each sink has a marker topic of its own (`marker_topic_for`), so finding its last marker costs
the same beside one app or ten thousand, after ten epochs or ten million: the sink is the
topic's only writer, so no other app's open transaction stands in front of its markers, and
its last marker is read from the topic's end backwards (`newest_with_key`). A topic named in
`sink.marker_topic` may be shared by several sinks; markers are keyed by sink, and the search
from the end goes back as far as the sink's newest marker. Markers that versions before
per-sink topics wrote to the shared `onceflow.commits` are read there while the sink's own
topic holds no marker of it, so an upgraded app does not publish its last epoch again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from . import kafka_clients
from .errors import KafkaUnreachableError, OnceflowError, OptionError
from .offsets import TP
from .topics import create_topic

log = logging.getLogger("onceflow.sink")

MARKER_TOPIC_PREFIX = "onceflow.commits."
LEGACY_MARKER_TOPIC = "onceflow.commits"  # shared by every sink, before per-sink topics
MARKER_TOPIC_CONFIG = {
    "cleanup.policy": "compact",
    "min.compaction.lag.ms": "0",
    # Roll hourly, so that compaction (which skips the active segment) keeps the topic small.
    "segment.ms": "3600000",
    # A tombstone (an app reset on purpose) is not compacted away (100 years: for ever, and
    # the broker's "now + retention" stays far from overflow): without it, the sink's markers
    # in LEGACY_MARKER_TOPIC would count again.
    "delete.retention.ms": str(100 * 365 * 24 * 3600 * 1000),
}
FIRST_SPAN = 64  # offsets read first from a partition's end; each further read is 8x longer
MAX_TOPIC_NAME = 249
# The key of the record a starting sink writes to learn where its marker topic ends
# (`acknowledged_ends`). The NUL bytes keep it apart from every sink's name (its markers'
# key); compaction keeps one such record per topic.
END_PROBE_KEY = b"\x00end-probe\x00"
_NOT_IN_TOPIC_NAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class Marker:
    """`sink` published epoch `batch_id` of the query whose checkpoint has id `query_id`."""

    sink: str
    batch_id: int
    query_id: str
    records: int
    source_offsets: list = field(default_factory=list)
    plan: str = ""  # the batch plan's fingerprint (CheckpointDir.batch_plan); "" in old markers

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Marker:
        return cls(**json.loads(raw))


def marker_topic_for(sink: str) -> str:
    """The marker topic of the sink whose transactional id is `sink`: the id itself where
    Kafka allows it in a topic name, else a readable part of it and its hash."""
    name = MARKER_TOPIC_PREFIX + sink
    if len(name) <= MAX_TOPIC_NAME and not _NOT_IN_TOPIC_NAME.search(sink):
        return name
    digest = hashlib.sha256(sink.encode()).hexdigest()[:16]
    readable = _NOT_IN_TOPIC_NAME.sub("_", sink)[: MAX_TOPIC_NAME - len(MARKER_TOPIC_PREFIX) - 17]
    return f"{MARKER_TOPIC_PREFIX}{readable}-{digest}"


def ensure_marker_topic(conf: dict[str, str], topic: str) -> None:
    """Create the compacted marker topic if it is missing (one partition keeps order simple);
    refuse one made elsewhere whose markers could expire or change partition, since a sink
    whose last marker went missing would publish its replayed batch again. Checked once per
    process; without the DescribeConfigs permission the check is skipped with a warning."""
    create_topic(conf, topic, 1, MARKER_TOPIC_CONFIG)
    if topic in _checked_topics:
        return
    try:
        config = kafka_clients.topic_config(conf, topic)
    except KafkaException as exc:
        if exc.args[0].code() not in _NOT_AUTHORIZED:
            raise
        log.warning("cannot check the marker topic %s's settings: %s", topic, exc.args[0].str())
        _checked_topics.add(topic)
        return
    meta = kafka_clients.topic_metadata(conf, topic)
    partitions = len(meta.partitions) if meta is not None else 0
    policy = config.get("cleanup.policy") or ""
    retained = [config.get("retention.ms"), config.get("retention.bytes")]
    expires = "delete" in policy and retained != ["-1", "-1"]
    if "compact" not in policy or expires or partitions != 1:
        raise OptionError(
            f"the marker topic {topic!r} has cleanup.policy={policy}, retention.ms="
            f"{retained[0]}, retention.bytes={retained[1]} and {partitions} partitions: "
            "markers must never expire, so it needs cleanup.policy=compact and one partition. "
            "Name another topic in sink.marker_topic (onceflow creates it), or change this "
            "one's settings."
        )
    _checked_topics.add(topic)


_checked_topics: set[str] = set()
_NOT_AUTHORIZED = (
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
)


def last_marker(
    conf: dict[str, str],
    topic: str,
    sink: str,
    wait_s: float,
    legacy_topic: str | None = None,
    floor: dict[TP, int] | None = None,
) -> Marker | None:
    """The newest committed marker of `sink` in `topic`; while `topic` holds none, the newest
    in `legacy_topic` (if that exists).

    A tombstone (null value) deletes the sink's history: the app starts over on purpose. It
    counts as a marker, so the legacy topic is not read after it; marker topics keep
    tombstones for ever (MARKER_TOPIC_CONFIG).

    `floor`: offsets of `topic` a broker acknowledged to the caller (its last marker, or the
    records of `acknowledged_ends`). An end at or below one is not the log's end but the
    answer of a leader that was replaced and does not know it yet (it hung past its session
    timeout, or lost the controller): read from it, a committed marker would look missing and
    its epoch be published again. Such an answer is asked again.
    """
    record = _newest_committed(conf, topic, sink.encode(), wait_s, floor)
    if record is None and legacy_topic:
        return legacy_marker(conf, legacy_topic, sink, wait_s)
    return _decoded(record)


def acknowledged_ends(conf: dict[str, str], topic: str) -> dict[TP, int]:
    """The offset of a record written to each partition of `topic` now, acknowledged by all
    its in-sync replicas: a floor under the ends that the marker read may take (`last_marker`).

    A sink that starts has no marker of its own acknowledged yet, and so no other floor. A
    leader that was replaced cannot acknowledge this write (its followers follow the new
    leader, and the controller refuses it a smaller ISR), so the floor is the log's own.
    """
    budget_s = kafka_clients.retry_budget_s()
    producer = Producer(
        kafka_clients.client_conf(
            {
                **conf,
                "acks": "all",
                "enable.idempotence": False,  # a second copy of the record is harmless
                "linger.ms": 0,
                "request.timeout.ms": kafka_clients.PRODUCE_WAIT_MS,
                "message.timeout.ms": min(max(int(budget_s * 1000), 1), 2**31 - 1),
            }
        )
    )
    acknowledged: dict[TP, int] = {}
    refused: list[KafkaError] = []

    def delivered(error: KafkaError | None, message: Message) -> None:
        if error is None:
            acknowledged[topic, message.partition()] = message.offset()
        else:
            refused.append(error)

    partitions = _partitions(conf, topic)
    for partition in partitions:
        producer.produce(topic, b"", END_PROBE_KEY, partition=partition, on_delivery=delivered)
    producer.flush(budget_s + 5)
    if refused and refused[0].code() in _NOT_AUTHORIZED:
        raise OnceflowError(
            f"the sink may not write to its marker topic {topic!r} ({refused[0].str()}): grant "
            "the app's Kafka user Write on it, then restart."
        )
    if refused or len(acknowledged) < len(partitions):
        why = refused[0].str() if refused else f"no answer within {budget_s:g}s"
        raise KafkaUnreachableError(
            f"the marker topic {topic!r} did not acknowledge a write ({why}), so the sink "
            "cannot know that its marker read reaches the log's end. Check that the topic's "
            "leader is up and that it has min.insync.replicas replicas in sync, then restart."
        )
    return acknowledged


def legacy_marker(
    conf: dict[str, str], legacy_topic: str, sink: str, wait_s: float
) -> Marker | None:
    """The newest committed marker of `sink` in the shared topic that versions before per-sink
    topics wrote (None if that topic does not exist or holds none)."""
    if not _exists(conf, legacy_topic):
        return None
    record = _newest_committed(conf, legacy_topic, sink.encode(), wait_s)
    if record is not None:
        log.info("sink %s: last marker read from %s", sink, legacy_topic)
    return _decoded(record)


def _decoded(record) -> Marker | None:
    return Marker.decode(record.value()) if record is not None and record.value() else None


def newest_with_key(
    read: Callable[[int, int], list], key: bytes, low: int, end: int, span: int = FIRST_SPAN
):
    """The last record with `key` among offsets [low, end), reading backwards from `end`:
    `read(lo, hi)` returns the records in [lo, hi), in offset order. The spans read grow
    eightfold, so a key that is near the end (a sink's own topic) costs one short read, and
    one that is absent costs about as much as reading the partition once."""
    hi = end
    while hi > low:
        lo = max(low, hi - span)
        found = [record for record in read(lo, hi) if record.key() == key]
        if found:
            return found[-1]
        hi, span = lo, span * 8
    return None


def _newest_committed(
    conf: dict[str, str],
    topic: str,
    key: bytes,
    wait_s: float,
    floor: dict[TP, int] | None = None,
):
    """The newest committed record with `key` in `topic` (None if there is none).

    A `read_committed` reader stops at the first open transaction. A sink's own topic has
    none once its producer's init_transactions settled what a predecessor left open; a
    shared one can hold another sink's, which would hide this sink's newer markers behind
    it. So first wait (up to `wait_s`) until every transaction open on the topic now is
    settled.
    """
    tps = [(topic, p) for p in _partitions(conf, topic)]
    ends = _settled_ends(conf, topic, tps, wait_s, floor)
    lows = kafka_clients.earliest(conf, tps)
    consumer = Consumer(
        {
            **kafka_clients.client_conf(conf),
            "group.id": f"onceflow-marker-reader-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            # An offset gone since `lows` was read (DeleteRecords, retention on a topic made
            # elsewhere) is an error, never a silent jump to the end past the sink's marker.
            "auto.offset.reset": "error",
        }
    )
    deadline = time.monotonic() + kafka_clients.retry_budget_s()
    try:
        newest = None
        for tp in tps:  # a key lives in one partition (Kafka's partitioner hashes it)
            record = newest_with_key(
                lambda lo, hi, tp=tp: _read_range(consumer, tp, lo, hi, deadline),
                key,
                lows[tp],
                ends[tp],
            )
            newest = record if record is not None else newest
        return newest
    finally:
        consumer.close()


def _settled_ends(
    conf: dict[str, str],
    topic: str,
    tps: list[TP],
    wait_s: float,
    floor: dict[TP, int] | None = None,
) -> dict:
    """The stable end of each partition once the transactions open on it now are settled,
    and past `floor` (see last_marker)."""
    deadline = time.monotonic() + wait_s
    written = kafka_clients.high_watermarks(conf, tps)
    floor = {tp: offset for tp, offset in (floor or {}).items() if tp in written}
    behind = _behind(written, floor)
    for (_, partition), offset in behind.items():
        log.warning(
            "the leader of %s [%d] says it ends at offset %d, before offset %d, which a broker "
            "acknowledged to this sink: a leader that was replaced and does not know it yet; "
            "asking again, through a client that looks the leader up afresh",
            topic,
            partition,
            written[topic, partition],
            offset,
        )
    while behind:
        if time.monotonic() > deadline:
            (_, partition), offset = next(iter(behind.items()))
            raise OnceflowError(
                f"the marker topic {topic!r} [{partition}] still ends at "
                f"{written[topic, partition]} after {wait_s:.0f} s, but a broker acknowledged "
                f"this sink's record at offset {offset}: a broker still answers as its leader "
                "after it was replaced (cut off from the controller?), or its log lost "
                "acknowledged records (an unclean leader election?). Check the brokers, then "
                "restart"
            )
        # The client asked the replaced leader because its metadata names it; a new client's
        # metadata comes afresh from a bootstrap server (any but the cut-off node names the
        # new leader).
        kafka_clients.ask_afresh(conf)
        time.sleep(0.5)
        written = kafka_clients.high_watermarks(conf, tps)
        behind = _behind(written, floor)
    logged = False
    while True:
        ends = kafka_clients.stable_ends(conf, tps)
        if all(ends[tp] >= written[tp] for tp in tps):
            return ends
        if time.monotonic() > deadline:
            raise OnceflowError(
                f"a transaction on the marker topic {topic!r} stayed open for over {wait_s:.0f} "
                "s, so the last published epoch cannot be read; check the apps that share "
                "this marker topic (their transaction timeout), then restart"
            )
        if not logged:
            log.info("waiting for transactions open on %s to settle before reading it", topic)
            logged = True
        time.sleep(0.05)


def _behind(ends: dict[TP, int], floor: dict[TP, int]) -> dict[TP, int]:
    """The floor's offsets that `ends` do not reach past."""
    return {tp: offset for tp, offset in floor.items() if ends[tp] <= offset}


def _read_range(consumer: Consumer, tp: TP, lo: int, hi: int, deadline: float) -> list[Message]:
    """The committed records of offsets [lo, hi) of one partition, in offset order; done when
    the consumer's position reaches `hi` (transaction markers and aborted records leave gaps)."""
    topic, partition = tp
    consumer.assign([TopicPartition(topic, partition, lo)])
    records: list[Message] = []
    try:
        while True:
            for msg in consumer.consume(1_000, kafka_clients.CONSUME_WAIT_S):
                if msg.error() is not None and msg.error().code() == KafkaError._AUTO_OFFSET_RESET:
                    raise OnceflowError(
                        f"offsets {lo}-{hi} of the marker topic {topic} [{partition}] were "
                        f"deleted while they were read ({msg.error().str()}): the sink's last "
                        "marker cannot be known from them; restart, which reads the topic from "
                        "its new start"
                    )
                if msg.error() is not None:
                    raise KafkaException(msg.error())
                if msg.offset() < hi:
                    records.append(msg)
            if consumer.position([TopicPartition(topic, partition)])[0].offset >= hi:
                return records
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"reading offsets {lo}-{hi} of the marker topic {topic} [{partition}] did "
                    "not finish in time; check the broker's health, then restart"
                )
    finally:
        consumer.unassign()


def _partitions(conf: dict[str, str], topic: str) -> list[int]:
    meta = kafka_clients.topic_metadata(conf, topic)
    if meta is None:
        raise OnceflowError(f"the marker topic {topic!r} does not exist; it is created at start")
    return sorted(meta.partitions)


def _exists(conf: dict[str, str], topic: str) -> bool:
    return kafka_clients.topic_metadata(conf, topic) is not None
