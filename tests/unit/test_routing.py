"""What the router makes of each input record: kept, late, or a dead letter and why."""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace

import pyarrow as pa
import pytest
from fastavro import parse_schema, schemaless_writer

from onceflow.routing import RoutePlan, classify
from onceflow.verify import WindowSpec, read_event

TS = 1_700_000_000_000


def avro_plan(ts_type) -> RoutePlan:
    schema = {
        "type": "record",
        "name": "Click",
        "fields": [{"name": "user", "type": "string"}, {"name": "ts", "type": ts_type}],
    }
    return RoutePlan(
        checkpoint="/nonexistent",
        source="in",
        format="avro",
        fields=("user", "ts"),
        required=("user",),
        event_time_field="ts",
        dead_letter_topic="dead",
        late_topic="late",
        window_type="tumbling",
        window_size_ms=10_000,
        window_slide_ms=10_000,
        avro_schema_json=json.dumps(schema),
    )


def spec_of(plan: RoutePlan, **changes) -> WindowSpec:
    """verify's spec of the windows `plan` routes records for."""
    fields = {
        "type": "tumbling",
        "key": ("user",),
        "count_field": "n",
        "checkpoint": "/nonexistent",
        "size_ms": plan.window_size_ms,
        "event_time_field": plan.event_time_field,
        "format": plan.format,
        "json_schema": plan.json_schema_ddl,
        "avro_schema": json.loads(plan.avro_schema_json) if plan.avro_schema_json else None,
    }
    return WindowSpec(**(fields | changes))


def records(plan: RoutePlan, values: list) -> pa.RecordBatch:
    schema = parse_schema(json.loads(plan.avro_schema_json))
    bodies = []
    for value in values:
        buffer = io.BytesIO()
        schemaless_writer(buffer, schema, {"user": "u", "ts": value})
        bodies.append(buffer.getvalue())
    stamps = pa.array([TS * 1000] * len(values), pa.timestamp("us", tz="UTC"))
    return pa.RecordBatch.from_arrays(
        [pa.array(bodies, pa.binary()), stamps], names=["_value", "_timestamp"]
    )


def test_avro_timestamps_are_event_times_in_their_own_units():
    """fastavro reads a timestamp logical type as a datetime, which the Arrow column of its
    long did not take: every epoch of such an input failed, and each restart again."""
    for logical, unit in [("timestamp-millis", 1), ("timestamp-micros", 1000)]:
        plan = avro_plan({"type": "long", "logicalType": logical})
        fields, event_ms, dead, late, reasons = classify(plan, records(plan, [TS * unit]), 0)
        assert reasons == [None] and not dead.any() and not late.any()
        assert event_ms.tolist() == [TS]
        assert fields["ts"].type == pa.timestamp("us", tz="UTC")
        assert fields["ts"].cast(pa.int64()).to_pylist() == [TS * 1000]


def test_event_times_no_timestamp_holds_are_dead_letters_naming_the_field_and_value():
    """A double of +inf or in ns became event time INT64_MIN (dropped by Spark unseen); a
    long past 2**53, a timestamp past year 9999 failed the epoch (no field, no offset)."""
    cases = [
        ("double", [math.inf, 1.7e18, float(TS)]),
        ("long", [2**62, -(2**62), TS]),
        ({"type": "long", "logicalType": "timestamp-millis"}, [2**62, 300_000_000_000_000, TS]),
    ]
    for ts_type, values in cases:
        plan = avro_plan(ts_type)
        _, event_ms, dead, late, reasons = classify(plan, records(plan, values), 0)
        assert dead.tolist() == [True, True, False], (ts_type, reasons)
        assert all("'ts' is" in r for r in reasons[:2]), reasons
        assert not late.any() and event_ms[2] == TS


def test_an_event_time_field_that_is_not_a_time_makes_dead_letters_not_a_failed_epoch():
    """Text that holds a number is that many ms (a JSON number in a STRING field is text to
    Spark), as before; any other text, or a field of another type, is a dead letter."""
    plan = avro_plan(["null", "string"])
    _, event_ms, dead, _, reasons = classify(plan, records(plan, [str(TS), "abc", None]), 0)
    assert dead.tolist() == [False, True, True] and event_ms[0] == TS
    assert reasons[1] == "event time field 'ts' is 'abc', not a number of ms"
    assert reasons[2] == "event time field 'ts' is missing or null"
    plan = avro_plan("boolean")
    _, _, dead, _, reasons = classify(plan, records(plan, [True]), 0)
    assert reasons == ["event time field 'ts' is of type bool, not a number of ms or a timestamp"]


# -- verify models the router: both must say the same of every record ---------------------

JSON_CASES = [  # (DDL type of ts, Arrow type Spark's from_json gives, JSON value)
    ("STRING", pa.string(), str(TS)),
    ("STRING", pa.string(), "abc"),
    ("DATE", pa.date32(), "2023-11-14"),
    ("LONG", pa.int64(), 2**62),
    ("LONG", pa.int64(), TS),
    ("DOUBLE", pa.float64(), 1.7e18),
    ("FLOAT", pa.float32(), float(TS + 123)),  # Spark's FLOAT holds 1700000038912.0 of it
    ("FLOAT", pa.float32(), 1e39),  # inf to Spark
    ("TIMESTAMP_NTZ", pa.timestamp("us"), "2023-11-14T22:13:20.123"),
    ("TIMESTAMP_NTZ", pa.timestamp("us"), "2023-11-14T22:13:20Z"),  # null to Spark: a zone
]


def _arrow_value(arrow_type, value):
    """The value as Spark's from_json hands it to the router."""
    from datetime import date, datetime

    if pa.types.is_date32(arrow_type):
        return pa.array([date.fromisoformat(value)], arrow_type)
    if pa.types.is_timestamp(arrow_type):
        parsed = datetime.fromisoformat(value)
        return pa.array([None if parsed.tzinfo else parsed], arrow_type)
    if pa.types.is_float32(arrow_type) and value > 3.4e38:
        return pa.array([float("inf")], arrow_type)
    return pa.array([value], arrow_type)


@pytest.mark.parametrize(("ddl_type", "arrow_type", "value"), JSON_CASES)
def test_verify_reads_a_json_event_time_as_the_router_does(ddl_type, arrow_type, value):
    ddl = f"user STRING, ts {ddl_type}"
    plan = replace(avro_plan("long"), format="json", avro_schema_json=None, json_schema_ddl=ddl)
    data = pa.StructArray.from_arrays(
        [pa.array(["u"]), _arrow_value(arrow_type, value), pa.array([None], pa.string())],
        names=["user", "ts", "_corrupt_record"],
    )
    raw = json.dumps({"user": "u", "ts": value}).encode()
    batch = pa.RecordBatch.from_arrays(
        [pa.array([raw], pa.binary()), data, pa.array([TS * 1000], pa.timestamp("us", tz="UTC"))],
        names=["_value", "_data", "_timestamp"],
    )
    _, event_ms, dead, _, reasons = classify(plan, batch, 0)
    read = read_event(spec_of(plan), raw, TS)
    assert isinstance(read, str) == bool(dead[0]), (reasons, read)
    if not dead[0]:
        assert read[1] == event_ms[0]


def test_verify_reads_a_kafka_timestamp_no_event_time_holds_as_the_router_does():
    plan = replace(avro_plan("long"), event_time_field=None)
    too_late = 300_000_000_000_000  # ms: a producer that wrote microseconds
    batch = pa.RecordBatch.from_arrays(
        [
            records(plan, [TS]).column("_value"),
            pa.array([too_late * 1000], pa.timestamp("us", tz="UTC")),
        ],
        names=["_value", "_timestamp"],
    )
    _, _, dead, _, _ = classify(plan, batch, 0)
    assert dead.tolist() == [True]
    assert isinstance(read_event(spec_of(plan), batch.column("_value")[0].as_py(), too_late), str)


def test_verify_reads_avro_times_and_keys_them_as_spark_writes_them():
    """An Avro date is the day's midnight as an event time, and a result's key holds it as
    Spark's text; a timestamp past year 9999 in a field that is not the event time is no
    reason for a dead letter."""
    schema = {
        "type": "record",
        "name": "Visit",
        "fields": [
            {"name": "user", "type": "string"},
            {"name": "day", "type": {"type": "int", "logicalType": "date"}},
            {"name": "expires", "type": {"type": "long", "logicalType": "timestamp-millis"}},
            {"name": "seen", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        ],
    }
    day, expires = 19_675, 253_402_300_800_000  # 2023-11-14; 10000-01-01 in ms
    body = io.BytesIO()
    record = {"user": "u", "day": day, "expires": expires, "seen": TS + 123}
    schemaless_writer(body, parse_schema(schema), record)
    plan = replace(
        avro_plan("long"),
        fields=("user", "day", "expires", "seen"),
        event_time_field="day",
        avro_schema_json=json.dumps(schema),
    )
    batch = pa.RecordBatch.from_arrays(
        [pa.array([body.getvalue()], pa.binary()), pa.array([0], pa.timestamp("us", tz="UTC"))],
        names=["_value", "_timestamp"],
    )
    fields, event_ms, _, _, reasons = classify(plan, batch, 0)
    assert reasons == [None] and event_ms.tolist() == [day * 86_400_000]
    assert fields["day"].type == pa.date32()
    for key, expected in [
        (("day",), '"2023-11-14"'),
        (("user", "day"), '{"day":"2023-11-14","user":"u"}'),
        (("seen",), '"2023-11-14T22:13:20.123Z"'),  # as Spark's to_json writes it, one or more
    ]:
        read = read_event(spec_of(plan, key=key), body.getvalue(), 0)
        assert read == (expected, day * 86_400_000)


class _Task:
    """The TaskContext of attempt after attempt of task 0 of batch 0."""

    def getLocalProperty(self, name: str) -> str:
        return "0"

    def partitionId(self) -> int:
        return 0


def test_a_retried_task_that_stages_nothing_removes_what_its_earlier_attempt_staged(
    tmp_path, monkeypatch
):
    """Attempt 0 dead-letters a record (its schema id not found yet), its executor is lost,
    and the retry decodes it: the record is in the results, so it must not also be
    published as attempt 0's dead letter."""
    import pyspark

    from onceflow import routing
    from onceflow.connectors import staging
    from onceflow.connectors.checkpoint import CheckpointDir

    (tmp_path / "offsets").mkdir()
    (tmp_path / "offsets" / "0").write_text('v1\n{"batchWatermarkMs":0}\n{"in":{"0":1}}\n')
    monkeypatch.setattr(pyspark.TaskContext, "get", classmethod(lambda cls: _Task()))
    plan = RoutePlan(
        checkpoint=str(tmp_path),
        source="input",
        format="raw",
        fields=(),
        required=(),
        event_time_field=None,
        dead_letter_topic="dead",
        late_topic=None,
        meta=("_key", "_value", "_topic", "_partition", "_offset", "_timestamp"),
    )
    batch = pa.RecordBatch.from_pydict(
        {
            "_key": pa.array([None], pa.binary()),
            "_value": pa.array([b"v"], pa.binary()),
            "_topic": ["in"],
            "_partition": pa.array([0], pa.int32()),
            "_offset": pa.array([0], pa.int64()),
            "_timestamp": pa.array([0], pa.timestamp("us")),
        }
    )
    attempts = iter([["schema id 7 is not in the registry"], [None]])
    monkeypatch.setattr(routing, "_decode", lambda plan, records: ({}, next(attempts)))
    first = list(routing.route(plan, None, iter([batch])))
    second = list(routing.route(plan, None, iter([batch])))
    assert [b.num_rows for b in first] == [] and [b.num_rows for b in second] == [1]
    checkpoint = CheckpointDir(tmp_path)
    staged = staging.staged_tables(checkpoint, checkpoint.batch_plan(0))
    assert sum(t.num_rows for t in staged) == 0


def test_verify_reads_an_avro_text_event_time_as_the_router_does():
    plan = avro_plan("string")
    batch = records(plan, [str(TS), "abc"])
    _, event_ms, dead, _, _ = classify(plan, batch, 0)
    values = batch.column("_value").to_pylist()
    assert dead.tolist() == [False, True]
    assert read_event(spec_of(plan), values[0], 0) == ('"u"', event_ms[0])
    assert isinstance(read_event(spec_of(plan), values[1], 0), str)
