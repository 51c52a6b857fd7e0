"""Pipelines from YAML against a real broker and a real Spark session: windows, modes, formats,
dead letters, late records, and the record accounting invariant."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import yaml
from fastavro import parse_schema, schemaless_reader, schemaless_writer

from onceflow.config import parse
from onceflow.connectors.topics import create_topic, read_committed
from onceflow.runner import run
from tests.helpers import free_port, own_broker, processes, produce, wait_until

pytestmark = pytest.mark.integration
BASE = 1_700_000_000_000  # event times start here (ms)
SCHEMA = "user STRING, url STRING, bytes LONG, ts LONG"
TUMBLING_CLICKS = {  # clicks and bytes per user, in 10 s windows
    "type": "tumbling",
    "size": "10s",
    "key": "user",
    "aggregations": {"clicks": "count(*)", "bytes": "sum(bytes)"},
}


def click(user: str, ts: int, url: str = "/", size: int = 10) -> bytes:
    return json.dumps({"user": user, "url": url, "bytes": size, "ts": ts}).encode()


@pytest.fixture
def topics(new_topic):
    return {name: new_topic(partitions=2, prefix=name) for name in ("in", "out", "dlq", "late")}


def pipeline(topics, tmp_path, bootstrap: str, window: dict | None = None) -> dict:
    config = {
        "app_id": f"test-{topics['in']}",
        "kafka": {"bootstrap_servers": bootstrap},
        "source": {
            "topics": [topics["in"]],
            "starting_offsets": "earliest",
            "format": "json",
            "schema": SCHEMA,
            "max_records_per_batch": 100_000,
        },
        "event_time": {"field": "ts", "watermark_delay": "5s"},
        "sink": {
            "topic": topics["out"],
            "dead_letter_topic": topics["dlq"],
            "late_topic": topics["late"],
        },
        "checkpoint": {"location": str(tmp_path / "ck")},
    }
    if window is not None:
        config["window"] = window
    return config


def results(bootstrap: str, topic: str) -> dict[tuple, dict]:
    """Append-mode window results by (key, window_start); a window published twice fails."""
    final: dict[tuple, dict] = {}
    for m in read_committed(bootstrap, topic):
        value = json.loads(m.value())
        window = (json.dumps(value["key"]), value["window_start"])
        assert window not in final, f"window {window} published twice: {final[window]}, {value}"
        final[window] = value
    return final


def tumbling_expected(events: list[tuple[str, int]], size: int) -> dict[tuple, dict]:
    expected: dict = defaultdict(lambda: {"clicks": 0, "bytes": 0})
    for user, ts in events:
        start = BASE + (ts - BASE) // size * size
        row = expected[(json.dumps(user), start)]
        row.update(key=user, window_start=start, window_end=start + size)
        row["clicks"] += 1
        row["bytes"] += 10
    return dict(expected)


def test_tumbling_windows_with_dead_letters_late_records_and_exact_accounting(
    kafka_bootstrap, spark, topics, tmp_path
):
    config = parse(pipeline(topics, tmp_path, kafka_bootstrap, TUMBLING_CLICKS))
    on_time = [(f"u{i % 3}", BASE + i * 97) for i in range(600)]  # about 58 s of events
    malformed = [
        b"{not json",
        json.dumps({"user": "u1", "bytes": "abc", "ts": BASE}).encode(),
        json.dumps({"user": "u1", "bytes": 1}).encode(),
        json.dumps({"ts": BASE}).encode(),
        None,
    ]
    produce(
        kafka_bootstrap,
        topics["in"],
        [(u.encode(), click(u, ts), i % 2) for i, (u, ts) in enumerate(on_time)]
        + [(b"bad", v, 0) for v in malformed],
    )
    run(config, available_now=True)

    # Behind the watermark now (it is past BASE + 50 s): late. One far-ahead record closes
    # every window of the first run; its own window stays open.
    late = [("u1", BASE + 1_000), ("u2", BASE + 12_000)]
    produce(
        kafka_bootstrap,
        topics["in"],
        [(u.encode(), click(u, ts), 1) for u, ts in late]
        + [(b"u0", click("u0", BASE + 1_000_000), 0)],
    )
    run(config, available_now=True)

    assert results(kafka_bootstrap, topics["out"]) == tumbling_expected(on_time, 10_000)
    dead = read_committed(kafka_bootstrap, topics["dlq"])
    assert sorted(m.value() or b"" for m in dead) == sorted(v or b"" for v in malformed)
    reasons = {dict(m.headers())["onceflow.error"].decode() for m in dead}
    assert reasons == {
        "value is not valid JSON: Expecting property name enclosed in double quotes at character 1",
        "field 'bytes' is \"abc\", not LONG",
        "event time field 'ts' is missing or null",
        "key field 'user' is missing or null",
        "record value is null",
    }
    assert all(
        dict(m.headers())["onceflow.source"].startswith(topics["in"].encode() + b"/0/")
        for m in dead
    )
    late_out = read_committed(kafka_bootstrap, topics["late"])
    assert sorted(m.value() for m in late_out) == sorted(click(u, ts) for u, ts in late)
    assert all(dict(m.headers())["onceflow.late"] == b"true" for m in late_out)

    # Every input record is in exactly one place (the far-ahead one is in an open window).
    counted = sum(r["clicks"] for r in results(kafka_bootstrap, topics["out"]).values())
    inputs = len(on_time) + len(malformed) + len(late) + 1
    assert counted + len(dead) + len(late_out) + 1 == inputs

    # The keyed state: a partition per core of local[2], and each epoch uploaded a changelog
    # of its changes instead of a snapshot of the whole store.
    state = Path(config.checkpoint_location) / "state" / "0"
    assert sorted(p.name for p in state.iterdir() if p.name.isdigit()) == ["0", "1"]
    assert {p.parent.name for p in state.glob("*/*.changelog")} == {"0", "1"}


def test_a_run_of_seconds_uploads_state_snapshots_that_a_restart_continues_from(
    kafka_bootstrap, spark, topics, tmp_path
):
    """Each epoch uploads a changelog of the state; every 10th version is snapshotted and the
    snapshot uploaded by Spark's maintenance task. Run by Spark's default only a minute after
    the state is loaded, it never ran in a process that lived shorter, and every restart
    replayed all the changelogs since the checkpoint began."""
    raw = pipeline(topics, tmp_path, kafka_bootstrap, TUMBLING_CLICKS)
    raw["source"]["max_records_per_batch"] = 32  # 30 epochs: the run lasts seconds
    config = parse(raw)
    events = [(f"u{i % 3}", BASE + i * 97) for i in range(960)]
    produce(kafka_bootstrap, topics["in"], [(u.encode(), click(u, ts), 0) for u, ts in events])
    run(config, available_now=True)

    state = Path(config.checkpoint_location) / "state" / "0"
    # Within one tick of the interval (this test's session outlives the run; a service
    # process that ends with its run drops a snapshot not uploaded by then).
    wait_until(
        lambda: {p.parent.name for p in state.glob("*/*.zip")} == {"0", "1"},
        timeout=10,
        what="a state snapshot of each partition",
    )
    # The restart must load a snapshot: the changelogs up to each partition's newest one are
    # gone. A far-ahead record closes every window of the first run.
    for partition in state.glob("[0-9]*"):
        newest = max(int(z.name.split(".")[0].split("_")[0]) for z in partition.glob("*.zip"))
        for changelog in partition.glob("*.changelog"):
            if int(changelog.name.split(".")[0].split("_")[0]) <= newest:
                changelog.unlink()
    produce(kafka_bootstrap, topics["in"], [(b"u0", click("u0", BASE + 1_000_000), 1)])
    run(config, available_now=True)
    assert results(kafka_bootstrap, topics["out"]) == tumbling_expected(events, 10_000)


def test_sliding_windows_count_each_event_in_every_window_it_falls_in(
    kafka_bootstrap, spark, topics, tmp_path
):
    window = {
        "type": "sliding",
        "size": "10s",
        "slide": "5s",
        "key": "user",
        "aggregations": {"clicks": "count(*)"},
    }
    config = parse(pipeline(topics, tmp_path, kafka_bootstrap, window))
    events = [("a", BASE + 1_000), ("a", BASE + 6_000), ("a", BASE + 12_000), ("b", BASE + 7_000)]
    produce(
        kafka_bootstrap,
        topics["in"],
        [(u.encode(), click(u, ts), 0) for u, ts in events]
        + [(b"z", click("z", BASE + 100_000), 0)],
    )
    run(config, available_now=True)

    got = {k: v["clicks"] for k, v in results(kafka_bootstrap, topics["out"]).items()}
    assert got == {
        ('"a"', BASE - 5_000): 1,
        ('"a"', BASE): 2,
        ('"a"', BASE + 5_000): 2,
        ('"a"', BASE + 10_000): 1,
        ('"b"', BASE): 1,
        ('"b"', BASE + 5_000): 1,
    }


def test_session_windows_close_after_the_gap(kafka_bootstrap, spark, topics, tmp_path):
    window = {
        "type": "session",
        "gap": "10s",
        "key": "user",
        "aggregations": {"clicks": "count(*)", "last": "max(ts)"},
    }
    config = parse(pipeline(topics, tmp_path, kafka_bootstrap, window))
    events = [("a", BASE), ("a", BASE + 4_000), ("a", BASE + 30_000), ("b", BASE + 2_000)]
    produce(
        kafka_bootstrap,
        topics["in"],
        [(u.encode(), click(u, ts), 0) for u, ts in events]
        + [(b"z", click("z", BASE + 100_000), 0)],
    )
    run(config, available_now=True)

    got = {
        k: (v["window_end"], v["clicks"], v["last"])
        for k, v in results(kafka_bootstrap, topics["out"]).items()
    }
    assert got == {
        ('"a"', BASE): (BASE + 14_000, 2, BASE + 4_000),
        ('"a"', BASE + 30_000): (BASE + 40_000, 1, BASE + 30_000),
        ('"b"', BASE + 2_000): (BASE + 12_000, 1, BASE + 2_000),
    }


def test_update_mode_emits_changed_windows_every_epoch(kafka_bootstrap, spark, topics, tmp_path):
    window = {
        "type": "tumbling",
        "size": "20s",
        "key": "user",
        "output_mode": "update",
        "aggregations": {"clicks": "count(*)"},
    }
    config = parse(pipeline(topics, tmp_path, kafka_bootstrap, window))
    produce(kafka_bootstrap, topics["in"], [(b"a", click("a", BASE + i), 0) for i in range(3)])
    run(config, available_now=True)
    produce(kafka_bootstrap, topics["in"], [(b"a", click("a", BASE + 10 + i), 0) for i in range(2)])
    run(config, available_now=True)

    updates = [json.loads(m.value()) for m in read_committed(kafka_bootstrap, topics["out"])]
    assert [(u["key"], u["window_start"], u["clicks"]) for u in updates] == [
        ("a", BASE, 3),
        ("a", BASE, 5),
    ]


def test_multi_field_keys_become_a_json_object(kafka_bootstrap, spark, topics, tmp_path):
    window = {
        "type": "tumbling",
        "size": "10s",
        "key": ["user", "url"],
        "aggregations": {"clicks": "count(*)", "avg_bytes": "avg(bytes)"},
    }
    config = parse(pipeline(topics, tmp_path, kafka_bootstrap, window))
    events = [("a", "/x", 10), ("a", "/x", 20), ("a", "/y", 5)]
    produce(
        kafka_bootstrap,
        topics["in"],
        [(b"k", click(u, BASE + 1, url, size), 0) for u, url, size in events]
        + [(b"z", click("z", BASE + 100_000), 0)],
    )
    run(config, available_now=True)

    records = {
        m.key(): json.loads(m.value()) for m in read_committed(kafka_bootstrap, topics["out"])
    }
    assert records == {
        b'{"user":"a","url":"/x"}': {
            "key": {"user": "a", "url": "/x"},
            "window_start": BASE,
            "window_end": BASE + 10_000,
            "clicks": 2,
            "avg_bytes": 15.0,
        },
        b'{"user":"a","url":"/y"}': {
            "key": {"user": "a", "url": "/y"},
            "window_start": BASE,
            "window_end": BASE + 10_000,
            "clicks": 1,
            "avg_bytes": 5.0,
        },
    }


CLICK_AVRO = {
    "type": "record",
    "name": "Click",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "bytes", "type": "long"},
        {"name": "ts", "type": "long"},
    ],
}
RESULT_AVRO = {
    "type": "record",
    "name": "WindowResult",
    "namespace": "dev.onceflow",
    "fields": [
        {"name": n, "type": ["null", t]}
        for n, t in (
            ("key", "string"),
            ("window_start", "long"),
            ("window_end", "long"),
            ("clicks", "long"),
            ("bytes", "long"),
        )
    ],
}


def test_avro_in_and_out(kafka_bootstrap, spark, topics, tmp_path):
    (tmp_path / "click.avsc").write_text(json.dumps(CLICK_AVRO))
    raw = pipeline(topics, tmp_path, kafka_bootstrap, TUMBLING_CLICKS)
    raw["source"].update(format="avro", schema_file="click.avsc")
    del raw["source"]["schema"]
    raw["sink"]["format"] = "avro"
    config = parse(raw, base_dir=tmp_path)

    def avro(record: dict) -> bytes:
        buffer = io.BytesIO()
        schemaless_writer(buffer, parse_schema(CLICK_AVRO), record)
        return buffer.getvalue()

    events = [{"user": "a", "bytes": 3, "ts": BASE + i} for i in range(4)]
    events.append({"user": "z", "bytes": 1, "ts": BASE + 100_000})
    produce(
        kafka_bootstrap,
        topics["in"],
        [(None, avro(e), 0) for e in events] + [(None, b"\xff\xff\xff", 0)],
    )
    run(config, available_now=True)

    schema = parse_schema(RESULT_AVRO)
    out = [
        schemaless_reader(io.BytesIO(m.value()), schema, None)
        for m in read_committed(kafka_bootstrap, topics["out"])
    ]
    assert out == [
        {"key": "a", "window_start": BASE, "window_end": BASE + 10_000, "clicks": 4, "bytes": 12}
    ]
    dead = read_committed(kafka_bootstrap, topics["dlq"])
    assert [m.value() for m in dead] == [b"\xff\xff\xff"]
    assert dict(dead[0].headers())["onceflow.error"].startswith(b"value is not Avro of schema")


def test_avro_timestamps_and_dates_are_event_times_and_a_time_no_timestamp_holds_a_dead_letter(
    kafka_bootstrap, spark, topics, tmp_path
):
    """Avro's timestamp-millis decoded to a datetime that its long's Arrow column refused:
    every epoch of such an input failed. A date is a DATE; an event time past year 9999 is a
    dead letter naming it, not a failed epoch."""
    clicks = {
        **CLICK_AVRO,
        "fields": [
            {"name": "user", "type": "string"},
            {"name": "bytes", "type": "long"},
            {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
            {"name": "day", "type": ["null", {"type": "int", "logicalType": "date"}]},
        ],
    }
    (tmp_path / "click.avsc").write_text(json.dumps(clicks))
    raw = pipeline(topics, tmp_path, kafka_bootstrap, TUMBLING_CLICKS)
    raw["source"].update(format="avro", schema_file="click.avsc")
    del raw["source"]["schema"]
    config = parse(raw, base_dir=tmp_path)

    def avro(record: dict) -> bytes:
        buffer = io.BytesIO()
        schemaless_writer(buffer, parse_schema(clicks), record)
        return buffer.getvalue()

    day = BASE // 86_400_000
    events = [{"user": "a", "bytes": 3, "ts": BASE + i, "day": day} for i in range(4)]
    events.append({"user": "far", "bytes": 1, "ts": 300_000_000_000_000, "day": None})
    events.append({"user": "z", "bytes": 1, "ts": BASE + 100_000, "day": day})
    produce(kafka_bootstrap, topics["in"], [(None, avro(e), 0) for e in events])
    run(config, available_now=True)

    out = [json.loads(m.value()) for m in read_committed(kafka_bootstrap, topics["out"])]
    assert out == [
        {"key": "a", "window_start": BASE, "window_end": BASE + 10_000, "clicks": 4, "bytes": 12}
    ]
    dead = read_committed(kafka_bootstrap, topics["dlq"])
    assert [m.value() for m in dead] == [avro(events[4])]
    assert dict(dead[0].headers())["onceflow.error"] == (
        b"event time field 'ts' is 300000000000000000 us after 1970, outside the years 1-9999 "
        b"of event times"
    )


def test_transform_with_keyed_state_keeps_running_totals(kafka_bootstrap, spark, topics, tmp_path):
    from onceflow import pipeline as builder

    raw = pipeline(topics, tmp_path, kafka_bootstrap)
    raw["transform"] = "examples.running_totals:running_totals"
    raw["checkpoint"]["interval"] = "200ms"
    config = parse(raw)

    def totals() -> dict[str, int]:
        final = {}
        for m in read_committed(kafka_bootstrap, topics["out"]):
            value = json.loads(m.value())
            final[value["user"]] = value["total_bytes"]
        return final

    # State TTL needs processing-time mode, whose timers keep Trigger.AvailableNow from ever
    # finishing (Spark 4.3), so this pipeline runs continuously, as in production.
    first = [("a", 10), ("b", 5), ("a", 7)]
    produce(
        kafka_bootstrap, topics["in"], [(u.encode(), click(u, BASE, size=n), 0) for u, n in first]
    )
    query = builder.start(spark, config)
    wait_until(lambda: totals() == {"a": 17, "b": 5}, what="the first running totals")
    query.stop()
    produce(kafka_bootstrap, topics["in"], [(b"a", click("a", BASE, size=100), 0)])
    query = builder.start(spark, config)  # the state survives the restart
    try:
        wait_until(lambda: totals() == {"a": 117, "b": 5}, what="totals after the restart")
    finally:
        query.stop()


def service(path: Path, **env: str) -> subprocess.Popen:
    """`onceflow run path` as a process of its own, its output kept, with `env` added."""
    return subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "run", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def cli(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"source": {"topicz": ["x"]}}, "source.topicz: unknown field (did you mean 'topics'?)"),
        ({"window": {"size": "ten seconds"}}, "window.size: 'ten seconds' is not a duration"),
        ({"sink": {"topic": None}}, "sink.topic: is required"),
        ({"window": {"key": "usr"}}, "window.key: field 'usr' is not in the input schema"),
    ],
)
def test_config_errors_exit_2_naming_the_field(tmp_path, change, message):
    raw = {
        "app_id": "bad",
        "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "source": {"topics": ["in"], "schema": SCHEMA},
        "window": {
            "type": "tumbling",
            "size": "10s",
            "key": "user",
            "aggregations": {"n": "count(*)"},
        },
        "sink": {"topic": "out"},
        "checkpoint": {"location": "ck"},
    }
    for section, values in change.items():
        raw[section].update(values)
        raw[section] = {k: v for k, v in raw[section].items() if v is not None}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    for command in ("validate", "run"):
        result = cli(command, str(path))
        assert result.returncode == 2, result.stderr
        assert message in result.stderr


def test_a_missing_input_topic_is_a_clear_runtime_error(kafka_bootstrap, tmp_path):
    raw = {
        "app_id": "nosuch",
        "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": ["no-such-topic-at-all"], "format": "raw"},
        "sink": {"topic": "out"},
        "checkpoint": {"location": str(tmp_path / "ck")},
        "spark": {"master": "local[1]"},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = cli("run", "--available-now", str(path))
    assert result.returncode == 1
    # One line says what happened and what to do: the last one.
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "onceflow: OptionError: option 'subscribe': topic(s) no-such-topic-at-all do not exist"
    ), result.stderr[-3000:]


def test_verify_exits_4_with_a_json_report_when_a_record_is_published_twice(
    kafka_bootstrap, new_topic, tmp_path
):
    from confluent_kafka import Producer

    source, out = new_topic(prefix="in"), new_topic(prefix="out")
    produce(kafka_bootstrap, source, ((None, f"v{i}".encode(), 0) for i in range(3)))
    path = tmp_path / "pipeline.yaml"
    raw = {
        "app_id": "verified",
        "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [source], "format": "raw"},
        "sink": {"topic": out},
        "checkpoint": {"location": str(tmp_path / "ck")},
    }
    path.write_text(yaml.safe_dump(raw))

    def publish(offsets: list[int]) -> None:
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for i in offsets:
            headers = [("onceflow.source", f"{source}/0/{i}".encode())]
            producer.produce(out, value=f"v{i}".encode(), headers=headers)
        assert producer.flush(30) == 0

    publish([0, 1, 2])
    result = cli("verify", "--json", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["ok"] is True

    publish([1])  # offset 1 published a second time
    result = cli("verify", "--json", str(path))
    assert result.returncode == 4, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["duplicates"] == [f"{source}/0/1 x2"]


def test_the_sinks_lines_reach_the_service_log_in_its_format(kafka_bootstrap, topics, tmp_path):
    """The sink commits in a Python process that Spark starts, not in the driver: its lines
    (its last marker, a replay skipped, a stalled commit) must reach the service's log at the
    service's level and in its format (here one JSON object per line), not be dropped (INFO)
    or come as bare text (WARNING)."""
    produce(kafka_bootstrap, topics["in"], ((None, f"v{i}".encode(), 0) for i in range(3)))
    path = raw_pipeline(topics, tmp_path, kafka_bootstrap)
    json_logs = {**os.environ, "ONCEFLOW_LOG_FORMAT": "json", "ONCEFLOW_LOG_LEVEL": "info"}
    result = cli("run", "--available-now", str(path), env=json_logs)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = []
    for line in result.stderr.splitlines():
        with contextlib.suppress(ValueError):  # Spark's own lines, not JSON
            lines.append(json.loads(line))
    sink = [
        line for line in lines if isinstance(line, dict) and line.get("logger") == "onceflow.sink"
    ]
    ready = [line for line in sink if "ready; last published batch" in line["message"]]
    assert ready, result.stderr[-3000:]


def _spark_python_workers(service: int) -> set[int]:
    """The workers of the service's Python daemons: the fork server's grandchildren."""
    seen = processes()
    server = {
        pid
        for pid, (parent, command) in seen.items()
        if parent == service and b"onceflow.forkserver" in b" ".join(command)
    }
    daemons = {pid for pid, (parent, _) in seen.items() if parent in server}
    return {pid for pid, (parent, _) in seen.items() if parent in daemons}


def _fork_server_directory(service: int) -> Path:
    """Where the service's fork server, and Spark's Unix sockets, are."""
    for parent, command in processes().values():
        if parent == service and b"--serve" in command:
            return Path(command[command.index(b"--serve") + 1].decode()).parent
    raise AssertionError("the service runs no fork server")


def test_an_idle_pipeline_whose_workers_spark_closes_logs_no_traceback(
    kafka_bootstrap, topics, tmp_path
):
    """Spark closes the Python workers it kept idle after a minute without work. Over Unix
    sockets each such worker's last write failed at once (BrokenPipeError), and pyspark's
    daemon printed its traceback into the service's log, every minute of quiet."""
    path = raw_pipeline(topics, tmp_path, kafka_bootstrap)
    values = [b"v%d" % i for i in range(6)]
    produce(kafka_bootstrap, topics["in"], [(None, v, i % 2) for i, v in enumerate(values)])
    run = service(path)
    try:
        wait_until(
            lambda: len(read_committed(kafka_bootstrap, topics["out"])) >= len(values),
            180,
            "the output",
        )
        workers = _spark_python_workers(run.pid)
        assert workers, "no Python worker of Spark's found under the fork server"
        assert list(_fork_server_directory(run.pid).glob(".*.sock")), "no Unix socket of Spark's"
        # Spark's idle-worker monitor closes them 60-70 s after the last task.
        wait_until(
            lambda: not workers & _spark_python_workers(run.pid),
            150,
            "Spark to close its idle Python workers",
        )
    finally:
        run.terminate()
        _, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    published = Counter(m.value() for m in read_committed(kafka_bootstrap, topics["out"]))
    assert published == Counter(values)


def test_an_unreachable_broker_ends_in_one_line_naming_the_address_and_the_cause(tmp_path):
    """No wall of librdkafka lines and stack traces: the last line says what failed and what
    to check, after ONCEFLOW_KAFKA_TIMEOUT."""
    raw = {
        "app_id": "unreachable",
        "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "source": {"topics": ["in"], "format": "raw"},
        "sink": {"topic": "out"},
        "checkpoint": {"location": str(tmp_path / "ck")},
        "spark": {"master": "local[1]"},
        "metrics": {"port": 0},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "run", "--available-now", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ONCEFLOW_KAFKA_TIMEOUT": "5"},
    )
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "onceflow: KafkaUnreachableError: Kafka at 127.0.0.1:1 did not answer within 5s"
    ), result.stderr[-3000:]
    assert "Connection refused" in last, last
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(result.stderr.splitlines()) < 30, result.stderr[-3000:]


def test_a_broker_that_stops_mid_run_ends_the_run_in_one_line(tmp_path):
    """The broker goes away under a running pipeline (its own broker, stopped cleanly after
    the first epoch is published): one line naming the address and the cause, exit 1."""
    with own_broker() as broker:
        for name in ("in", "out"):
            create_topic(broker.bootstrap, name, partitions=1)
        path = tmp_path / "pipeline.yaml"
        raw = {
            "app_id": "broker-stops",
            "kafka": {"bootstrap_servers": broker.bootstrap},
            "source": {"topics": ["in"], "format": "raw", "starting_offsets": "earliest"},
            "sink": {"topic": "out"},
            "checkpoint": {"location": str(tmp_path / "ck")},
            "spark": {"master": "local[1]"},
            "metrics": {"port": 0},
        }
        path.write_text(yaml.safe_dump(raw))
        produce(broker.bootstrap, "in", [(None, b"v%d" % i, 0) for i in range(10)])
        run = service(path, ONCEFLOW_KAFKA_TIMEOUT="10")

        def published() -> bool:
            assert run.poll() is None, "the run ended before the broker stopped"
            return len(read_committed(broker.bootstrap, "out")) == 10

        try:
            wait_until(published, timeout=180, what="the first epoch's output")
        except AssertionError as exc:
            run.kill()
            raise AssertionError(f"{exc}: {run.communicate()[1][-3000:]}") from None
        broker.stop(progress=lambda line: None)
        _, stderr = run.communicate(timeout=300)
    assert run.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"onceflow: KafkaUnreachableError: Kafka at {broker.bootstrap} did not answer within 10s"
    ), stderr[-3000:]
    assert "Connection refused" in last, last
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(stderr.splitlines()) < 40, stderr[-3000:]


def late_source_worker(tmp_path, times: int) -> Path:
    """A python for Spark that sleeps 12 s before the first `times` starts of the process
    behind a Python source: past the 10 s Spark gives it to connect back."""
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = pyspark.sql.streaming.python_streaming_source_runner ] && '
        f"[ $(ls {tmp_path} | grep -c late-) -lt {times} ] && mktemp -p {tmp_path} late-XXXX "
        ">/dev/null; then sleep 12; fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return python


def raw_pipeline(topics, tmp_path, bootstrap: str, **metrics) -> Path:
    raw = pipeline(topics, tmp_path, bootstrap)
    raw["source"]["format"] = "raw"
    raw.pop("event_time")
    raw["sink"].pop("late_topic")
    raw["metrics"] = metrics
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_source_worker_that_misses_sparks_deadline_is_started_again(
    kafka_bootstrap, topics, tmp_path
):
    """Spark gives the Python process behind a Python source 10 s to connect back; a start
    that misses them (a machine short of CPU, made here by a python that sleeps 12 s the
    first time) is started again: the run is exactly once and its health is ok."""
    port = free_port()
    path = raw_pipeline(topics, tmp_path, kafka_bootstrap, port=port)
    values = [b"v%d" % i for i in range(20)]
    produce(kafka_bootstrap, topics["in"], [(None, v, i % 2) for i, v in enumerate(values)])
    run = service(path, PYSPARK_PYTHON=str(late_source_worker(tmp_path, times=1)))

    def published() -> bool:
        assert run.poll() is None, "the run ended"
        return len(read_committed(kafka_bootstrap, topics["out"])) >= len(values)

    try:
        wait_until(published, 180, "the output after the second start")
        wait_until(lambda: health(port) == 200, 60, "/healthz 200 after the second start")
    finally:
        run.terminate()
        _, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-3000:]
    assert "within Spark's 10 s (start 1 of 3); starting the query again" in stderr
    published = Counter(m.value() for m in read_committed(kafka_bootstrap, topics["out"]))
    assert published == Counter(values)


def test_a_source_worker_late_at_every_start_ends_the_run_saying_so(
    kafka_bootstrap, topics, tmp_path
):
    path = raw_pipeline(topics, tmp_path, kafka_bootstrap)
    produce(kafka_bootstrap, topics["in"], [(None, b"v", 0)])
    run = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "run", str(path), "--available-now"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYSPARK_PYTHON": str(late_source_worker(tmp_path, times=3))},
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "onceflow: Spark's Python source worker did not connect back within "
        "Spark's 10 s (3 of 3 starts): the machine is short of CPU; give the service more "
        "cores or run less beside it, then start it again"
    )
    assert read_committed(kafka_bootstrap, topics["out"]) == []


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_a_start_that_fails_after_taking_the_lease_leaves_the_checkpoint_free(
    kafka_bootstrap, spark, topics, tmp_path
):
    """A caller in this process (the pytest plugin, a notebook) lives on after a failed start:
    the checkpoint's lease, and its lock, must not stay with it, nor a listener on its
    session."""
    import socket

    from onceflow.config import ConfigError
    from onceflow.connectors.checkpoint import CheckpointDir
    from onceflow.lease import Lease

    listeners = len(spark.streams._jsqm.listListeners())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        raw = pipeline(topics, tmp_path, kafka_bootstrap)
        raw["metrics"] = {"port": busy.getsockname()[1]}
        config = parse(raw)
        with pytest.raises(ConfigError, match="metrics.port"):
            run(config, available_now=True)
    # Nor its query listener: the session's later queries would feed a dead run's metrics.
    assert len(spark.streams._jsqm.listListeners()) == listeners
    lease = Lease(CheckpointDir(config.checkpoint_location), config.app_id)
    lease.acquire()  # refused while the failed start still holds it
    lease.release()
