"""What the router makes of each input record: kept, late, or a dead letter and why."""

from __future__ import annotations

import io
import json
import math

import pyarrow as pa
from fastavro import parse_schema, schemaless_writer

from onceflow.routing import RoutePlan, classify

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
    plan = avro_plan(["null", "string"])
    _, _, dead, _, reasons = classify(plan, records(plan, ["12", None]), 0)
    assert dead.tolist() == [True, True]
    assert (
        reasons[0] == "event time field 'ts' is of type string, not a number of ms or a timestamp"
    )
    assert reasons[1] == "event time field 'ts' is missing or null"


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
