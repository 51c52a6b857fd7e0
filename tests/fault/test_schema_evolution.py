"""Exactly-once while producers move to an evolved schema, under SIGKILL: Avro in the
Confluent wire format from Confluent's own AvroSerializer, read through a real registry.

Half the clicks are written with v1 before the service starts; the other half with v2 (a
field added with a default) while the first run is going, and each run is killed at a random
moment after its first committed epoch. The drained output must hold every window once with
exactly its count, and no record may end in the dead-letter topic.
"""

from __future__ import annotations

import json

import pytest

from onceflow.connectors.topics import read_committed
from tests.fault.test_faults import BASE, FLUSH_TS, USERS, Scenario, kill_each_run_at_random
from tests.helpers import produce, wait_until

pytestmark = pytest.mark.fault
CLICK_V1 = {
    "type": "record",
    "name": "Click",
    "namespace": "dev.onceflow.fault",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "bytes", "type": "long"},
        {"name": "ts", "type": "long"},
    ],
}
CLICK_V2 = {
    **CLICK_V1,
    "fields": [*CLICK_V1["fields"], {"name": "page", "type": "string", "default": "/"}],
}


def serializer(url: str, schema: dict, topic: str):
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    client = SchemaRegistryClient({"url": url, "timeout": 10})
    write = AvroSerializer(client, json.dumps(schema))
    context = SerializationContext(topic, MessageField.VALUE)
    return lambda record: write(record, context)


def test_producers_switch_schema_mid_run_under_random_sigkills(
    kafka_bootstrap, schema_registry, new_topic, tmp_path, request
):
    long = request.config.getoption("--long")
    kills = 6 if long else 2
    topics = {n: new_topic(partitions=3, prefix=n) for n in ("in", "out", "dlq", "late")}
    records = 100_000 if long else 10_000
    events = [(f"u{i % USERS}", BASE + i * 7) for i in range(records)]
    app = Scenario(kafka_bootstrap, topics, events, tmp_path, long)
    v1 = serializer(schema_registry, CLICK_V1, topics["in"])
    v2 = serializer(schema_registry, CLICK_V2, topics["in"])

    def write(with_schema, part) -> None:
        produce(
            kafka_bootstrap,
            topics["in"],
            (
                (u.encode(), with_schema({"user": u, "bytes": 100, "ts": ts, "page": "/p"}), i % 3)
                for i, (u, ts) in part
            ),
        )

    half = records // 2
    write(v1, enumerate(events[:half]))
    (tmp_path / "click.avsc").write_text(json.dumps(CLICK_V1))
    pipeline = app.pipeline(
        windowed=True,
        source={
            "format": "avro-confluent",
            "schema_file": str(tmp_path / "click.avsc"),
            "max_records_per_batch": records // (kills * 4),
        },
        registry={"url": schema_registry},
    )

    checkpoint = tmp_path / "checkpoint"
    # The v2 records, a part per run: each run has records to commit an epoch of, however
    # far the run before it read before its kill.
    share = (records - half) // kills
    parts = [range(half + run * share, half + (run + 1) * share) for run in range(kills)]
    parts[-1] = range(parts[-1].start, records)

    def switch_to_v2(run: int) -> None:
        """The producers move on while the first run reads v1, and that run commits an epoch
        with v2 records before its kill (the same process meets the new id)."""
        if run == 0:
            write(v2, ((i, events[i]) for i in parts[0]))
            wait_until(lambda: _committed_through(checkpoint) > half, 120, "a v2 epoch")

    def more_v2(run: int) -> None:
        if run > 0:
            write(v2, ((i, events[i]) for i in parts[run]))

    kill_each_run_at_random(
        app, pipeline, kills, 20261125, after_first_epoch=switch_to_v2, before_run=more_v2
    )
    write(v2, [(0, ("u0", FLUSH_TS))])  # moves the watermark past every window of `events`
    app.drain(pipeline)
    app.check_windows()
    assert read_committed(kafka_bootstrap, topics["dlq"]) == []


def _committed_through(checkpoint) -> int:
    """Input records up to the end of the newest epoch in Spark's commit log."""
    commits = [int(p.name) for p in checkpoint.glob("commits/[0-9]*")]
    if not commits:
        return 0
    offsets = (checkpoint / "offsets" / str(max(commits))).read_text().splitlines()[-1]
    ranges = json.loads(offsets)
    return sum(sum(ends.values()) for topic, ends in ranges.items() if not topic.startswith("@"))
