"""The transactional Kafka sink: two-phase commit tied to Spark's checkpoint.

Phase 1 (prepare) runs in executor tasks: `write` encodes the task's rows and hands them back
in its commit message; nothing is visible in Kafka. Phase 2 (commit) runs on the driver once
every task succeeded: `commit(messages, batchId)` publishes them all, plus a commit marker, in
one Kafka transaction (see publisher.py). Input columns follow Spark's Kafka sink: `value`
(required), `key`, `topic`, `partition`, `headers`.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    StringType,
    StructType,
)

from . import faults, sink_stats, staging
from .checkpoint import CheckpointDir
from .markers import LEGACY_MARKER_TOPIC, marker_topic_for
from .options import RESERVED_PRODUCER_KEYS, OptionError, get_positive_int, kafka_conf
from .publisher import DEFAULT_TRANSACTION_TIMEOUT_S, Epoch, publisher_for
from .records import LATE_REASON, OUTPUT_COLUMNS, headers_type, parse_position

log = logging.getLogger("onceflow.sink")

COLUMN_TYPES = {
    "value": (BinaryType, StringType),
    "key": (BinaryType, StringType),
    "topic": (StringType,),
    "partition": (IntegerType,),
    "headers": (ArrayType,),
}


@dataclass
class PreparedRecords(WriterCommitMessage):
    """Phase 1's output: a task's records, encoded, as one Arrow table (None when empty)."""

    table: object  # pyarrow.Table with OUTPUT_COLUMNS
    rows: int


class KafkaStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.conf = kafka_conf(options, RESERVED_PRODUCER_KEYS)
        self.default_topic = options.get("topic")
        self.app_id = options.get("appId")
        self.sink_name = options.get("sinkName") or self.default_topic or "sink"
        self.transactional_id = options.get("transactionalId") or (
            f"onceflow-{self.app_id}-{self.sink_name}" if self.app_id else None
        )
        if not self.transactional_id:
            raise OptionError(
                "the onceflow-kafka sink needs option 'appId' (or 'transactionalId'): the "
                "transactional id must stay the same across restarts for exactly-once"
            )
        # A topic of the sink's own, unless one is named; the markers of versions before
        # per-sink topics are found in the shared topic they wrote (see markers.py).
        self.marker_topic = options.get("markerTopic") or marker_topic_for(self.transactional_id)
        self.legacy_marker_topic = None if options.get("markerTopic") else LEGACY_MARKER_TOPIC
        self.dead_letter_topic = options.get("deadLetterTopic")
        guarantee = options.get("guarantee", "exactly_once")
        if guarantee not in ("exactly_once", "at_least_once"):
            raise OptionError(
                f"option 'guarantee' is {guarantee!r}; use exactly_once or at_least_once"
            )
        self.exactly_once = guarantee == "exactly_once"
        checkpoint = options.get("checkpointLocation")
        if not checkpoint:
            raise OptionError(
                "the onceflow-kafka sink needs option 'checkpointLocation': commit markers "
                "are tied to the checkpoint's identity"
            )
        self.checkpoint = CheckpointDir(checkpoint)
        timeout_ms = get_positive_int(options, "transactionTimeoutMs")
        self.transaction_timeout_s = (
            timeout_ms / 1000 if timeout_ms else DEFAULT_TRANSACTION_TIMEOUT_S
        )
        _check_schema(schema, has_default_topic=bool(self.default_topic))

    # -- phase 1: executors ----------------------------------------------------------------

    def write(self, iterator: Iterator) -> PreparedRecords:
        import pyarrow as pa

        faults.point("before_prepare")
        tables = [_prepare(batch, self.default_topic, pa) for batch in iterator]
        tables = [t for t in tables if t.num_rows]
        table = pa.concat_tables(tables).combine_chunks() if tables else None
        faults.point("after_prepare")
        return PreparedRecords(table, table.num_rows if table is not None else 0)

    # -- phase 2: the driver ---------------------------------------------------------------

    def commit(self, messages: list, batchId: int) -> None:
        """Publish the epoch (see the publisher's numbered steps), then forget its staging."""
        plan = self.checkpoint.batch_plan(batchId)
        tables = [m.table for m in messages if m is not None and m.table is not None]
        tables += staging.staged_tables(self.checkpoint, plan)
        records = _Records(tables, batchId)
        query_id = self.checkpoint.query_id()
        published = self.checkpoint.published_batch(self.transactional_id)
        epoch = Epoch(batchId, query_id, plan.source_offsets, records, plan.fingerprint, published)
        publisher = self._publisher()
        if not any(t.num_rows for t in tables):
            publisher.check_replay(epoch)  # an empty epoch needs no transaction
        elif publisher.publish_epoch(epoch):
            sink_stats.records_published.update(records.counts)
        sink_stats.write(self.checkpoint, self.transactional_id, publisher.stats)
        staging.clean_up_to(self.checkpoint, batchId)

    def abort(self, messages: list, batchId: int) -> None:
        self._publisher().abort_open_transaction()

    def _publisher(self):
        return publisher_for(
            self.conf,
            self.transactional_id,
            self.marker_topic,
            self.dead_letter_topic,
            self.exactly_once,
            self.transaction_timeout_s,
            self.legacy_marker_topic,
        )


class ForeachBatchSink:
    """The same two-phase publish for queries Spark's Python sinks do not take (update mode).

    Use as `writeStream.foreachBatch(ForeachBatchSink(options))`: the batch's rows are
    collected to the driver (phase 1) and published with the marker (phase 2) before Spark
    writes its commit log, exactly as `KafkaStreamWriter.commit` does.
    """

    def __init__(self, options: Mapping[str, str]) -> None:
        self.options = dict(options)

    def __call__(self, batch, batch_id: int) -> None:
        import pyarrow as pa

        writer = KafkaStreamWriter(self.options, batch.schema)
        table = batch.toArrow()
        prepared = [_prepare(b, writer.default_topic, pa) for b in table.to_batches()]
        messages = [PreparedRecords(t, t.num_rows) for t in prepared if t.num_rows]
        writer.commit(messages, batch_id)


class _Records:
    """(topic, partition, key, value, headers) tuples of an epoch, re-iterable for retries.

    Staged side records (with a `source` column) are published once per source position.
    Those with no topic configured are left out, and each full pass ends with one warning
    per kind that says which and why (`log_unpublished`). It is logged before the
    transaction commits, so a crash after the commit cannot lose the trace; a retried
    transaction logs it again.
    """

    def __init__(self, tables: list, batch_id: int) -> None:
        self.tables = tables
        self.batch_id = batch_id
        # Of the last full pass: records by kind, and the (source, reason) of those left out.
        self.counts: Counter[str] = Counter()
        self.unpublished: dict[str, list[tuple[str, str]]] = {}
        self.yielding = "result"  # the kind of the record last yielded

    def __iter__(self):
        self.counts = Counter()
        self.unpublished = defaultdict(list)
        seen: set[str] = set()
        for table in self.tables:
            columns = [table.column(c).to_pylist() for c in OUTPUT_COLUMNS]
            if "source" not in table.column_names:
                self.counts["result"] += table.num_rows
                self.yielding = "result"
                for topic, partition, key, value, headers in zip(*columns, strict=True):
                    yield topic, partition, key, value, _header_tuples(headers)
                continue
            sources = table.column("source").to_pylist()
            reasons = table.column("reason").to_pylist()
            for *record, source, reason in zip(*columns, sources, reasons, strict=True):
                if source in seen:
                    continue
                seen.add(source)
                topic, partition, key, value, headers = record
                kind = "late" if reason == LATE_REASON else "dead_letter"
                if topic is None:
                    self.leave_out(kind, source, reason)
                    continue
                self.counts[kind] += 1
                self.yielding = kind
                yield topic, partition, key, value, _header_tuples(headers)
        log_unpublished(self.unpublished, self.batch_id)

    def leave_out(self, kind: str, source: str, reason: str, yielded: bool = False) -> None:
        """Count a record of `kind` that has no topic to go to, for this pass' warning; the
        record last yielded (an oversized one) is uncounted as what it was yielded as."""
        if yielded:
            self.counts[self.yielding] -= 1
        self.counts[f"dropped_{kind}"] += 1
        self.unpublished[kind].append((source, reason))

    def recount(self, now: str) -> None:
        """The record last yielded went out as `now` (an oversized one, as a dead letter)."""
        self.counts[self.yielding] -= 1
        self.counts[now] += 1


# What a warning about unpublished records lists before it only counts.
LISTED_RUNS = 10
LISTED_REASONS = 3
TOPIC_SETTING = {"late": "sink.late_topic", "dead_letter": "sink.dead_letter_topic"}


def log_unpublished(unpublished: Mapping[str, list[tuple[str, str]]], batch_id: int) -> None:
    """One warning per kind for an epoch's records that no topic was configured for: how
    many, where (every partition, `offset_ranges`) and why (the commonest reasons, each with
    its first record). A line per record flooded the log when a backlog held thousands of
    late records; each is still logged at DEBUG."""
    for kind, records in unpublished.items():
        first_at: dict[str, str] = {}
        for source, reason in records:
            first_at.setdefault(reason, source)
        if log.isEnabledFor(logging.DEBUG):
            for source, reason in records:
                log.debug(
                    "epoch %d: %s record at %s not published: %s", batch_id, kind, source, reason
                )
        reasons = Counter(reason for _, reason in records)
        why = "; ".join(
            f"{reason} ({n}, the first at {first_at[reason]})"
            for reason, n in reasons.most_common(LISTED_REASONS)
        )
        if len(reasons) > LISTED_REASONS:
            why += f"; and {len(reasons) - LISTED_REASONS} other reasons"
        log.warning(
            "epoch %d: %d %s records not published, since %s is not set (set it to keep "
            "them): %s. Why: %s",
            batch_id,
            len(records),
            kind.replace("_", "-"),
            TOPIC_SETTING.get(kind, "a topic"),
            offset_ranges(source for source, _ in records),
            why,
        )


def offset_ranges(sources: Iterable[str], listed: int = LISTED_RUNS) -> str:
    """Where `topic/partition/offset` positions are, for a log line: every partition, its
    offsets as runs while `listed` runs last ("clicks/0 offsets 7-9, 12"), else as a count
    and span ("clicks/1: 40 records between offsets 3 and 977"). Other positions are shown
    as they are: this runs inside the epoch's transaction, and must not fail it."""
    offsets: dict[tuple[str, int], list[int]] = defaultdict(list)
    others: list[str] = []
    for source in sources:
        parsed = parse_position(source if isinstance(source, str) else None)
        if parsed is None:
            others.append(str(source))
        else:
            offsets[parsed[:2]].append(parsed[2])
    parts: list[str] = []
    for topic, partition in sorted(offsets):
        found = sorted(set(offsets[topic, partition]))
        runs = _runs(found)
        name = f"{topic}/{partition}"
        if len(runs) <= listed:
            listed -= len(runs)
            text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
            parts.append(f"{name} offsets {text}")
        else:
            span = f"between offsets {found[0]} and {found[-1]}"
            parts.append(f"{name}: {len(found)} records {span}")
    parts += others[:LISTED_RUNS]
    if len(others) > LISTED_RUNS:
        parts.append(f"and {len(others) - LISTED_RUNS} more")
    return "; ".join(parts)


def _runs(offsets: list[int]) -> list[tuple[int, int]]:
    """Sorted offsets as (first, last) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for offset in offsets:
        if runs and runs[-1][1] == offset - 1:
            runs[-1] = (runs[-1][0], offset)
        else:
            runs.append((offset, offset))
    return runs


def _header_tuples(headers: list[dict] | None) -> list[tuple] | None:
    return [(h["key"], h["value"]) for h in headers] if headers else None


def _check_schema(schema: StructType, has_default_topic: bool) -> None:
    fields = {f.name: f.dataType for f in schema.fields}
    if "value" not in fields:
        raise OptionError(
            f"the onceflow-kafka sink needs a 'value' column; the query has {sorted(fields)}"
        )
    for name, allowed in COLUMN_TYPES.items():
        if name in fields and not isinstance(fields[name], allowed):
            raise OptionError(
                f"column '{name}' must be of type "
                f"{' or '.join(t.typeName() for t in allowed)}, not {fields[name].simpleString()}"
            )
    if "topic" not in fields and not has_default_topic:
        raise OptionError("set the sink option 'topic', or give the query a 'topic' column")


def _prepare(batch, default_topic: str | None, pa):
    """Normalize a task's Arrow batch to OUTPUT_COLUMNS, with a topic on every row."""
    import pyarrow.compute as pc

    n = batch.num_rows
    names = batch.schema.names

    def column(name: str, arrow_type):
        if name not in names:
            return pa.nulls(n, arrow_type)
        return batch.column(name).cast(arrow_type)

    topic = column("topic", pa.string())
    if default_topic is not None:
        topic = pc.fill_null(topic, default_topic)
    if topic.null_count:
        row = pc.index(pc.is_null(topic), True).as_py()
        raise ValueError(
            f"row {row} of this task has a null 'topic' and the sink has no 'topic' option; "
            "set one, or give every row a topic"
        )
    return pa.table(
        {
            "topic": topic,
            "partition": column("partition", pa.int32()),
            "key": column("key", pa.binary()),
            "value": column("value", pa.binary()),
            "headers": column("headers", headers_type(pa)),
        }
    )
