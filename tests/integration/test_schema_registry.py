"""Avro in the Confluent wire format against a real schema registry: producers that evolve
their schema mid-stream, and frames that cannot be read, which end in the dead-letter topic.

The producers are Confluent's own `AvroSerializer` with its `SchemaRegistryClient`, so what
is read here is what users' producers write.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from onceflow.config import parse
from onceflow.connectors import registry
from onceflow.connectors.topics import read_committed
from onceflow.runner import run
from tests.helpers import free_port, produce

pytestmark = pytest.mark.integration
BASE = 1_700_000_000_000
CLICK_V1 = {
    "type": "record",
    "name": "Click",
    "namespace": "dev.onceflow.test",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "bytes", "type": "long"},
        {"name": "ts", "type": "long"},
    ],
}
# v2 adds a field with a default: BACKWARD compatible, so the registry takes it.
PAGE = {"name": "page", "type": "string", "default": "/"}
CLICK_V2 = {**CLICK_V1, "fields": [*CLICK_V1["fields"], PAGE]}


def confluent_serializer(url: str, schema: dict):
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    client = SchemaRegistryClient({"url": url, "timeout": 10})
    serializer = AvroSerializer(client, json.dumps(schema))

    def serialize(topic: str, record: dict) -> bytes:
        return serializer(record, SerializationContext(topic, MessageField.VALUE))

    return serialize


@pytest.fixture
def topics(new_topic):
    return {name: new_topic(partitions=2, prefix=name) for name in ("in", "out", "dlq", "late")}


def pipeline_file(topics, tmp_path, bootstrap: str, url: str):
    (tmp_path / "click.avsc").write_text(json.dumps(CLICK_V1))  # the reader schema: v1
    raw = {
        "app_id": f"test-{topics['in']}",
        "kafka": {"bootstrap_servers": bootstrap},
        "registry": {"url": url},
        "source": {
            "topics": [topics["in"]],
            "starting_offsets": "earliest",
            "format": "avro-confluent",
            "schema_file": "click.avsc",
        },
        "event_time": {"field": "ts", "watermark_delay": "5s"},
        "window": {
            "type": "tumbling",
            "size": "10s",
            "key": "user",
            "aggregations": {"clicks": "count(*)", "bytes": "sum(bytes)"},
        },
        "sink": {
            "topic": topics["out"],
            "dead_letter_topic": topics["dlq"],
            "late_topic": topics["late"],
        },
        "checkpoint": {"location": str(tmp_path / "ck")},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_producers_that_switch_schema_mid_stream_are_read_exactly_once(
    kafka_bootstrap, spark, schema_registry, topics, tmp_path
):
    path = pipeline_file(topics, tmp_path, kafka_bootstrap, schema_registry)
    v1 = confluent_serializer(schema_registry, CLICK_V1)
    v2 = confluent_serializer(schema_registry, CLICK_V2)
    clicks = [(f"u{i % 3}", BASE + i * 97, i % 7) for i in range(300)]
    values = [
        (v1 if i < 150 else v2)(topics["in"], {"user": u, "bytes": b, "ts": ts, "page": "/p"})
        for i, (u, ts, b) in enumerate(clicks)
    ]
    writer_ids = Counter(registry.unframe(v)[0] for v in values)
    assert len(writer_ids) == 2, f"both schemas must be in use: {writer_ids}"
    unknown_id = max(writer_ids) + 1000
    bad = [
        json.dumps({"user": "u1", "bytes": 1, "ts": BASE}).encode(),  # not framed
        registry.frame(unknown_id, values[0][5:]),  # an id the registry never gave
        values[1][:6],  # a known id, the body cut short
    ]
    closer = v2(topics["in"], {"user": "z", "bytes": 0, "ts": BASE + 1_000_000, "page": "/"})
    produce(
        kafka_bootstrap,
        topics["in"],
        [(clicks[i][0].encode(), v, i % 2) for i, v in enumerate(values)]
        + [(b"bad", v, 0) for v in bad]
        + [(b"z", closer, 1)],
    )
    run(parse(yaml.safe_load(path.read_text()), base_dir=tmp_path), available_now=True)

    expected: Counter = Counter()
    for user, ts, size in clicks:
        start = BASE + (ts - BASE) // 10_000 * 10_000
        expected[(user, start, "clicks")] += 1
        expected[(user, start, "bytes")] += size
    published = [json.loads(m.value()) for m in read_committed(kafka_bootstrap, topics["out"])]
    windows = Counter((r["key"], r["window_start"]) for r in published)
    assert [w for w, n in windows.items() if n > 1] == [], "a window was published twice"
    got = Counter()
    for r in published:
        got[(r["key"], r["window_start"], "clicks")] += r["clicks"]
        got[(r["key"], r["window_start"], "bytes")] += r["bytes"]
    assert got == expected

    dead = read_committed(kafka_bootstrap, topics["dlq"])
    assert Counter(m.value() for m in dead) == Counter(bad)
    reasons = {m.value(): dict(m.headers())["onceflow.error"].decode() for m in dead}
    assert "not in the Confluent wire format: it starts with 0x7b" in reasons[bad[0]]
    assert f"schema id {unknown_id} is not in the registry at" in reasons[bad[1]]
    assert reasons[bad[2]].startswith("value is not Avro of writer schema id")

    # verify reads the same frames through the registry, independently of the query.
    done = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "verify", "--json", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def confluent_reader(url: str):
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer

    client = SchemaRegistryClient({"url": url, "timeout": 10})
    return client, AvroDeserializer(client)


def test_results_are_published_in_the_wire_format_under_the_topics_subject(
    kafka_bootstrap, spark, schema_registry, topics, tmp_path
):
    path = pipeline_file(topics, tmp_path, kafka_bootstrap, schema_registry)
    raw = yaml.safe_load(path.read_text())
    raw["sink"]["format"] = "avro-confluent"
    v1 = confluent_serializer(schema_registry, CLICK_V1)
    clicks = [("a", BASE + i, 3) for i in range(4)] + [("b", BASE + 10_500, 5)]
    clicks.append(("z", BASE + 1_000_000, 1))  # closes the other windows
    produce(
        kafka_bootstrap,
        topics["in"],
        [
            (u.encode(), v1(topics["in"], {"user": u, "bytes": b, "ts": ts}), 0)
            for u, ts, b in clicks
        ],
    )
    run(parse(raw, base_dir=tmp_path), available_now=True)

    client, deserializer = confluent_reader(schema_registry)
    from confluent_kafka.serialization import MessageField, SerializationContext

    context = SerializationContext(topics["out"], MessageField.VALUE)
    out = [deserializer(m.value(), context) for m in read_committed(kafka_bootstrap, topics["out"])]
    assert Counter(json.dumps(r, sort_keys=True) for r in out) == Counter(
        json.dumps(r, sort_keys=True)
        for r in (
            {
                "key": "a",
                "window_start": BASE,
                "window_end": BASE + 10_000,
                "clicks": 4,
                "bytes": 12,
            },
            {
                "key": "b",
                "window_start": BASE + 10_000,
                "window_end": BASE + 20_000,
                "clicks": 1,
                "bytes": 5,
            },
        )
    )
    latest = client.get_latest_version(f"{topics['out']}-value")
    assert {
        registry.unframe(m.value())[0] for m in read_committed(kafka_bootstrap, topics["out"])
    } == {latest.schema_id}


def test_an_incompatible_result_schema_stops_the_run_before_anything_is_produced(
    kafka_bootstrap, schema_registry, topics, tmp_path
):
    from confluent_kafka import Consumer
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    # The subject already holds results whose `clicks` are text: the pipeline's (a long)
    # cannot read them, so BACKWARD compatibility refuses its schema.
    taken = {
        "type": "record",
        "name": "WindowResult",
        "namespace": "dev.onceflow",
        "fields": [{"name": "clicks", "type": "string"}],
    }
    subject = f"{topics['out']}-value"
    client = SchemaRegistryClient({"url": schema_registry, "timeout": 10})
    client.register_schema(subject, Schema(json.dumps(taken), "AVRO"))
    path = pipeline_file(topics, tmp_path, kafka_bootstrap, schema_registry)
    raw = yaml.safe_load(path.read_text())
    raw["sink"]["format"] = "avro-confluent"
    path.write_text(yaml.safe_dump(raw))
    v1 = confluent_serializer(schema_registry, CLICK_V1)
    produce(
        kafka_bootstrap,
        topics["in"],
        [(b"a", v1(topics["in"], {"user": "a", "bytes": 1, "ts": BASE}), 0)],
    )

    done = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "run", "--available-now", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("onceflow: the schema registry at "), last
    assert f"refused registering a schema under '{subject}': HTTP 409" in last
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "watermarks"})
    try:
        from confluent_kafka import TopicPartition

        ends = [consumer.get_watermark_offsets(TopicPartition(topics["out"], p))[1] for p in (0, 1)]
    finally:
        consumer.close()
    assert ends == [0, 0], "nothing may be produced, not even an aborted transaction"


def test_the_local_registry_keeps_its_schema_ids_across_a_restart(kafka_bootstrap, tmp_path):
    """Its schemas are in Kafka: ids keep their meaning as long as the records that carry them."""
    from onceflow.local_registry import LocalRegistry

    local = dataclasses.replace(LocalRegistry.from_env(), kafka_bootstrap=kafka_bootstrap)
    local = dataclasses.replace(local, port=free_port())
    subject = f"restart-{tmp_path.name}-value"
    try:
        client = registry.RegistryClient(registry.RegistrySettings(url=local.start()))
        schema_id = client.register(subject, CLICK_V1)
        assert local.stop()
        registry.RegistryClient._by_id.clear()  # ask the restarted registry, not the cache
        client = registry.RegistryClient(registry.RegistrySettings(url=local.start()))
        assert client.schema_by_id(schema_id) == [CLICK_V1]
        assert client.latest(subject) == (schema_id, CLICK_V1)
    finally:
        local.stop()


def test_a_producer_that_registers_the_same_fields_in_another_order_is_read_right(
    schema_registry, new_topic
):
    """Each field order is its own schema with its own id: a registry that handed the second
    producer the first order's id (Apicurio's canonical hashing sorts fields by name) would
    have its bodies decoded field by field in the wrong order."""
    from onceflow.connectors.registry import RegistrySettings
    from onceflow.formats import decode_avro

    topic = new_topic(prefix="order")
    fields = CLICK_V1["fields"]
    reordered = {**CLICK_V1, "fields": [fields[2], fields[0], fields[1]]}  # ts, user, bytes
    first = confluent_serializer(schema_registry, CLICK_V1)(
        topic, {"user": "a", "bytes": 1, "ts": BASE}
    )
    second = confluent_serializer(schema_registry, reordered)(
        topic, {"user": "b", "bytes": 2, "ts": BASE + 1}
    )
    decoded, reasons = decode_avro(
        json.dumps(CLICK_V1),
        ("user", "bytes", "ts"),
        [first, second],
        RegistrySettings(url=schema_registry),
    )
    assert reasons == [None, None]
    assert [decoded[f].to_pylist() for f in ("user", "bytes", "ts")] == [
        ["a", "b"],
        [1, 2],
        [BASE, BASE + 1],
    ]
