"""The marker read at start-up: what finding a sink's last marker costs as history grows.

    .venv/bin/python -m bench.markers

A sink's marker topic is filled with N past epochs' markers (in transactions of up to 1,000
markers; the last epochs one marker per transaction, as a sink writes them, then one aborted
attempt), and `markers.last_marker` is timed (median of 5 reads, each with fresh clients, as
at a restart). For comparison, the read before per-sink topics: every committed record of the
topic, filtered by key (`topics.read_committed`). Writes bench/results/markers.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import uuid
from datetime import datetime
from pathlib import Path

from confluent_kafka import Producer

from onceflow.connectors.markers import Marker, ensure_marker_topic, last_marker
from onceflow.connectors.topics import read_committed
from onceflow.local_kafka import LocalKafka

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
SINK = "onceflow-bench-sink"
PER_TRANSACTION = 1_000
READS = 5


def fill(conf: dict, topic: str, epochs: int) -> None:
    """Markers of epochs 0..epochs-1 for SINK, the last one committed, then an aborted one."""
    producer = Producer({**conf, "transactional.id": f"bench-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    batch_id, started = 0, time.monotonic()
    while batch_id < epochs:
        # The last 10 epochs one per transaction, as a sink writes them.
        size = 1 if epochs - batch_id <= 10 else min(PER_TRANSACTION, epochs - batch_id - 10)
        producer.begin_transaction()
        for _ in range(size):
            producer.produce(topic, Marker(SINK, batch_id, "q", 1).encode(), SINK.encode())
            batch_id += 1
        producer.commit_transaction(60)
        if batch_id % 100_000 < size:
            print(f"  {topic}: {batch_id:,} of {epochs:,} markers written", flush=True)
    producer.begin_transaction()
    producer.produce(topic, Marker(SINK, epochs, "q", 1).encode(), SINK.encode())
    producer.abort_transaction(30)
    print(f"  {topic}: {epochs:,} markers in {time.monotonic() - started:.1f} s", flush=True)


def timed(read) -> dict:
    seconds = []
    for _ in range(READS):
        began = time.monotonic()
        marker = read()
        seconds.append(time.monotonic() - began)
    return {
        "median_ms": round(statistics.median(seconds) * 1000, 1),
        "min_ms": round(min(seconds) * 1000, 1),
        "max_ms": round(max(seconds) * 1000, 1),
        "batch_id": marker.batch_id,
    }


def read_whole_topic(conf: dict, topic: str) -> Marker:
    """The read before per-sink topics: every committed record, the key's last one kept."""
    mine = [m for m in read_committed(conf, topic, timeout=600) if m.key() == SINK.encode()]
    return Marker.decode(mine[-1].value())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 10_000, 1_000_000])
    args = parser.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or LocalKafka.from_env().start()
    conf = {"bootstrap.servers": bootstrap}
    rows = []
    for epochs in args.epochs:
        topic = f"onceflow.commits.bench-{epochs}-{uuid.uuid4().hex[:8]}"
        ensure_marker_topic(conf, topic)
        fill(conf, topic, epochs)
        from_end = timed(lambda topic=topic: last_marker(conf, topic, SINK, 30))
        whole = timed(lambda topic=topic: read_whole_topic(conf, topic))
        assert from_end["batch_id"] == whole["batch_id"] == epochs - 1
        rows.append({"epochs": epochs, "from_end": from_end, "whole_topic": whole})
        print(f"  {epochs:,} epochs: from the end {from_end}, whole topic {whole}", flush=True)
    results = {
        "date": datetime.now().strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python "
        f"{platform.python_version()}",
        "reads": READS,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "markers.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "# Finding a sink's last marker",
        "",
        f"{results['date']}, {results['machine']}, local broker. `python -m bench.markers`: "
        f"median (min-max) of {READS} reads, each with fresh clients as at a restart.",
        "",
        "| past epochs in the topic | from the end (`markers.last_marker`) | whole topic "
        "(before per-sink topics) |",
        "|---|---|---|",
    ]
    for row in rows:
        end, whole = row["from_end"], row["whole_topic"]
        lines.append(
            f"| {row['epochs']:,} | {end['median_ms']:,} ms ({end['min_ms']:,}-{end['max_ms']:,}) "
            f"| {whole['median_ms']:,} ms ({whole['min_ms']:,}-{whole['max_ms']:,}) |"
        )
    text = "\n".join(lines) + "\n"
    (RESULTS / "markers.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
