"""Every input record ends in exactly one place: the query, the dead letters, or the late topic.

The router runs in the tasks that read the source (a narrow `mapInArrow` step, so Kafka is
read once per epoch). It keeps decodable, on-time records in the query and stages the others
for the sink's transaction (see onceflow.connectors.staging), with headers saying why.

A record is late when every window it belongs to ends at or before the watermark of its
epoch: the `batchWatermarkMs` Spark wrote ahead in the offset log for this batch, the same
watermark Spark closes windows with. Late records are routed out before the aggregation, so
Spark never silently drops one, and a window's result is final once it is published.

An input of a `sql:` pipeline with an event time knows no windows: its record is late when
its event time is at or before the watermark Spark drops late rows with in this epoch, the
previous epoch's `batchWatermarkMs` (the query's, the lowest of its inputs'). That is exactly
what a stream-stream join drops; a window of the query drops only some of those (the ones
whose windows all ended), so a record behind the watermark is late even if its window is
still open.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from onceflow.connectors import staging
from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.connectors.records import (
    HEADER_ERROR,
    HEADER_LATE,
    HEADER_SOURCE,
    LATE_REASON,
    position,
    side_record,
)
from onceflow.connectors.registry import RegistrySettings

from . import formats
from .config import AVRO_FORMATS, SOURCE_META

CORRUPT = "_corrupt_record"

EVENT_TIME = "event-time"  # RoutePlan.window_type of a sql input with an event time
# The event times Spark's timestamps hold, 0001-01-01 to 9999-12-31 UTC, in epoch ms.
EVENT_TIME_MS = (-62_135_596_800_000, 253_402_300_799_999)


@dataclass(frozen=True)
class RoutePlan:
    """What the router needs to know; pickled to executors with the query."""

    checkpoint: str
    source: str  # the input's name
    format: str  # json | avro | avro-confluent | raw
    fields: tuple[str, ...]  # decoded top-level fields, in output order
    required: tuple[str, ...]  # fields that must not be null (window keys)
    event_time_field: str | None  # None: the Kafka timestamp
    dead_letter_topic: str | None
    late_topic: str | None
    # tumbling | sliding | session; "event-time": late at the watermark; None: nothing is late
    window_type: str | None = None
    window_size_ms: int = 0
    window_slide_ms: int = 0
    session_gap_ms: int = 0
    avro_schema_json: str | None = None
    json_schema_ddl: str | None = None
    registry: RegistrySettings | None = None  # avro-confluent: where writer schemas are
    # Source columns carried through (windows leave `_headers` out, see pipeline.routed_stream).
    meta: tuple[str, ...] = SOURCE_META
    # A table (see table_lookup): a null value deletes its key, a record needs a key.
    table: bool = False


def route(plan: RoutePlan, input_bytes, batches: Iterator) -> Iterator:
    """mapInArrow body: yield the records that stay in the query, stage the rest.

    `input_bytes` (a Spark accumulator, or None) counts the key and value bytes read.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyspark import TaskContext

    context = TaskContext.get()
    batch_id = int(context.getLocalProperty("streaming.sql.batchId"))
    # Read per task, never cached: a checkpoint restored at the same path plans batch ids anew.
    checkpoint = CheckpointDir(plan.checkpoint)
    batch = checkpoint.batch_plan(batch_id)
    watermark_ms = batch.watermark_ms
    if plan.window_type == EVENT_TIME:  # Spark's watermark for late rows in this epoch
        watermark_ms = checkpoint.batch_plan(batch_id - 1).watermark_ms if batch_id else 0
    side: list[dict] = []
    for records in batches:
        if input_bytes is not None:
            sizes = [
                pc.sum(pc.binary_length(records.column(c))).as_py() for c in ("_key", "_value")
            ]
            input_bytes.add(sum(s or 0 for s in sizes))
        fields, event_ms, dead, late, reasons = classify(plan, records, watermark_ms)
        for row in np.flatnonzero(dead | late):
            side.append(_side_record(plan, records, int(row), reasons[row]))
        keep = ~(dead | late)
        if keep.any():
            yield _output_batch(plan, records, fields, event_ms, keep, pa)
    # Also when there is none: an earlier attempt of this task may have staged some.
    staging.stage(checkpoint, batch, plan.source, context.partitionId(), side)


def classify(plan: RoutePlan, records, watermark_ms: int):
    """(decoded fields, event time in ms, dead, late, reasons) of a batch of input records:
    `dead` and `late` are masks, `reasons` says why each dead one is."""
    import numpy as np

    fields, reasons = _decode(plan, records)
    event_ms = _event_time_ms(plan, records, fields, reasons)
    _explain_missing(plan, fields, event_ms, reasons)
    dead = np.array([r is not None for r in reasons], dtype=bool)
    late = ~dead & _late(plan, event_ms, watermark_ms)
    return fields, event_ms, dead, late, reasons


# -- decoding ------------------------------------------------------------------------------


def _decode(plan: RoutePlan, batch) -> tuple[dict, list[str | None]]:
    """Decoded fields as Arrow arrays, and a reason for every record that cannot be decoded."""
    fields, reasons = _decode_values(plan, batch)
    if plan.table:  # a deletion has no value to decode; any table record has a key
        value_nulls = batch.column("_value").is_null().to_pylist()
        key_nulls = batch.column("_key").is_null().to_pylist()
        for row in range(batch.num_rows):
            if key_nulls[row]:
                reasons[row] = (
                    "a table's record has no key (a table holds the latest value per key)"
                )
            elif value_nulls[row]:
                reasons[row] = None
    return fields, reasons


def _decode_values(plan: RoutePlan, batch) -> tuple[dict, list[str | None]]:
    if plan.format in AVRO_FORMATS:
        values = batch.column("_value").to_pylist()
        return formats.decode_avro(plan.avro_schema_json, plan.fields, values, plan.registry)
    reasons: list[str | None] = [None] * batch.num_rows
    value_nulls = batch.column("_value").is_null().to_pylist()
    if plan.format == "raw":
        return {}, ["record value is null" if n else None for n in value_nulls]
    data = batch.column("_data")
    bad = data.is_null().to_pylist()
    corrupt = data.field(CORRUPT).is_valid().to_pylist()
    for row in range(batch.num_rows):
        if value_nulls[row]:
            reasons[row] = "record value is null"
        elif bad[row] or corrupt[row]:
            reasons[row] = formats.json_error(
                batch.column("_value")[row].as_py(), plan.json_schema_ddl or ""
            )
    return {f: data.field(f) for f in plan.fields}, reasons


def _explain_missing(plan: RoutePlan, fields: dict, event_ms, reasons: list) -> None:
    """Decodable records without an event time (when the app uses one) or without a key
    value cannot be windowed or watermarked."""
    import numpy as np

    if plan.event_time_field or plan.window_type:
        what = (
            f"event time field {plan.event_time_field!r}"
            if plan.event_time_field
            else "the Kafka timestamp"
        )
        for row in np.flatnonzero(np.isnan(event_ms)):
            if reasons[row] is None:
                reasons[row] = f"{what} is missing or null"  # unreadable ones have a reason
    for field in plan.required:
        for row in np.flatnonzero(fields[field].is_null().to_numpy(zero_copy_only=False)):
            if reasons[row] is None:
                reasons[row] = f"key field {field!r} is missing or null"


# -- event time and lateness ---------------------------------------------------------------


def _event_time_ms(plan: RoutePlan, batch, fields: dict, reasons: list):
    """Event time per record in epoch ms, as float64 with NaN where it is missing or cannot
    be one; for each record whose event time is there but cannot be one (not a number or a
    time, or outside the years Spark's timestamps hold), `reasons` says why."""
    import numpy as np
    import pyarrow as pa

    if plan.event_time_field is None:
        column, what = batch.column("_timestamp"), "the Kafka timestamp"
    else:
        column = fields[plan.event_time_field]
        what = f"event time field {plan.event_time_field!r}"
    kind = column.type
    if pa.types.is_timestamp(kind):
        ms_per_unit = {"s": 1000.0, "ms": 1.0, "us": 1e-3, "ns": 1e-6}[kind.unit]
        counts = column.cast(pa.int64())
    elif pa.types.is_date32(kind):
        ms_per_unit, counts = 86_400_000.0, column.cast(pa.int32())
    elif pa.types.is_date64(kind):
        ms_per_unit, counts = 1.0, column.cast(pa.int64())
    elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        ms_per_unit, counts = 1.0, column
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        ms_per_unit, counts = 1.0, _numbers(column, what, reasons)
    else:
        for row in np.flatnonzero(column.is_valid().to_numpy(zero_copy_only=False)):
            if reasons[row] is None:
                reasons[row] = f"{what} is of type {kind}, not a number of ms or a timestamp"
        return np.full(len(column), np.nan)
    event_ms = counts.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False) * ms_per_unit
    low, high = EVENT_TIME_MS
    with np.errstate(invalid="ignore"):
        outside = ~np.isnan(event_ms) & ~((event_ms >= low) & (event_ms <= high))
    uses_event_time = plan.event_time_field or plan.window_type
    for row in np.flatnonzero(outside) if uses_event_time else ():
        if reasons[row] is None:
            value = repr(counts[int(row)].as_py())  # a datetime would not hold it either
            value += f" {kind.unit} after 1970" if pa.types.is_timestamp(kind) else ""
            reasons[row] = f"{what} is {value}, outside the years 1-9999 of event times"
    event_ms[outside] = np.nan
    return event_ms


def _numbers(column, what: str, reasons: list):
    """A text column's numbers as float64 (null where a text is none, with its reason): a JSON
    number in a STRING field is text to Spark."""
    import pyarrow as pa

    try:
        return column.cast(pa.float64())
    except pa.ArrowInvalid:
        pass
    numbers = []
    for row, text in enumerate(column.to_pylist()):
        numbers.append(None if text is None else text_as_number(text))
        if text is not None and numbers[-1] is None and reasons[row] is None:
            reasons[row] = f"{what} is {text!r}, not a number of ms"
    return pa.array(numbers, pa.float64())


def text_as_number(text: str) -> float | None:
    """The number a text holds as Arrow reads it (no spaces, "inf" and "nan" allowed), or None."""
    import pyarrow as pa

    try:
        return pa.scalar(text).cast(pa.float64()).as_py()
    except pa.ArrowInvalid:
        return None


def _late(plan: RoutePlan, event_ms, watermark_ms: int):
    """True where every window of the record ends at or before the watermark."""
    import numpy as np

    t = np.nan_to_num(event_ms, nan=np.inf)
    if plan.window_type == "tumbling":
        last_end = np.floor(t / plan.window_size_ms) * plan.window_size_ms + plan.window_size_ms
    elif plan.window_type == "sliding":
        last_end = np.floor(t / plan.window_slide_ms) * plan.window_slide_ms + plan.window_size_ms
    elif plan.window_type == "session":
        last_end = t + plan.session_gap_ms
    elif plan.window_type == EVENT_TIME:
        last_end = t
    else:
        return np.zeros(len(t), dtype=bool)
    return last_end <= watermark_ms


# -- output --------------------------------------------------------------------------------


def _output_batch(plan: RoutePlan, batch, fields: dict, event_ms, keep, pa):
    import numpy as np

    mask = pa.array(keep)
    micros = (np.nan_to_num(event_ms[keep]) * 1000).astype("int64")
    arrays = [fields[f].filter(mask) for f in plan.fields]
    arrays.append(pa.array(micros, pa.timestamp("us", tz="UTC")))
    arrays += [batch.column(meta).filter(mask) for meta in plan.meta]
    return pa.RecordBatch.from_arrays(arrays, names=[*plan.fields, "event_time", *plan.meta])


def _side_record(plan: RoutePlan, batch, row: int, reason: str | None) -> dict:
    def get(column: str):
        return batch.column(column)[row].as_py()

    source = position(get("_topic"), get("_partition"), get("_offset"))
    headers = list(get("_headers") or []) if "_headers" in plan.meta else []
    if reason is not None:
        topic = plan.dead_letter_topic
        headers += [{"key": HEADER_ERROR, "value": reason.encode()}]
    else:
        topic = plan.late_topic
        headers += [{"key": HEADER_LATE, "value": b"true"}]
    headers += [{"key": HEADER_SOURCE, "value": source.encode()}]
    # topic None: no topic configured; the sink counts and logs the record
    return side_record(topic, get("_key"), get("_value"), headers, source, reason or LATE_REASON)
