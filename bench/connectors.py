"""Connector benchmark: the source and the commit path next to plain confluent-kafka clients.

Runs on one machine, in one run, against the broker at KAFKA_BOOTSTRAP_SERVERS (default:
onceflow's local broker, started if needed):
- source: rows/s of `onceflow-kafka` -> noop (Trigger.AvailableNow, local[2], parallelism 2)
  and of a plain read_committed confluent-kafka consumer, on the same preloaded topic;
- commit path: records/s and MB/s of the sink's phase 2 (one Kafka transaction with marker)
  and of a plain transactional producer, on the same records.
Writes bench/results/connectors.json and connectors.md.

    .venv/bin/python -m bench.connectors [--records 500000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import uuid
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from onceflow.connectors.publisher import TransactionalPublisher
from onceflow.connectors.topics import create_topic
from onceflow.local_kafka import LocalKafka

RESULTS = Path(__file__).parent / "results"
VALUE = b'{"user":"user-3","url":"/pricing","bytes":1234,"ts":1700000000000}'  # 67 bytes


def preload(bootstrap: str, topic: str, records: int) -> None:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 2_000_000,
        }
    )
    for i in range(records):
        while True:
            try:
                producer.produce(topic, key=b"user-%d" % (i % 100), value=VALUE, partition=i % 3)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(120)


def plain_consumer(bootstrap: str, topic: str, records: int) -> float:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(3)])
    seen, t0 = 0, time.perf_counter()
    while seen < records:
        seen += sum(1 for m in consumer.consume(10_000, 1.0) if m.error() is None)
    elapsed = time.perf_counter() - t0
    consumer.close()
    return records / elapsed


def source_to_noop(bootstrap: str, topic: str, records: int, tmp: Path) -> float:
    from onceflow.spark_session import build_session

    spark = build_session("local[2]", "bench-source")
    df = (
        spark.readStream.format("onceflow-kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("parallelism", "2")  # as an onceflow pipeline on local[2] reads
        .load()
    )
    t0 = time.perf_counter()
    query = (
        df.writeStream.format("noop")
        .option("checkpointLocation", str(tmp / "ck-noop"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    elapsed = time.perf_counter() - t0
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    assert rows == records, f"read {rows} rows, expected {records}"
    return records / elapsed


def commit_path(bootstrap: str, records: int) -> tuple[float, float]:
    out = f"bench-out-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, out, 3)
    batch = [(out, None, b"user-%d" % (i % 100), VALUE, None) for i in range(records)]
    publisher = TransactionalPublisher(
        {"bootstrap.servers": bootstrap},
        f"bench-{uuid.uuid4()}",
        f"bench-markers-{uuid.uuid4().hex[:8]}",
    )
    publisher.publish(0, "warm-up", batch[:1000], [])  # init_transactions is paid once
    t0 = time.perf_counter()
    publisher.publish(1, "warm-up", batch, [])
    onceflow_rate = records / (time.perf_counter() - t0)

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"plain-{uuid.uuid4()}",
            "linger.ms": 5,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    producer.init_transactions(60)
    t0 = time.perf_counter()
    producer.begin_transaction()
    for topic, _, key, value, _ in batch:
        while True:
            try:
                producer.produce(topic, value, key)
                break
            except BufferError:
                producer.poll(0.05)
    producer.commit_transaction(60)
    plain_rate = records / (time.perf_counter() - t0)
    return onceflow_rate, plain_rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=500_000)
    args = parser.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or LocalKafka.from_env().start()
    topic = f"bench-in-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 3)
    print(f"preloading {args.records} records ...", flush=True)
    preload(bootstrap, topic, args.records)
    tmp = Path("/tmp") / f"onceflow-bench-{uuid.uuid4().hex[:6]}"
    record_mb = (len(VALUE) + 7) / 1e6
    print("plain consumer ...", flush=True)
    consumer_rate = plain_consumer(bootstrap, topic, args.records)
    print("source -> noop ...", flush=True)
    source_rate = source_to_noop(bootstrap, topic, args.records, tmp)
    print("commit path ...", flush=True)
    commit_rate, producer_rate = commit_path(bootstrap, args.records)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "records": args.records,
        "record_bytes": len(VALUE) + 7,
        "plain_consumer_records_per_s": round(consumer_rate),
        "source_to_noop_rows_per_s": round(source_rate),
        "sink_commit_records_per_s": round(commit_rate),
        "sink_commit_mb_per_s": round(commit_rate * record_mb, 1),
        "plain_txn_producer_records_per_s": round(producer_rate),
        "plain_txn_producer_mb_per_s": round(producer_rate * record_mb, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "connectors.json").write_text(json.dumps(results, indent=2) + "\n")
    table = "\n".join(
        [
            f"# Connector benchmark ({results['machine']}, {args.records} records of "
            f"{results['record_bytes']} bytes, 3 partitions)",
            "",
            "| path | records/s | MB/s | vs plain client |",
            "|---|---|---|---|",
            f"| plain confluent-kafka consumer (read_committed) | {consumer_rate:,.0f} | "
            f"{consumer_rate * record_mb:.1f} | 1.00 |",
            "| onceflow-kafka source -> noop (local[2], parallelism 2, AvailableNow, "
            f"incl. planning) | {source_rate:,.0f} | {source_rate * record_mb:.1f} | "
            f"{source_rate / consumer_rate:.2f} |",
            f"| plain transactional producer (one transaction) | {producer_rate:,.0f} | "
            f"{producer_rate * record_mb:.1f} | 1.00 |",
            f"| onceflow sink phase 2 (one transaction + marker) | {commit_rate:,.0f} | "
            f"{commit_rate * record_mb:.1f} | {commit_rate / producer_rate:.2f} |",
        ]
    )
    (RESULTS / "connectors.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
