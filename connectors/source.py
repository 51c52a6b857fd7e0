"""The Kafka source: every micro-batch is an offset range per topic-partition.

Spark writes the end-offset map that `latestOffset` returns to its offset log before the batch
runs, so the batch boundary *is* the checkpoint barrier, aligned to Kafka offsets. Executors
then read exactly `[start, end)` of each partition with `isolation.level=read_committed`.

Offsets are kept as Spark's Kafka source keeps them: {"topic": {"partition": offset}}.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from onceflow.connectors import kafka_clients, source_stats
from onceflow.connectors.options import (
    RESERVED_CONSUMER_KEYS,
    OptionError,
    get_bool,
    get_positive_int,
    kafka_conf,
    parse_starting_offsets,
    parse_topic_list,
)

log = logging.getLogger("onceflow.source")

Offsets = dict[str, dict[str, int]]
EARLIEST, LATEST = -2, -1  # as in Spark's startingOffsets JSON
# One Arrow batch per librdkafka prefetch queue's worth of messages.
ARROW_BATCH_ROWS = kafka_clients.PREFETCH_MESSAGES
READ_STALL_TIMEOUT_S = 120.0


class DataLossError(RuntimeError):
    """Offsets the query still had to read were deleted from Kafka."""


@dataclass(frozen=True)
class OffsetRange:
    """`[start, end)` of one topic-partition."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ReadTask(InputPartition):
    """One Spark task's work: offset ranges, read one after the other."""

    ranges: tuple[OffsetRange, ...]


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans offset-range batches on the driver and reads them on executors."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.conf = kafka_conf(options, RESERVED_CONSUMER_KEYS)
        self.topics = parse_topic_list(options)
        pattern = options.get("subscribePattern")
        if bool(self.topics) == bool(pattern):
            raise OptionError("set exactly one of the options 'subscribe' or 'subscribePattern'")
        try:
            self.pattern = re.compile(pattern) if pattern else None
        except re.error as exc:
            raise OptionError(f"option 'subscribePattern' is not a valid regex: {exc}") from None
        self.starting = parse_starting_offsets(options.get("startingOffsets", "latest"))
        self.max_offsets = get_positive_int(options, "maxOffsetsPerTrigger")
        self.parallelism = get_positive_int(options, "parallelism")
        self.fail_on_data_loss = get_bool(options, "failOnDataLoss", True)
        self.group_id = options.get("group.id") or options.get("groupId")
        # Where skipped offsets are counted for the metrics endpoint (onceflow's pipelines).
        self.stats_location = options.get("statsLocation")
        self._latest: Offsets | None = None
        self._available_now_target: dict[tuple[str, int], int] | None = None

    # Clients live in module-level caches (kafka_clients), never on the instance: the reader
    # is pickled to executors for every batch.

    # -- planning (driver) ---------------------------------------------------------------

    def _partitions_now(self) -> list[tuple[str, int]]:
        metadata = kafka_clients.metadata(self.conf)
        if self.pattern is not None:
            topics = sorted(
                t for t in metadata.topics if not t.startswith("__") and self.pattern.fullmatch(t)
            )
        else:
            missing = [t for t in self.topics if t not in metadata.topics]
            if missing:
                raise OptionError(
                    f"option 'subscribe': topic(s) {', '.join(missing)} do not exist on "
                    f"{self.conf['bootstrap.servers']}; create them first"
                )
            topics = self.topics
        return [(t, p) for t in topics for p in sorted(metadata.topics[t].partitions)]

    def initialOffset(self) -> dict:
        tps = self._partitions_now()
        if isinstance(self.starting, dict):
            return self._specific_offsets(tps, self.starting)
        ends = (
            kafka_clients.earliest(self.conf, tps)
            if self.starting == "earliest"
            else kafka_clients.stable_ends(self.conf, tps)
        )
        return _nest(ends)

    def _specific_offsets(self, tps: list[tuple[str, int]], spec: Offsets) -> Offsets:
        given = {(t, int(p)) for t, parts in spec.items() for p in parts}
        if self.pattern is None and given != set(tps):
            missing = sorted(set(tps) - given)
            unknown = sorted(given - set(tps))
            raise OptionError(
                "option 'startingOffsets' must name every partition of the subscribed topics; "
                f"missing {missing}, unknown {unknown}"
            )
        earliest = kafka_clients.earliest(self.conf, sorted(given))
        latest = kafka_clients.stable_ends(self.conf, sorted(given))
        flat = {}
        for t, p in sorted(given):
            offset = spec[t][str(p)]
            flat[(t, p)] = {EARLIEST: earliest[(t, p)], LATEST: latest[(t, p)]}.get(offset, offset)
        return _nest(flat)

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_offsets) if self.max_offsets else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The end of the next batch: never past the last stable offset, bounded by `limit`."""
        tps = self._partitions_now()
        starts = _flat(start)
        earliest = kafka_clients.earliest(self.conf, sorted(set(tps) | set(starts)))
        new = [tp for tp in tps if tp not in starts]
        if new:
            log.info("new partitions join from their earliest offset: %s", new)
            starts.update({tp: earliest[tp] for tp in new})
        self._check_data_loss(starts, earliest)
        stable = kafka_clients.stable_ends(self.conf, list(starts))
        if self._available_now_target is not None:
            target = self._available_now_target
            stable = {tp: min(o, target.get(tp, starts[tp])) for tp, o in stable.items()}
        available = {tp: max(0, stable[tp] - starts[tp]) for tp in starts}
        take = _admit(available, limit)
        end = {tp: starts[tp] + take[tp] for tp in starts}
        self._latest = _nest(stable)
        return _nest(end)

    def _check_data_loss(self, starts: dict[tuple[str, int], int], earliest: dict) -> None:
        for tp, offset in starts.items():
            if earliest[tp] > offset:
                message = (
                    f"data loss on topic {tp[0]} partition {tp[1]}: the query expected offset "
                    f"{offset} next, but the earliest available offset is {earliest[tp]}; "
                    f"{earliest[tp] - offset} offsets were deleted (retention or compaction) "
                    "before they were read."
                )
                if self.fail_on_data_loss:
                    raise DataLossError(
                        message + " Set failOnDataLoss=false to skip ahead and continue."
                    )
                log.warning("%s Continuing from %d (failOnDataLoss=false).", message, earliest[tp])
                if self.stats_location:
                    source_stats.add_data_loss(self.stats_location, *tp, earliest[tp] - offset)
                starts[tp] = earliest[tp]

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the backlog to drain: what is readable now, and nothing produced later."""
        tps = self._partitions_now()
        self._available_now_target = kafka_clients.stable_ends(self.conf, tps)

    def reportLatestOffset(self) -> dict | None:
        return self._latest

    def partitions(self, start: dict, end: dict) -> list[ReadTask]:
        starts = _flat(start)
        ends = _flat(end)
        joined = [tp for tp in ends if tp not in starts]
        if joined:  # partitions that appeared in this batch start from their earliest offset
            starts.update(kafka_clients.earliest(self.conf, joined))
        ranges = [OffsetRange(t, p, starts[(t, p)], e) for (t, p), e in ends.items()]
        return plan_tasks(ranges, self.parallelism)

    def commit(self, end: dict) -> None:
        """Publish progress to the consumer group so standard lag tooling sees it."""
        if self.group_id:
            kafka_clients.commit_group_offsets(self.conf, self.group_id, _flat(end))

    # -- reading (executors) -------------------------------------------------------------

    def read(self, partition: ReadTask) -> Iterator:
        for offset_range in partition.ranges:
            yield from read_range(self.conf, offset_range, self.fail_on_data_loss)


def read_range(conf: dict[str, str], r: OffsetRange, fail_on_data_loss: bool) -> Iterator:
    """Arrow record batches of every committed record in `[r.start, r.end)`.

    Done when the consumer *position* reaches `r.end`: transaction markers and aborted
    records leave offset gaps, so waiting for a record at `end - 1` could wait forever.
    """
    import pyarrow as pa
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    consumer = kafka_clients.range_consumer(conf, fail_on_data_loss)
    tp = TopicPartition(r.topic, r.partition, r.start)
    consumer.assign([tp])
    columns = _Columns()
    position = r.start
    last_progress = time.monotonic()
    try:
        while position < r.end:
            messages = consumer.consume(min(ARROW_BATCH_ROWS, r.end - position), 1.0)
            for msg in messages:
                err = msg.error()
                if err is None:
                    if msg.offset() < r.end:
                        columns.add(msg)
                elif err.code() != KafkaError._PARTITION_EOF:
                    _raise_read_error(r, err, fail_on_data_loss)
            new_position = consumer.position([tp])[0].offset
            if new_position > position:
                position, last_progress = new_position, time.monotonic()
            elif time.monotonic() - last_progress > READ_STALL_TIMEOUT_S:
                raise KafkaException(
                    f"reading {r.topic}[{r.partition}] made no progress for "
                    f"{READ_STALL_TIMEOUT_S:.0f}s at offset {position} (range ends at {r.end}); "
                    "is the broker reachable?"
                )
            if len(columns) >= ARROW_BATCH_ROWS:
                yield columns.to_arrow(pa)
                columns = _Columns()
        if len(columns):
            yield columns.to_arrow(pa)
    finally:
        consumer.unassign()


def _raise_read_error(r: OffsetRange, err, fail_on_data_loss: bool) -> None:
    from confluent_kafka import KafkaError, KafkaException

    if err.code() == KafkaError._AUTO_OFFSET_RESET and fail_on_data_loss:
        raise DataLossError(
            f"data loss on topic {r.topic} partition {r.partition}: offset {r.start} is no "
            "longer available (deleted by retention while the batch was being read). "
            "Set failOnDataLoss=false to skip ahead and continue."
        )
    raise KafkaException(err)


class _Columns:
    """Column buffers for one Arrow batch in the schema of Spark's Kafka source."""

    def __init__(self) -> None:
        self.key: list = []
        self.value: list = []
        self.topic: list = []
        self.partition: list = []
        self.offset: list = []
        self.timestamp: list = []
        self.timestamp_type: list = []
        self.headers: list = []

    def __len__(self) -> int:
        return len(self.offset)

    def add(self, msg) -> None:
        ts_type, ts = msg.timestamp()
        self.key.append(msg.key())
        self.value.append(msg.value())
        self.topic.append(msg.topic())
        self.partition.append(msg.partition())
        self.offset.append(msg.offset())
        # librdkafka: 0 none, 1 create time, 2 log append time; Spark: -1, 0, 1.
        self.timestamp.append(ts * 1000 if ts_type else None)
        self.timestamp_type.append(ts_type - 1)
        headers = msg.headers()
        self.headers.append([{"key": k, "value": v} for k, v in headers] if headers else None)

    def to_arrow(self, pa):
        return pa.RecordBatch.from_arrays(
            [
                pa.array(self.key, pa.binary()),
                pa.array(self.value, pa.binary()),
                pa.array(self.topic, pa.string()),
                pa.array(self.partition, pa.int32()),
                pa.array(self.offset, pa.int64()),
                pa.array(self.timestamp, pa.timestamp("us", tz="UTC")),
                pa.array(self.timestamp_type, pa.int32()),
                pa.array(self.headers, headers_type(pa)),
            ],
            names=SOURCE_COLUMNS,
        )


SOURCE_COLUMNS = [
    "key",
    "value",
    "topic",
    "partition",
    "offset",
    "timestamp",
    "timestampType",
    "headers",
]
SOURCE_SCHEMA = (
    "key BINARY, value BINARY, topic STRING, partition INT, offset BIGINT, "
    "timestamp TIMESTAMP, timestampType INT, headers ARRAY<STRUCT<key: STRING, value: BINARY>>"
)


def headers_type(pa):
    """Kafka headers as Spark's Kafka source shows them: array<struct<key, value>>."""
    return pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def _admit(available: dict[tuple[str, int], int], limit: ReadLimit) -> dict[tuple[str, int], int]:
    """How many offsets each partition may advance: all, or `maxRows` split by backlog."""
    total = sum(available.values())
    if not isinstance(limit, ReadMaxRows) or total <= limit.max_rows:
        return available
    budget = limit.max_rows
    # Proportional to backlog (as Spark's Kafka source does), at least one offset for every
    # partition with a backlog so that none starves.
    take = {tp: min(n, max(1, n * budget // total)) if n else 0 for tp, n in available.items()}
    return take


def plan_tasks(ranges: list[OffsetRange], parallelism: int | None) -> list[ReadTask]:
    """A batch's offset ranges as Spark tasks: one per partition, or `parallelism` equal shares.

    Equal shares keep every core busy to the end of the epoch: three partitions on two cores
    otherwise run as two tasks and then one alone (Q1 of the benchmark: 17% slower). A share
    takes the ranges in order and cuts one only at its edge, so a task reads few partitions.
    """
    ranges = [r for r in ranges if r.size > 0]
    if not parallelism or not ranges:
        return [ReadTask((r,)) for r in ranges]
    total = sum(r.size for r in ranges)
    tasks = min(parallelism, total)
    shares = iter(total // tasks + (1 if i < total % tasks else 0) for i in range(tasks))
    planned: list[ReadTask] = []
    current: list[OffsetRange] = []
    room = next(shares)
    for r in ranges:
        start = r.start
        while start < r.end:
            end = min(r.end, start + room)
            current.append(OffsetRange(r.topic, r.partition, start, end))
            room -= end - start
            start = end
            if room == 0:  # this share is full
                planned.append(ReadTask(tuple(current)))
                current, room = [], next(shares, 0)
    return planned


def _flat(offsets: Mapping) -> dict[tuple[str, int], int]:
    return {(t, int(p)): int(o) for t, parts in offsets.items() for p, o in parts.items()}


def _nest(flat: Mapping[tuple[str, int], int]) -> Offsets:
    nested: Offsets = {}
    for (t, p), o in sorted(flat.items()):
        nested.setdefault(t, {})[str(p)] = int(o)
    return nested
