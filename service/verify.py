"""`onceflow verify`: check an app's output for exactly-once, the way a data engineer would.

Reads the input, output and side topics with read_committed.

Pass-through apps: every input position must come out exactly once, in the output or a side
topic (the `onceflow.source` header names it); a position twice is a duplicate.

Window apps: verify recomputes the windows from the input, as Spark built them, and compares
them with the published count(*) of each window. Spark's offset log in the checkpoint says
which batch read each record and each batch's watermark, so verify can tell:
- dead letters and late records: in their topics, matched to inputs by position;
- closed windows (end <= the newest batch's watermark): published once each, with the count
  of records Spark put in them; a window published twice is a duplicate, absent is missing;
- pending records: only in windows the watermark has not closed yet, held in Spark's state;
- not yet read: records past the newest batch's offsets (a backlog).
Everything else is unaccounted. It exits 0 only with no duplicates, no missing or wrong
windows and nothing unaccounted: pending records and a backlog are not failures.

Spark's rules that the recomputation follows (Spark 3.4+, one stateful operator):
- a record read in batch b is dropped from its windows that end at or before the previous
  batch's watermark (the "watermark for late events"); the router already routed out a
  record all of whose windows end at or before batch b's own watermark;
- batch b closes (emits, in append mode) the windows that end at or before its watermark;
- a session grows while the next event starts at or before its end (start <= end), and
  merges only with sessions still in the state, never with one already closed.
"""

from __future__ import annotations

import io
import json
import math
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from itertools import pairwise
from typing import TYPE_CHECKING, Any, NamedTuple

from onceflow.connectors import offsets, registry
from onceflow.connectors.checkpoint import BatchPlan, CheckpointDir
from onceflow.connectors.errors import OnceflowError, OptionError
from onceflow.connectors.records import HEADER_SOURCE, parse_position, position
from onceflow.connectors.registry import RegistrySettings
from onceflow.connectors.topics import read_committed

from .config import AVRO_FORMATS
from .formats import (
    avro_field_types,
    avro_timestamp_fields,
    parsed_avro_schema,
    parsed_with_references,
    timestamps_as_micros,
)
from .routing import EVENT_TIME_MS, text_as_number

if TYPE_CHECKING:
    from onceflow.config import PipelineConfig

EXAMPLES = 5  # problems listed per kind in the summary
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
INTEGRAL = {"BIGINT", "LONG", "INT", "INTEGER", "SMALLINT", "TINYINT", "SHORT", "BYTE"}


class VerifyError(OnceflowError):
    """verify cannot give a verdict it could stand behind; the message says what to do."""


@dataclass
class Report:
    input_records: int = 0
    output_records: int = 0
    counted: int = 0  # input records the results account for
    late: int = 0
    dead_letters: int = 0
    pending: int = 0  # window apps: records only in windows still open
    unread: int = 0  # window apps: records past the newest batch's offsets
    duplicates: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # window apps: wrong counts, stray windows
    unaccounted_examples: list[str] = field(default_factory=list)
    windowed: bool = False
    watermark_ms: int | None = None  # window apps: the watermark windows were closed with
    batch_id: int | None = None  # ... and the batch that wrote it
    notes: list[str] = field(default_factory=list)

    @property
    def unaccounted(self) -> int:
        return (
            self.input_records
            - self.counted
            - self.late
            - self.dead_letters
            - self.pending
            - self.unread
        )

    @property
    def ok(self) -> bool:
        return not self.duplicates and not self.missing and not self.wrong and self.unaccounted == 0

    def summary(self) -> str:
        if not self.windowed:
            lines = [
                f"input records:   {self.input_records}",
                f"output records:  {self.output_records} (accounting for {self.counted} inputs)",
                f"late records:    {self.late}",
                f"dead letters:    {self.dead_letters}",
                f"unaccounted:     {self.unaccounted}",
                f"duplicates:      {len(self.duplicates)} {self.duplicates[:EXAMPLES]}",
                f"missing:         {len(self.missing)} {self.missing[:EXAMPLES]}",
            ]
        else:
            lines = [
                f"input records:   {self.input_records}",
                f"output records:  {self.output_records} window results "
                f"(accounting for {self.counted} inputs in closed windows)",
                f"late records:    {self.late}",
                f"dead letters:    {self.dead_letters}",
                f"pending:         {self.pending} in windows still open at {self._watermark()}",
                f"not yet read:    {self.unread}",
                f"duplicates:      {len(self.duplicates)} {self.duplicates[:EXAMPLES]}",
                f"missing windows: {len(self.missing)} {self.missing[:EXAMPLES]}",
                f"wrong windows:   {len(self.wrong)} {self.wrong[:EXAMPLES]}",
                f"unaccounted:     {self.unaccounted} {self.unaccounted_examples[:EXAMPLES]}",
            ]
        lines += [f"note: {note}" for note in self.notes]
        lines.append("OK: exactly once" if self.ok else f"FAILED: not exactly once ({self._why()})")
        return "\n".join(lines)

    def as_json(self) -> dict:
        """The report for scripts: every count, the examples, and the verdict."""
        report = asdict(self)
        report |= {"unaccounted": self.unaccounted, "ok": self.ok}
        report["why"] = None if self.ok else self._why()
        return report

    def _watermark(self) -> str:
        if self.watermark_ms is None:
            return "no watermark (the checkpoint has no committed batch)"
        when = datetime.fromtimestamp(self.watermark_ms / 1000, UTC).isoformat(
            timespec="milliseconds"
        )
        return f"watermark {self.watermark_ms} ({when}, batch {self.batch_id})"

    def _why(self) -> str:
        reasons = [
            f"{len(items)} {what}"
            for items, what in (
                (self.duplicates, "duplicates"),
                (self.missing, "missing"),
                (self.wrong, "wrong windows"),
            )
            if items
        ]
        if self.unaccounted:
            reasons.append(f"{self.unaccounted} unaccounted input records")
        return ", ".join(reasons) + "; the lines above name them"


# -- what verify knows of a window app -----------------------------------------------------


@dataclass(frozen=True)
class WindowSpec:
    """What verify needs to recompute a window app's windows from its input records."""

    type: str  # tumbling | sliding | session
    key: tuple[str, ...]
    count_field: str  # the name of a count(*) aggregation: the records of each window
    checkpoint: str  # Spark's checkpointLocation: batches, their offsets and watermarks
    size_ms: int = 0
    slide_ms: int | None = None
    gap_ms: int | None = None
    event_time_field: str | None = None  # None: the Kafka record timestamp
    format: str = "json"  # of the input records: json | avro | avro-confluent
    json_schema: str | None = None  # Spark DDL of json input
    avro_schema: dict | None = None
    registry: RegistrySettings | None = None  # avro-confluent: where writer schemas are
    output_mode: str = "append"

    @classmethod
    def from_config(cls, config: PipelineConfig) -> WindowSpec:
        """The spec of a pipeline file's window, or ConfigError when verify cannot check it."""
        from onceflow.config import ConfigError, load_avro_schema

        window = config.window
        if window is None:
            raise ConfigError("window", "verify recomputes windows only for window apps")
        counts = [a.name for a in window.aggregations if (a.function, a.column) == ("count", "*")]
        if not counts:
            raise ConfigError(
                "window.aggregations",
                "verify needs a count(*) aggregation to account for inputs: add one, "
                "e.g. `records: count(*)`",
            )
        if config.sink.format != "json":
            raise ConfigError(
                "sink.format",
                f"verify reads window results as JSON, not {config.sink.format}; check a copy "
                "of the app with sink.format json",
            )
        if window.type == "session" and window.output_mode == "update":
            raise ConfigError(
                "window.output_mode",
                "verify cannot check session windows in update mode: a merged session's "
                "earlier results are never retracted; use output_mode append",
            )
        avro = None
        if config.source.format in AVRO_FORMATS:
            avro = load_avro_schema(config, config.source)
        return cls(
            type=window.type,
            key=tuple(window.key),
            count_field=counts[0],
            checkpoint=config.checkpoint_location,
            size_ms=window.size_ms,
            slide_ms=window.slide_ms,
            gap_ms=window.gap_ms,
            event_time_field=config.event_time.field,
            format=config.source.format,
            json_schema=config.source.schema,
            avro_schema=avro,
            registry=config.registry if config.source.format == "avro-confluent" else None,
            output_mode=window.output_mode,
        )

    def last_window_end(self, time_ms: int) -> int:
        """The end of the record's newest window: it is late when this is <= the watermark."""
        if self.type == "session":
            return time_ms + (self.gap_ms or 0)
        return fixed_windows(time_ms, self.size_ms, self.slide_ms)[-1][1]


# -- the pure parts: window assignment and the comparison --------------------------------


class Event(NamedTuple):
    """An input record the query aggregated: its key (canonical JSON, see `canonical_key`),
    event time, and the index of the batch that read it in the `watermarks` given along."""

    key: str
    time_ms: int
    batch: int


class Window(NamedTuple):
    """A window, expected (from the input) or published (from the output)."""

    key: str
    start: int
    end: int
    records: int  # the count(*) of the window


WindowId = tuple[str, int]  # (key, start): how a result names its window


def fixed_windows(time_ms: int, size_ms: int, slide_ms: int | None = None) -> list[tuple[int, int]]:
    """Every [start, start + size) with start a multiple of the slide that contains the time,
    oldest first: Spark's window(); a tumbling window is one whose slide is its size."""
    slide = slide_ms or size_ms
    newest = time_ms - time_ms % slide  # Python's % floors, so this holds before 1970 too
    starts = range(newest, time_ms - size_ms, -slide)
    return [(s, s + size_ms) for s in reversed(starts)]


def assign_windows(
    spec: WindowSpec, events: Sequence[Event], watermarks: Sequence[int]
) -> tuple[dict[WindowId, Window], list[list[WindowId]]]:
    """The windows Spark built from `events`, and each event's windows.

    `watermarks[i]` is the watermark of the i-th batch. An event can have no window at all:
    the router kept it but Spark dropped it as late; the caller counts it unaccounted.
    """
    if spec.type == "session":
        return _sessions(events, spec.gap_ms or 0, watermarks)
    counts: Counter[WindowId] = Counter()
    ends: dict[WindowId, int] = {}
    members: list[list[WindowId]] = []
    for event in events:
        floor = _late_floor(watermarks, event.batch)
        mine = []
        for start, end in fixed_windows(event.time_ms, spec.size_ms, spec.slide_ms):
            if end > floor:
                counts[(event.key, start)] += 1
                ends[(event.key, start)] = end
                mine.append((event.key, start))
        members.append(mine)
    return {w: Window(w[0], w[1], ends[w], n) for w, n in counts.items()}, members


def _late_floor(watermarks: Sequence[int], batch: int) -> int:
    """Spark drops a record from windows ending at or before the previous batch's watermark.
    Before the first batch verify knows of, that is unknown: 0 keeps every window."""
    return watermarks[batch - 1] if batch > 0 else 0


def _sessions(
    events: Sequence[Event], gap_ms: int, watermarks: Sequence[int]
) -> tuple[dict[WindowId, Window], list[list[WindowId]]]:
    """Session windows per key, batch by batch as Spark's state store holds them: a batch's
    events merge with the sessions still in the state; a closed session is gone from it."""
    by_key: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, event in enumerate(events):
        by_key[event.key][event.batch].append(i)
    windows: dict[WindowId, Window] = {}
    members: list[list[WindowId]] = [[] for _ in events]
    for key, batches in by_key.items():
        done: list[list] = []
        state: list[list] = []  # [start, end, event indices]
        for batch in sorted(batches):
            floor = _late_floor(watermarks, batch)
            done += [s for s in state if s[1] <= floor]  # closed by an earlier batch
            state = [s for s in state if s[1] > floor]
            fresh = [
                [events[i].time_ms, events[i].time_ms + gap_ms, [i]]
                for i in batches[batch]
                if events[i].time_ms + gap_ms > floor
            ]
            merged: list[list] = []
            for session in sorted(state + fresh, key=lambda s: s[0]):
                if merged and session[0] <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], session[1])
                    merged[-1][2].extend(session[2])
                else:
                    merged.append([session[0], session[1], list(session[2])])
            state = merged
        for start, end, indices in done + state:
            windows[(key, start)] = Window(key, start, end, len(indices))
            for i in indices:
                members[i] = [(key, start)]
    return windows, members


@dataclass
class WindowCheck:
    """The comparison's verdict, per window and per input record."""

    counted: int = 0  # records whose windows are all closed and published right
    pending: int = 0  # records with a window still open (and none published wrong)
    failed: int = 0  # records in a window published wrong, twice, or not at all
    dropped: int = 0  # records Spark put in no window although the router kept them
    duplicates: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)


def check_windows(
    expected: dict[WindowId, Window],
    members: Sequence[Sequence[WindowId]],
    published: Sequence[Window],
    watermark_ms: int | None,
    update_mode: bool = False,
) -> WindowCheck:
    """Compare expected windows with the published results (a multiset: the same window
    twice is a duplicate). A window is closed when it ends at or before `watermark_ms`.

    Append mode publishes a window once, when it closes. Update mode publishes it each batch
    that adds to it, so its counts must rise strictly and the last must be the expected.
    """
    check = WindowCheck()
    closed_at = -math.inf if watermark_ms is None else watermark_ms
    results: dict[WindowId, list[Window]] = defaultdict(list)
    for result in published:
        results[(result.key, result.start)].append(result)
    status: dict[WindowId, str] = {}
    for wid, window in expected.items():
        got = results.pop(wid, [])
        closed = window.end <= closed_at
        name = _name(window)
        counts = [r.records for r in got]
        if update_mode and any(b <= a for a, b in pairwise(counts)):
            check.duplicates.append(f"{name} published counts {counts}: an update came twice")
        elif not update_mode and len(got) > 1:
            check.duplicates.append(f"{name} published {len(got)} times, counts {counts}")
        elif not got and (closed or update_mode):
            check.missing.append(f"{name}: {window.records} records, never published")
        elif got and not closed and not update_mode:
            check.wrong.append(f"{name} published, but the watermark has not closed it")
        elif got and (got[-1].records, got[-1].end) != (window.records, window.end):
            check.wrong.append(
                f"{name} published with count {got[-1].records}"
                + (f" and end {got[-1].end}" if got[-1].end != window.end else "")
                + f", expected {window.records}"
            )
        else:
            status[wid] = "closed" if closed else "open"
            continue
        status[wid] = "failed"
    for got in results.values():
        stray = _name(got[0])
        if len(got) > 1 and not update_mode:
            check.duplicates.append(f"{stray} published {len(got)} times")
        check.wrong.append(f"{stray} published, but no input record of the app belongs to it")
    for windows in members:
        states = {status[w] for w in windows}
        if not windows:
            check.dropped += 1
        elif "failed" in states:
            check.failed += 1
        elif "open" in states:
            check.pending += 1
        else:
            check.counted += 1
    return check


def _name(window: Window) -> str:
    return f"key={window.key} window [{window.start}, {window.end})"


def canonical_key(value: Any) -> str:
    """A window key as comparable JSON: the value of a one-field key, {field: value} for
    several (Spark's to_json of the key struct); 2.0 and 2 are the same number."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))


def _plain(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# -- the checkpoint --------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """A batch as Spark's offset log has it: the next offset per partition, its watermark."""

    batch_id: int
    ends: dict[tuple[str, int], int]
    watermark_ms: int


def read_batches(location: str) -> tuple[list[Batch], Batch | None]:
    """The committed batches still in the checkpoint, oldest first, and the batch planned
    after them but not committed (the app stopped or crashed in it), if any."""
    checkpoint = CheckpointDir(location)
    if not checkpoint.is_local or not checkpoint.path.is_dir():
        raise VerifyError(
            f"cannot read the checkpoint {location}: verify needs the app's "
            "checkpoint.location (which batch read which records, and the watermark); run it "
            "on a host where that directory is readable"
        )
    committed = [b for i in checkpoint.committed_batches() if (b := _plan(checkpoint, i))]
    planned = _plan(checkpoint, committed[-1].batch_id + 1 if committed else 0)
    return committed, planned


def _plan(checkpoint: CheckpointDir, batch_id: int) -> Batch | None:
    """Batch `batch_id` from the offset log; None if its entry is purged or not written."""
    try:
        return _batch(checkpoint.batch_plan(batch_id))
    except OptionError:
        return None


def _batch(plan: BatchPlan) -> Batch:
    ends = {
        tp: offset
        for source in plan.source_offsets
        if isinstance(source, dict) and all(isinstance(v, dict) for v in source.values())
        for tp, offset in offsets.positions(source).items()
    }
    return Batch(plan.batch_id, ends, plan.watermark_ms)


def batch_index(ends: Sequence[int], offset: int) -> int | None:
    """The index of the batch that read `offset`, given each batch's end offset in its
    partition, oldest first; None if no batch read it yet."""
    index = bisect_right(ends, offset)
    return index if index < len(ends) else None


# -- reading records -------------------------------------------------------------------------


def read_event(spec: WindowSpec, value: bytes | None, timestamp_ms: int) -> tuple[str, int] | str:
    """(key, event time in ms) of an input record, or why verify cannot read one: such a
    record should be a dead letter."""
    if value is None:
        return "record value is null"
    types: dict[str, str] = {}  # Spark's type of each field
    if spec.format in AVRO_FORMATS:
        record = _read_avro(spec, value)
        if isinstance(record, str):
            return record
        too_large = timestamps_as_micros(record, avro_timestamp_fields(spec.avro_schema))
        if too_large:
            return too_large
        event, types = spec.event_time_field, avro_field_types(spec.avro_schema)
        unit = {"TIMESTAMP": timedelta(microseconds=1), "DATE": timedelta(days=1)}
        if event in types and types[event] in unit and record.get(event) is not None:
            try:
                record[event] = EPOCH + record[event] * unit[types[event]]
            except OverflowError:
                return f"event time field {event!r} is {record[event]}, outside the years 1-9999"
    else:
        try:
            record = json.loads(value)
        except (UnicodeDecodeError, ValueError) as exc:
            return f"value is not JSON: {exc}"
        types = _ddl_types(spec.json_schema or "")
    if not isinstance(record, dict):
        return f"value is JSON {type(record).__name__}, not an object"
    if spec.event_time_field is None:
        if timestamp_ms < 0:
            return "the record has no Kafka timestamp"
        if timestamp_ms > EVENT_TIME_MS[1]:
            return f"the Kafka timestamp is {timestamp_ms}, outside the years 1-9999"
        time_ms: int | str = timestamp_ms
    else:
        time_ms = _time_ms(record.get(spec.event_time_field), types.get(spec.event_time_field))
        if isinstance(time_ms, str):
            return f"event time field {spec.event_time_field!r} {time_ms}"
    keys = {}
    for name in spec.key:
        part = record.get(name)
        if part is None:
            return f"key field {name!r} is missing or null"
        if types.get(name) == "STRING" and not isinstance(part, str):
            part = json.dumps(part, separators=(",", ":"))  # Spark reads the JSON text
        if spec.format in AVRO_FORMATS and types.get(name) in ("TIMESTAMP", "DATE"):
            part = _spark_json(part, types[name])
        keys[name] = part
    key = keys[spec.key[0]] if len(spec.key) == 1 else keys
    return canonical_key(key), time_ms


def _spark_json(part: Any, kind: str) -> str:
    """An Avro TIMESTAMP (µs) or DATE (days) key field, or the event time's datetime, as
    Spark's `to_json` writes it in a result's value, where verify reads keys: a date as
    2023-11-14, a timestamp as 2023-11-14T22:13:20.123Z (UTC, milliseconds)."""
    try:
        if kind == "DATE":
            day = part.date() if isinstance(part, datetime) else EPOCH.date() + timedelta(part)
            return f"{day.year:04d}-{day.month:02d}-{day.day:02d}"
        moment = part if isinstance(part, datetime) else EPOCH + timedelta(microseconds=part)
    except OverflowError:
        return str(part)
    return (
        f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}T{moment.hour:02d}:"
        f"{moment.minute:02d}:{moment.second:02d}.{moment.microsecond // 1000:03d}Z"
    )


def _time_ms(value: Any, ddl_type: str | None) -> int | str:
    """Event time in epoch ms, as the router computes it, or what is wrong with it."""
    time_ms = _read_time_ms(value, ddl_type)
    if isinstance(time_ms, int) and not EVENT_TIME_MS[0] <= time_ms <= EVENT_TIME_MS[1]:
        return f"is {value!r}, outside the years 1-9999 of event times"
    return time_ms


def _read_time_ms(value: Any, ddl_type: str | None) -> int | str:
    if ddl_type == "FLOAT" and isinstance(value, int | float) and not isinstance(value, bool):
        import numpy as np

        with np.errstate(over="ignore"):
            value = float(np.float32(value))  # Spark keeps 24 bits of it
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "is missing or null"
    if isinstance(value, float) and math.isinf(value):
        return f"is {value!r}, outside the years 1-9999 of event times"
    if isinstance(value, datetime):  # an Avro timestamp or date
        return math.floor(value.timestamp() * 1000)
    if isinstance(value, bool):
        return f"is {value}, not a time"
    if ddl_type == "DATE":  # Spark reads "yyyy-mm-dd" as that day's midnight, UTC
        try:
            day = date.fromisoformat(value) if isinstance(value, str) else None
        except ValueError:
            day = None
        if day is None:
            return f"is {json.dumps(value)[:40]}, which verify cannot read as a date"
        return (day - EPOCH.date()).days * 86_400_000
    if ddl_type == "STRING" and isinstance(value, str):  # a number as text, as the router reads
        number = text_as_number(value)
        if number is None:
            return f"is {value!r}, not a number of ms"
        value = number
        if math.isnan(value):
            return "is missing or null"
        if math.isinf(value):
            return f"is {value!r}, outside the years 1-9999 of event times"
    if ddl_type == "TIMESTAMP_NTZ":  # Spark reads only text without a zone, as UTC
        try:
            parsed = datetime.fromisoformat(value) if isinstance(value, str) else None
        except ValueError:
            parsed = None
        if parsed is None or parsed.tzinfo is not None:
            return f"is {json.dumps(value)[:40]}, not a timestamp without a time zone"
        return math.floor(parsed.replace(tzinfo=UTC).timestamp() * 1000)
    if ddl_type == "TIMESTAMP":
        if isinstance(value, int | float):
            return math.floor(value * 1000)  # Spark reads a JSON number as seconds
        try:
            parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            return f"is {value!r}, which verify cannot read as an ISO timestamp"
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        return math.floor(parsed.timestamp() * 1000)
    if ddl_type in INTEGRAL and not isinstance(value, int):
        return f"is {json.dumps(value)[:40]}, not {ddl_type}"
    if not isinstance(value, int | float):
        return f"is {json.dumps(value)[:40]}, not a number of ms"
    return math.floor(value)


def _ddl_types(ddl: str) -> dict[str, str]:
    """Top-level field -> upper-case type name of a Spark DDL string ("a STRING, b LONG")."""
    types, depth, current = {}, 0, ""
    for char in ddl + ",":
        depth += char in "<("
        depth -= char in ">)"
        if char == "," and depth == 0:
            words = current.split()
            if len(words) >= 2:
                types[words[0].strip("`")] = words[1].split("<")[0].split("(")[0].upper()
            current = ""
        else:
            current += char
    return types


def _read_avro(spec: WindowSpec, value: bytes) -> dict | str:
    """The record, resolved from its writer schema (from the registry) for avro-confluent."""
    from fastavro import schemaless_reader

    reader = parsed_avro_schema(json.dumps(spec.avro_schema))
    writer, resolve_to = reader, None
    if spec.registry is not None:
        try:
            schema_id, value = registry.unframe(value)
            found = registry.client_for(spec.registry).schema_by_id(schema_id)
            writer, resolve_to = parsed_with_references(json.dumps(found, sort_keys=True)), reader
        except (ValueError, registry.WriterSchemaError) as exc:
            return str(exc)
    buffer = io.BytesIO(value)
    try:
        record = schemaless_reader(buffer, writer, resolve_to)
    except Exception as exc:  # fastavro raises many kinds for corrupt bytes
        return f"value is not Avro of the source schema: {exc}"
    if buffer.tell() != len(value):
        return f"value is not Avro of the source schema: {len(value) - buffer.tell()} bytes left"
    return record


def read_result(value: bytes | None, count_field: str) -> Window | str:
    """A published window result, or why the record is not one."""
    try:
        result = json.loads(value or b"")
        return Window(
            canonical_key(result["key"]),
            int(result["window_start"]),
            int(result["window_end"]),
            int(result[count_field]),
        )
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        return f"not a window result with {count_field!r} ({type(exc).__name__}: {exc})"


# -- verify ----------------------------------------------------------------------------------


def verify(
    kafka: dict[str, str] | str,
    inputs: list[str],
    output: str,
    dead_letters: str | None = None,
    late: str | None = None,
    windows: WindowSpec | None = None,
) -> Report:
    """Check `output` against `inputs`: window results with `windows`, else pass-through.

    `kafka` is the app's librdkafka settings (security included), or a bootstrap address."""
    if windows is not None:
        return _verify_windows(kafka, inputs, output, dead_letters, late, windows)
    report = Report()
    input_positions = [
        position(m.topic(), m.partition(), m.offset())
        for t in inputs
        for m in read_committed(kafka, t)
    ]
    report.input_records = len(input_positions)
    out = read_committed(kafka, output)
    report.output_records = len(out)
    side = Counter()
    for topic, attribute in ((dead_letters, "dead_letters"), (late, "late")):
        if topic:
            records = read_committed(kafka, topic)
            setattr(report, attribute, len(records))
            side.update(_source(m) for m in records)
    positions = Counter(_source(m) for m in out)
    report.counted = sum(1 for p in positions if p is not None)
    report.duplicates = [f"{p} x{n}" for p, n in (positions + side).items() if n > 1 and p]
    seen = set(positions) | set(side)
    report.missing = [p for p in input_positions if p not in seen]
    return report


def _verify_windows(
    kafka: dict[str, str] | str,
    inputs: list[str],
    output: str,
    dead_letters: str | None,
    late: str | None,
    spec: WindowSpec,
) -> Report:
    report = Report(windowed=True)
    before = read_batches(spec.checkpoint)
    records = [m for t in inputs for m in read_committed(kafka, t)]
    side: Counter[str | None] = Counter()
    for topic, attribute in ((dead_letters, "dead_letters"), (late, "late")):
        if topic:
            found = read_committed(kafka, topic)
            setattr(report, attribute, len(found))
            side.update(_source(m) for m in found)
    out = read_committed(kafka, output)
    if read_batches(spec.checkpoint) != before:
        raise VerifyError(
            "the app ran a batch while verify read its topics: verify checks an app at rest; "
            "stop it (or wait until it is idle) and run verify again"
        )
    report.input_records, report.output_records = len(records), len(out)
    report.duplicates = [f"{p} x{n} in the side topics" for p, n in side.items() if n > 1 and p]
    published = []
    for m in out:
        result = read_result(m.value(), spec.count_field)
        if isinstance(result, str):
            where = position(m.topic(), m.partition(), m.offset())
            report.wrong.append(f"output {where}: {result}")
        else:
            published.append(result)

    batches = _batches_published(spec, before, side, published)
    watermarks = [b.watermark_ms for b in batches]
    if batches:
        report.watermark_ms, report.batch_id = batches[-1].watermark_ms, batches[-1].batch_id
    events = []
    ends: dict[tuple[str, int], list[int]] = {}
    for m in records:
        source = position(m.topic(), m.partition(), m.offset())
        if source in side:
            continue
        tp = (m.topic(), m.partition())
        if tp not in ends:
            ends[tp] = [b.ends.get(tp, 0) for b in batches]
        batch = batch_index(ends[tp], m.offset())
        if batch is None:
            report.unread += 1
            continue
        read = read_event(spec, m.value(), m.timestamp()[1])
        if isinstance(read, str):
            if dead_letters is None:  # the sink only counted and logged it
                report.dead_letters += 1
            else:
                report.unaccounted_examples.append(f"{source}: {read}, yet no dead letter")
            continue
        key, time_ms = read
        if late is None and spec.last_window_end(time_ms) <= watermarks[batch]:
            report.late += 1  # the router found it late; with no late topic, only counted
            continue
        events.append(Event(key, time_ms, batch))
    if dead_letters is None or late is None:
        report.notes.append(
            "the app has no dead letter or late topic: verify recomputed those records"
        )

    expected, members = assign_windows(spec, events, watermarks)
    check = check_windows(
        expected, members, published, report.watermark_ms, spec.output_mode == "update"
    )
    report.counted, report.pending = check.counted, check.pending
    report.duplicates += check.duplicates
    report.missing, report.wrong = check.missing, report.wrong + check.wrong
    if check.failed:
        report.unaccounted_examples.append(f"{check.failed} records in missing or wrong windows")
    if check.dropped:
        report.unaccounted_examples.append(
            f"{check.dropped} records Spark dropped as late that the router kept"
        )
    return report


def _batches_published(
    spec: WindowSpec,
    batches: tuple[list[Batch], Batch | None],
    side: Counter[str | None],
    published: Sequence[Window],
) -> list[Batch]:
    """The committed batches, and the batch planned after them if its results are out: a
    batch publishes in a Kafka transaction before Spark commits it, so a stop or crash in
    between leaves it published but not committed (a restart skips publishing it again)."""
    committed, planned = batches
    if planned is None:
        return committed
    if spec.output_mode == "update":
        raise VerifyError(
            f"batch {planned.batch_id} was planned but not committed (the app stopped or "
            "crashed in it), and in update mode verify cannot tell whether its results are "
            "out: let the app finish it (`onceflow run --available-now PIPELINE`), then verify"
        )
    before = committed[-1] if committed else Batch(-1, {}, 0)
    for topic, partition, offset in filter(None, map(parse_position, side)):
        tp = (topic, partition)
        if before.ends.get(tp, 0) <= offset < planned.ends.get(tp, 0):
            return [*committed, planned]
    if any(before.watermark_ms < w.end <= planned.watermark_ms for w in published):
        return [*committed, planned]
    return committed


def _source(message) -> str | None:
    """The position in the record's last `onceflow.source` header: onceflow appends its own
    after the input record's headers, which may hold an upstream pipeline's."""
    found = [value for key, value in message.headers() or [] if key == HEADER_SOURCE]
    return found[-1].decode(errors="replace") if found and found[-1] is not None else None
