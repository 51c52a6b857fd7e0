"""The ceiling for Q1: Kafka's TransactionalMessageCopier pattern in one Python process.

consume (read_committed) -> Q1 transform -> produce, one transaction per `--batch` records
(or per second, whichever comes first) with the consumed offsets sent to it. No Spark, no
checkpoint: the least work a correct exactly-once Q1 can do with confluent-kafka.

    python -m bench.copier --bootstrap B --source T --sink S --records N

Prints one JSON line: records copied and seconds from the first record read to the last commit.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

from confluent_kafka import Consumer, Producer


def q1(value: bytes) -> tuple[bytes, bytes]:
    bid = json.loads(value)
    out = {
        "auction": bid["auction"],
        "bidder": bid["bidder"],
        "price": int(bid["price"] * 0.908),
        "dateTime": bid["dateTime"],
    }
    return str(bid["auction"]).encode(), json.dumps(out).encode()


def copy(bootstrap: str, source: str, sink: str, records: int, batch: int) -> dict:
    group = f"copier-{uuid.uuid4().hex[:8]}"
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": group,
            "linger.ms": 5,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    producer.init_transactions(60)
    consumer.subscribe([source])
    copied, in_transaction, start, began = 0, 0, None, time.monotonic()
    producer.begin_transaction()
    while copied < records:
        for message in consumer.consume(10_000, 1.0):
            if message.error():
                continue
            start = start or time.perf_counter()
            key, value = q1(message.value())
            while True:
                try:
                    producer.produce(sink, value, key)
                    break
                except BufferError:
                    producer.poll(0.05)
            copied += 1
            in_transaction += 1
        due = in_transaction and time.monotonic() - began >= 1.0
        if in_transaction >= batch or due or (copied >= records and in_transaction):
            producer.send_offsets_to_transaction(
                consumer.position(consumer.assignment()), consumer.consumer_group_metadata()
            )
            producer.commit_transaction(60)
            producer.begin_transaction()
            in_transaction, began = 0, time.monotonic()
    producer.abort_transaction(60)  # the empty one begun last
    seconds = time.perf_counter() - (start or time.perf_counter())
    consumer.close()
    return {"records": copied, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("bootstrap", "source", "sink"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--records", type=int, required=True)
    parser.add_argument("--batch", type=int, default=100_000, help="records per transaction")
    args = parser.parse_args()
    print(json.dumps(copy(args.bootstrap, args.source, args.sink, args.records, args.batch)))


if __name__ == "__main__":
    main()
