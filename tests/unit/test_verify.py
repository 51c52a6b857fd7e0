"""`onceflow verify` for window apps, without Kafka: window assignment, open vs closed by the
watermark, results as a multiset, and the accounting that decides OK or FAILED.

A FAILED line must mean a real duplicate, loss or unaccounted record: each test below that
passes a correct run also has a twin that breaks it on purpose and must fail.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from fastavro import parse_schema, schemaless_writer

from onceflow import verify as verifying
from onceflow.config import ConfigError, parse
from onceflow.verify import (
    Batch,
    Event,
    Report,
    VerifyError,
    Window,
    WindowSpec,
    assign_windows,
    batch_index,
    canonical_key,
    check_windows,
    fixed_windows,
    read_batches,
    read_event,
    read_result,
    verify,
)

TUMBLING = WindowSpec(type="tumbling", key=("user",), count_field="n", checkpoint="", size_ms=10)
SLIDING = replace(TUMBLING, type="sliding", slide_ms=5)
SESSION = replace(TUMBLING, type="session", size_ms=0, gap_ms=10)
U1, U2 = canonical_key("u1"), canonical_key("u2")


def windows_of(spec: WindowSpec, events: list[Event], watermarks: list[int]) -> set[Window]:
    return set(assign_windows(spec, events, watermarks)[0].values())


# -- window assignment -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "t, windows",
    [(12, [(10, 20)]), (20, [(20, 30)]), (19, [(10, 20)]), (0, [(0, 10)]), (-1, [(-10, 0)])],
)
def test_a_tumbling_window_holds_its_start_but_not_its_end(t, windows):
    assert fixed_windows(t, 10) == windows


@pytest.mark.parametrize(
    "t, windows",
    [(25, [(20, 30), (25, 35)]), (24, [(15, 25), (20, 30)]), (-3, [(-10, 0), (-5, 5)])],
)
def test_sliding_windows_are_every_multiple_of_the_slide_that_contains_the_time(t, windows):
    assert fixed_windows(t, 10, 5) == windows


def test_a_sliding_record_counts_once_in_each_of_its_windows():
    events = [Event(U1, 25, 0), Event(U1, 27, 0), Event(U2, 25, 0)]
    assert windows_of(SLIDING, events, [0]) == {
        Window(U1, 20, 30, 2),
        Window(U1, 25, 35, 2),
        Window(U2, 20, 30, 1),
        Window(U2, 25, 35, 1),
    }


def test_spark_drops_a_record_from_windows_the_previous_batch_closed():
    # Batch 1 runs after batch 0's watermark 30 closed [20, 30): t=25 only joins [25, 35).
    expected, members = assign_windows(SLIDING, [Event(U1, 25, 1)], [30, 30])
    assert set(expected.values()) == {Window(U1, 25, 35, 1)}
    # All its windows closed before its batch: Spark drops it, so verify cannot count it.
    expected, members = assign_windows(SLIDING, [Event(U1, 25, 1)], [35, 35])
    assert expected == {} and members == [[]]


def test_sessions_merge_events_up_to_the_gap_apart_per_key():
    events = [Event(U1, 0, 0), Event(U1, 10, 0), Event(U1, 21, 0), Event(U2, 5, 0)]
    assert windows_of(SESSION, events, [0]) == {
        Window(U1, 0, 20, 2),  # 10 - 0 == gap: Spark merges (start <= end)
        Window(U1, 21, 31, 1),  # 21 > 20: a new session
        Window(U2, 5, 15, 1),
    }


def test_sessions_merge_with_the_state_across_batches_in_any_order():
    events = [Event(U1, 20, 0), Event(U1, 5, 1), Event(U1, 12, 2)]
    assert windows_of(SESSION, events, [0, 0, 0]) == {Window(U1, 5, 30, 3)}


def test_a_closed_session_never_grows_again():
    # [0, 10) closes at batch 1 (watermark 12); t=8 comes in batch 2, not late for the router
    # (8 + 10 > 12): Spark starts a new session instead of merging into the closed one.
    events = [Event(U1, 0, 0), Event(U1, 8, 2)]
    assert windows_of(SESSION, events, [0, 12, 12]) == {Window(U1, 0, 10, 1), Window(U1, 8, 18, 1)}
    # Read together, both are one session.
    assert windows_of(SESSION, [Event(U1, 0, 0), Event(U1, 8, 0)], [0]) == {Window(U1, 0, 18, 2)}


# -- the comparison ------------------------------------------------------------------------


def check(spec, events, published, watermark, watermarks=None, update=False):
    expected, members = assign_windows(spec, events, watermarks or [watermark])
    return check_windows(expected, members, published, watermark, update)


EVENTS = [Event(U1, 1, 0), Event(U1, 2, 0), Event(U2, 3, 0), Event(U1, 15, 0)]


def test_closed_windows_published_once_are_counted_and_open_ones_pending():
    result = check(TUMBLING, EVENTS, [Window(U1, 0, 10, 2), Window(U2, 0, 10, 1)], 10)
    assert (result.counted, result.pending, result.failed) == (3, 1, 0)
    assert not result.duplicates and not result.missing and not result.wrong


def test_a_window_published_twice_is_a_duplicate():
    twice = [Window(U1, 0, 10, 2), Window(U1, 0, 10, 2), Window(U2, 0, 10, 1)]
    result = check(TUMBLING, EVENTS, twice, 10)
    assert len(result.duplicates) == 1 and "2 times" in result.duplicates[0]
    assert (result.counted, result.failed) == (1, 2)


def test_a_closed_window_never_published_is_missing():
    result = check(TUMBLING, EVENTS, [Window(U1, 0, 10, 2)], 10)
    assert result.missing == [f"key={U2} window [0, 10): 1 records, never published"]
    assert result.failed == 1


def test_a_window_with_the_wrong_count_is_wrong():
    result = check(TUMBLING, EVENTS, [Window(U1, 0, 10, 3), Window(U2, 0, 10, 1)], 10)
    assert "published with count 3, expected 2" in result.wrong[0]
    assert result.failed == 2


def test_an_open_window_or_one_without_inputs_must_not_be_published():
    published = [Window(U1, 0, 10, 2), Window(U2, 0, 10, 1), Window(U1, 10, 20, 1)]
    assert "has not closed it" in check(TUMBLING, EVENTS, published, 10).wrong[0]
    stray = [Window(U1, 0, 10, 2), Window(U2, 0, 10, 1), Window(U2, 90, 100, 1)]
    assert "no input record" in check(TUMBLING, EVENTS, stray, 10).wrong[0]


def test_a_sliding_record_is_pending_while_any_of_its_windows_is_open():
    events = [Event(U1, 25, 0)]
    first = [Window(U1, 20, 30, 1)]
    assert check(SLIDING, events, first, 30).pending == 1
    both = [*first, Window(U1, 25, 35, 1)]
    assert check(SLIDING, events, both, 35).counted == 1
    assert check(SLIDING, events, first, 35).missing  # [25, 35) closed but not published


def test_session_results_are_checked_like_windows():
    events = [Event(U1, 0, 0), Event(U1, 5, 0), Event(U1, 40, 0)]
    good = [Window(U1, 0, 15, 2)]
    result = check(SESSION, events, good, 20)
    assert (result.counted, result.pending, result.wrong) == (2, 1, [])
    assert check(SESSION, events, [Window(U1, 0, 10, 1)], 20).wrong  # a session cut short


def test_update_mode_publishes_rising_counts_and_the_last_is_the_window():
    events = [Event(U1, 1, 0), Event(U1, 2, 1), Event(U1, 15, 1)]
    updates = [Window(U1, 0, 10, 1), Window(U1, 0, 10, 2), Window(U1, 10, 20, 1)]
    result = check(TUMBLING, events, updates, 10, [0, 10], update=True)
    assert (result.counted, result.pending, result.duplicates) == (2, 1, [])
    repeated = [Window(U1, 0, 10, 2), Window(U1, 0, 10, 2), Window(U1, 10, 20, 1)]
    assert check(TUMBLING, events, repeated, 10, [0, 10], update=True).duplicates
    stale = [Window(U1, 0, 10, 1), Window(U1, 10, 20, 1)]
    assert check(TUMBLING, events, stale, 10, [0, 10], update=True).wrong


# -- reading records and the checkpoint ----------------------------------------------------


JSON_SPEC = replace(TUMBLING, event_time_field="ts", json_schema="user STRING, ts LONG")


def test_read_event_takes_the_key_and_event_time_as_the_router_does():
    assert read_event(JSON_SPEC, b'{"user": "u1", "ts": 12}', 999) == (U1, 12)
    assert read_event(JSON_SPEC, b'{"user": 7, "ts": 12}', 0) == (canonical_key("7"), 12)
    assert read_event(replace(JSON_SPEC, event_time_field=None), b'{"user": "u1"}', 999) == (
        U1,
        999,
    )
    timestamped = replace(JSON_SPEC, json_schema="user STRING, ts TIMESTAMP")
    iso = b'{"user": "u1", "ts": "1970-01-01T00:00:01.5Z"}'
    assert read_event(timestamped, iso, 0) == (U1, 1500)


@pytest.mark.parametrize(
    "value, reason",
    [
        (None, "null"),
        (b"{not json", "not JSON"),
        (b'"a string"', "not an object"),
        (b'{"ts": 1}', "key field 'user'"),
        (b'{"user": "u1"}', "event time field 'ts' is missing"),
        (b'{"user": "u1", "ts": 1.5}', "not LONG"),
    ],
)
def test_read_event_says_why_a_record_should_be_a_dead_letter(value, reason):
    assert reason in read_event(JSON_SPEC, value, 0)


def test_read_event_reads_avro_with_the_source_schema():
    schema = {
        "type": "record",
        "name": "Click",
        "fields": [{"name": "user", "type": "string"}, {"name": "ts", "type": "long"}],
    }
    buffer = io.BytesIO()
    schemaless_writer(buffer, parse_schema(schema), {"user": "u1", "ts": 42})
    spec = replace(JSON_SPEC, format="avro", json_schema=None, avro_schema=schema)
    assert read_event(spec, buffer.getvalue(), 0) == (U1, 42)
    assert "not Avro" in read_event(spec, buffer.getvalue() + b"\x00", 0)


def test_keys_compare_as_spark_writes_them():
    spec = replace(JSON_SPEC, key=("user", "page"), json_schema="user STRING, page LONG, ts LONG")
    key, _ = read_event(spec, b'{"page": 2, "user": "u1", "ts": 1}', 0)
    published = read_result(
        b'{"key": {"user": "u1", "page": 2.0}, "window_start": 0, "window_end": 10, "n": 1}', "n"
    )
    assert published == Window(key, 0, 10, 1)
    assert "not a window result" in read_result(b'{"key": "u1"}', "n")


def test_batch_index_finds_the_batch_that_read_an_offset():
    ends = [10, 20, 20, 30]  # batch 2 read nothing here (a no-data batch)
    assert [batch_index(ends, o) for o in (0, 9, 10, 19, 20, 29, 30)] == [0, 0, 1, 1, 3, 3, None]


def write_batch(root: Path, batch_id: int, ends: dict, watermark: int, commit=True) -> None:
    """Spark's offset log entry (version, metadata, one line per source) and commit."""
    (root / "offsets").mkdir(parents=True, exist_ok=True)
    (root / "commits").mkdir(exist_ok=True)
    meta = {"batchWatermarkMs": watermark, "batchTimestampMs": 0}
    (root / "offsets" / str(batch_id)).write_text(f"v1\n{json.dumps(meta)}\n{json.dumps(ends)}")
    if commit:
        (root / "commits" / str(batch_id)).write_text('v1\n{"nextBatchWatermarkMs":0}')


def test_read_batches_reads_offsets_and_watermarks(tmp_path):
    write_batch(tmp_path, 0, {"in": {"0": 2, "1": 1}}, 0)
    write_batch(tmp_path, 1, {"in": {"0": 4, "1": 3}}, 15)
    write_batch(tmp_path, 2, {"in": {"0": 5, "1": 3}}, 20, commit=False)
    committed, planned = read_batches(str(tmp_path))
    assert committed == [
        Batch(0, {("in", 0): 2, ("in", 1): 1}, 0),
        Batch(1, {("in", 0): 4, ("in", 1): 3}, 15),
    ]
    assert planned == Batch(2, {("in", 0): 5, ("in", 1): 3}, 20)
    with pytest.raises(VerifyError, match="checkpoint.location"):
        read_batches(str(tmp_path / "absent"))


# -- verify, end to end with fake topics ---------------------------------------------------


class Message:
    def __init__(self, topic, partition, offset, value, headers=None, timestamp=0):
        self._fields = (topic, partition, offset, value, headers, timestamp)

    def topic(self):
        return self._fields[0]

    def partition(self):
        return self._fields[1]

    def offset(self):
        return self._fields[2]

    def value(self):
        return self._fields[3]

    def headers(self):
        return self._fields[4]

    def timestamp(self):
        return (1, self._fields[5])


def click(user: str, ts: int) -> bytes:
    return json.dumps({"user": user, "ts": ts}).encode()


def result(user: str, start: int, n: int) -> Message:
    value = {"key": user, "window_start": start, "window_end": start + 10, "n": n}
    return Message("out", 0, 0, json.dumps(value).encode())


def side(position: str) -> Message:
    return Message("side", 0, 0, b"", [("onceflow.source", position.encode())])


@pytest.fixture
def topics(monkeypatch, tmp_path):
    """A windowed run at rest: batch 0 read offsets 0-3, batch 1 (watermark 10) read 4-5."""
    write_batch(tmp_path, 0, {"in": {"0": 4}}, 0)
    write_batch(tmp_path, 1, {"in": {"0": 6}}, 10)
    values = [click("u1", 1), click("u1", 2), b"{bad", click("u2", 3), click("u1", 15), None]
    data = {
        "in": [Message("in", 0, i, v) for i, v in enumerate(values)],
        "out": [result("u1", 0, 2), result("u2", 0, 1)],
        "dlq": [side("in/0/2"), side("in/0/5")],
        "late": [],
    }
    monkeypatch.setattr(verifying, "read_committed", lambda _bootstrap, topic: data[topic])
    spec = replace(JSON_SPEC, checkpoint=str(tmp_path))

    def run() -> Report:
        return verify("b:9092", ["in"], "out", "dlq", "late", spec)

    return data, run


def test_a_correct_run_at_rest_is_ok_with_its_open_windows_pending(topics):
    _, run = topics
    report = run()
    assert report.ok, report.summary()
    assert (report.counted, report.pending, report.dead_letters, report.unaccounted) == (3, 1, 2, 0)
    assert "pending:         1 in windows still open at watermark 10" in report.summary()
    assert report.summary().endswith("OK: exactly once")


def test_a_late_record_is_accounted_in_the_late_topic_not_in_its_window(topics, tmp_path):
    data, run = topics
    write_batch(tmp_path, 2, {"in": {"0": 7}}, 10)
    data["in"].append(Message("in", 0, 6, click("u1", 3)))  # [0, 10) closed: late
    data["late"].append(side("in/0/6"))
    report = run()
    assert report.ok and report.late == 1 and not report.unaccounted_examples, report.summary()
    data["late"].clear()  # routed nowhere: lost
    assert run().unaccounted == 1


def test_a_run_with_a_window_published_twice_fails(topics):
    data, run = topics
    data["out"].append(result("u2", 0, 1))
    report = run()
    assert not report.ok and report.duplicates
    assert "FAILED: not exactly once (1 duplicates" in report.summary()


def test_a_run_that_lost_a_window_fails(topics):
    data, run = topics
    del data["out"][1]
    report = run()
    assert not report.ok and report.missing and report.unaccounted == 1


def test_a_record_neither_windowed_nor_a_dead_letter_is_unaccounted(topics):
    data, run = topics
    del data["dlq"][0]  # in/0/2 is not JSON: it must be a dead letter
    report = run()
    assert not report.ok and report.unaccounted == 1
    assert "in/0/2: value is not JSON" in report.unaccounted_examples[0]


def test_records_past_the_last_batch_are_not_yet_read(topics):
    data, run = topics
    data["in"].append(Message("in", 0, 6, click("u1", 3)))  # old, but no batch read it yet
    report = run()
    assert report.ok and report.unread == 1, report.summary()


def test_a_batch_published_but_not_committed_counts_only_when_its_results_are_out(topics, tmp_path):
    data, run = topics
    write_batch(tmp_path, 2, {"in": {"0": 6}}, 20, commit=False)  # would close u1 [10, 20)
    assert run().ok and run().watermark_ms == 10  # not published: windows still open
    data["out"].append(result("u1", 10, 1))
    report = run()
    assert report.ok and report.watermark_ms == 20 and report.pending == 0, report.summary()


def test_a_running_app_or_uncommitted_update_batch_gets_an_error_not_a_verdict(
    topics, tmp_path, monkeypatch
):
    data, run = topics
    write_batch(tmp_path, 2, {"in": {"0": 6}}, 20, commit=False)
    spec = replace(JSON_SPEC, checkpoint=str(tmp_path), output_mode="update")
    with pytest.raises(VerifyError, match="--available-now"):
        verify("b:9092", ["in"], "out", "dlq", "late", spec)

    def advancing(_bootstrap, topic):
        write_batch(tmp_path, 2, {"in": {"0": 6}}, 20)  # the app commits meanwhile
        return data[topic]

    monkeypatch.setattr(verifying, "read_committed", advancing)
    with pytest.raises(VerifyError, match="at rest"):
        run()


# -- from the pipeline file ----------------------------------------------------------------


PIPELINE = {
    "app_id": "clicks",
    "kafka": {"bootstrap_servers": "b:9092"},
    "source": {"topics": ["in"], "schema": "user STRING, ts LONG"},
    "event_time": {"field": "ts"},
    "window": {"type": "sliding", "size": "10s", "slide": "5s", "key": "user"},
    "sink": {"topic": "out"},
    "checkpoint": {"location": "/ck"},
}


def pipeline(aggregations: dict, **changes) -> dict:
    raw = {**PIPELINE, "window": {**PIPELINE["window"], "aggregations": aggregations}}
    for section, values in changes.items():
        raw[section] = {**raw[section], **values}
    return raw


def test_window_spec_from_config():
    spec = WindowSpec.from_config(parse(pipeline({"b": "sum(ts)", "n": "count(*)"})))
    assert (spec.type, spec.size_ms, spec.slide_ms, spec.key) == (
        "sliding",
        10_000,
        5_000,
        ("user",),
    )
    assert (spec.count_field, spec.event_time_field, spec.checkpoint) == ("n", "ts", "/ck")


@pytest.mark.parametrize(
    "aggregations, changes, path",
    [
        ({"b": "count(ts)"}, {}, "window.aggregations"),
        ({"n": "count(*)"}, {"sink": {"format": "avro"}}, "sink.format"),
        (
            {"n": "count(*)"},
            {"window": {"type": "session", "gap": "5s", "output_mode": "update"}},
            "window.output_mode",
        ),
    ],
)
def test_window_spec_refuses_what_verify_cannot_check(aggregations, changes, path):
    raw = pipeline(aggregations, **changes)
    if "gap" in raw["window"]:
        del raw["window"]["size"], raw["window"]["slide"]
    with pytest.raises(ConfigError) as error:
        WindowSpec.from_config(parse(raw))
    assert error.value.path == path


def test_a_pass_through_of_records_that_already_carry_a_source_header_counts_its_own(
    monkeypatch,
):
    """Chained pipelines: an input record published by an upstream pipeline carries that
    pipeline's `onceflow.source`; this one appends its own after the record's headers, and
    the last one is what names this pipeline's input. A header without a value is none."""
    upstream = [("onceflow.source", b"up/0/7")]
    data = {
        "in": [Message("in", 0, 0, b"a", upstream), Message("in", 0, 1, b"b")],
        "out": [
            Message("out", 0, 0, b"a", [*upstream, ("onceflow.source", b"in/0/0")]),
            Message("out", 0, 1, b"b", [("onceflow.source", b"in/0/1")]),
        ],
    }
    monkeypatch.setattr(verifying, "read_committed", lambda _bootstrap, topic: data[topic])
    report = verify("b:9092", ["in"], "out")
    assert report.ok and (report.counted, report.missing) == (2, []), report.summary()
    assert verifying._source(Message("dlq", 0, 0, b"", [("onceflow.source", None)])) is None
