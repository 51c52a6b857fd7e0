"""Recovery as operators meet it, driven through `onceflow run --available-now`: a checkpoint
restored from an older copy, and side records staged by another plan of a batch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from onceflow.config import load, parse
from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.connectors.records import side_record
from onceflow.connectors.topics import read_committed
from onceflow.runner import run
from tests.helpers import produce

pytestmark = pytest.mark.integration


def write_pipeline(path, topics: dict, bootstrap: str, checkpoint, batch: int) -> str:
    config = {
        "app_id": f"recovery-{topics['in']}",
        "kafka": {"bootstrap_servers": bootstrap},
        "source": {
            "topics": [topics["in"]],
            "starting_offsets": "earliest",
            "format": "raw",
            "max_records_per_batch": batch,
        },
        "sink": {"topic": topics["out"]},
        "checkpoint": {"location": str(checkpoint)},
        "spark": {"master": "local[2]"},
        "metrics": {"port": 0},
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


def run_cli(pipeline: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "run", "--available-now", pipeline],
        capture_output=True,
        text=True,
        timeout=300,
    )


def values(bootstrap: str, topic: str) -> Counter:
    return Counter(m.value() for m in read_committed(bootstrap, topic))


def test_a_checkpoint_restored_from_an_older_copy_is_refused_not_skipped(
    kafka_bootstrap, spark, new_topic, tmp_path
):
    topics = {name: new_topic(partitions=1, prefix=name) for name in ("in", "out")}
    checkpoint, snapshot = tmp_path / "ck", tmp_path / "snapshot"
    records = [f"r{i}".encode() for i in range(3000)]
    by_500 = write_pipeline(tmp_path / "a.yaml", topics, kafka_bootstrap, checkpoint, 500)

    produce(kafka_bootstrap, topics["in"], ((None, v, 0) for v in records[:1000]))
    # Each run's first epochs take a 16th and a quarter of the limit: batches 0-3 of 31, 125,
    # 500 and 344 records.
    run(load(by_500), available_now=True)  # in this process: faster
    shutil.copytree(checkpoint, snapshot)  # the backup
    produce(kafka_bootstrap, topics["in"], ((None, v, 0) for v in records[1000:2500]))
    run(load(by_500), available_now=True)  # batches 4-8: the marker says batch 8
    assert values(kafka_bootstrap, topics["out"]) == Counter(records[:2500])

    # The host is restored from the backup, the app retuned, and more input arrives.
    shutil.rmtree(checkpoint)
    shutil.copytree(snapshot, checkpoint)
    produce(kafka_bootstrap, topics["in"], ((None, v, 0) for v in records[2500:]))
    by_1000 = write_pipeline(tmp_path / "b.yaml", topics, kafka_bootstrap, checkpoint, 1000)
    restored = run_cli(by_1000)

    # Batch 4 is now [1000, 1062), then 250 and 1000 records: skipping them as replays (they
    # are at or below batch 8, the marker's) would lose 2500..2999.
    assert restored.returncode == 1, restored.stderr[-3000:]
    assert "CheckpointMismatchError: batch 4, planned with source offsets" in restored.stderr
    assert "is below batch 8" in restored.stderr
    assert "restored from an older copy" in restored.stderr
    assert values(kafka_bootstrap, topics["out"]) == Counter(records[:2500])


def test_side_records_staged_by_another_plan_of_the_batch_are_never_published(
    kafka_bootstrap, spark, new_topic, tmp_path
):
    topics = {name: new_topic(partitions=1, prefix=name) for name in ("in", "out", "dlq")}
    config = {
        "app_id": f"stale-{topics['in']}",
        "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {
            "topics": [topics["in"]],
            "starting_offsets": "earliest",
            "format": "json",
            "schema": "user STRING",
        },
        "sink": {"topic": topics["out"], "dead_letter_topic": topics["dlq"]},
        "checkpoint": {"location": str(tmp_path / "ck")},
    }
    # Files that an earlier plan of batch 0 staged (a checkpoint restored from an older copy,
    # whose tasks were split differently): in the layout before plan fingerprints, and in
    # another plan's directory.
    import pyarrow as pa

    from onceflow.connectors.records import staged_schema

    stale = side_record(topics["dlq"], None, b"stale", [], f"{topics['in']}/0/99", "stale")
    staging = CheckpointDir(tmp_path / "ck").staging_root() / "0"
    for directory in (staging, staging / "0123456789abcdef"):
        directory.mkdir(parents=True)
        table = pa.Table.from_pylist([stale], schema=staged_schema(pa))
        path = str(directory / "part-00007.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    good = [json.dumps({"user": f"u{i}"}).encode() for i in range(5)]
    produce(kafka_bootstrap, topics["in"], [(None, v, 0) for v in [*good, b"{bad"]])
    run(parse(config), available_now=True)

    assert values(kafka_bootstrap, topics["out"]) == Counter(good)
    assert values(kafka_bootstrap, topics["dlq"]) == Counter([b"{bad"])
