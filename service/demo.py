"""`onceflow demo`: a click stream with late and malformed records, windowed exactly once.

Starts the local broker, produces a live click stream for a while, runs a tumbling-window
pipeline on it and prints each window result as its transaction commits. At the end it
checks the record accounting: every click is in a window, the late topic or dead letters.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter

from confluent_kafka import Consumer, TopicPartition

from onceflow.connectors.topics import create_topic, read_committed

from .config import parse
from .generator import produce_clicks
from .local_kafka import LocalKafka
from .runner import run


def run_demo(seconds: float = 40.0) -> int:
    broker = LocalKafka.from_env()
    bootstrap = broker.start()
    app = f"demo-{int(time.time())}"
    topics = {
        "in": f"{app}.clicks",
        "out": f"{app}.clicks-per-user",
        "dlq": f"{app}.clicks.dlq",
        "late": f"{app}.clicks.late",
    }
    for name in topics.values():
        create_topic(bootstrap, name, 3 if name == topics["in"] else 1)
    work = broker.home / "demo" / app
    config = parse(
        {
            "app_id": app,
            "kafka": {"bootstrap_servers": bootstrap},
            "source": {
                "topics": [topics["in"]],
                "starting_offsets": "earliest",
                "format": "json",
                "schema": "user STRING, url STRING, bytes LONG, ts LONG",
            },
            "event_time": {"field": "ts", "watermark_delay": "2s"},
            "window": {
                "type": "tumbling",
                "size": "5s",
                "key": "user",
                "aggregations": {"clicks": "count(*)", "bytes": "sum(bytes)"},
            },
            "sink": {
                "topic": topics["out"],
                "dead_letter_topic": topics["dlq"],
                "late_topic": topics["late"],
            },
            "checkpoint": {"location": str(work / "checkpoint"), "interval": "1s"},
            "spark": {"master": "local[2]"},
        }
    )
    print(
        f"\nonceflow demo: {seconds:.0f}s of clicks into {topics['in']}, windowed per user "
        f"every 5s into {topics['out']}."
    )
    print("Results appear below as their Kafka transactions commit (read_committed).\n")

    stop = threading.Event()
    produced: Counter = Counter()
    producer = threading.Thread(
        target=lambda: produced.update(produce_clicks(bootstrap, topics["in"], seconds)),
        daemon=True,
    )
    printer = threading.Thread(
        target=_print_results, args=(bootstrap, topics["out"], stop), daemon=True
    )
    producer.start()
    printer.start()
    threading.Thread(
        target=lambda: (producer.join(), time.sleep(8), stop.set()), daemon=True
    ).start()
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: stop, and show what was published
        run(config, stop=stop)
    printer.join(5)

    results = [json.loads(m.value()) for m in read_committed(bootstrap, topics["out"])]
    late = len(read_committed(bootstrap, topics["late"]))
    dead = len(read_committed(bootstrap, topics["dlq"]))
    counted = sum(r["clicks"] for r in results)
    total = sum(produced.values())
    print(f"\nproduced {total} records: {dict(produced)}")
    print(f"windowed {counted} clicks in {len(results)} results, {late} late, {dead} dead letters;")
    print(
        f"{total - counted - late - dead} clicks are in windows still open at shutdown "
        "(they are in the checkpoint's state and come out when the app runs again)."
    )
    print(
        f"\nRead the output yourself (kcat):  kcat -C -b {bootstrap} -t {topics['out']} "
        "-X isolation.level=read_committed -e"
    )
    print(f"Checkpoint: {work / 'checkpoint'}.  Stop the broker with: onceflow kafka stop")
    return 0


def _print_results(bootstrap: str, topic: str, stop: threading.Event) -> None:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"demo-printer-{time.time()}",
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        while not stop.is_set():
            for msg in consumer.consume(100, 0.5):
                if msg.error():
                    continue
                r = json.loads(msg.value())
                start = time.strftime("%H:%M:%S", time.gmtime(r["window_start"] / 1000))
                end = time.strftime("%H:%M:%S", time.gmtime(r["window_end"] / 1000))
                print(
                    f"  window {start}-{end} UTC  {r['key']:<7} {r['clicks']:>4} clicks "
                    f"{r['bytes'] / 1000:>8.1f} kB"
                )
    finally:
        consumer.close()
