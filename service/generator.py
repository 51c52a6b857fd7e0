"""A click-stream generator for the demo and docker-compose: realistic, with some bad records.

About `rate` clicks a second over a few users and URLs; 2% arrive 30 s delayed (late, once
the watermark has moved past them) and 1% are truncated JSON (dead letters).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter

from confluent_kafka import Producer

USERS = [f"user-{i}" for i in range(8)]
URLS = ["/", "/pricing", "/docs", "/blog", "/signup"]


def produce_clicks(
    bootstrap: str, topic: str, seconds: float | None, rate: int = 300, seed: int = 7
) -> Counter:
    """Produce for `seconds` (None: forever); returns how many records of each kind."""
    rng = random.Random(seed)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    produced: Counter = Counter()
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        for _ in range(max(1, rate // 10)):
            user = rng.choice(USERS)
            now_ms = int(time.time() * 1000)
            roll = rng.random()
            if roll < 0.01:
                kind, value = "malformed", b'{"user": "' + user.encode() + b'", "bytes": '
            else:
                kind = "30s delayed" if roll < 0.03 else "on time"
                ts = now_ms - 30_000 if kind == "30s delayed" else now_ms - rng.randint(0, 1500)
                click = {"user": user, "url": rng.choice(URLS), "bytes": rng.randint(200, 20_000)}
                value = json.dumps({**click, "ts": ts}).encode()
            producer.produce(topic, key=user.encode(), value=value)
            produced[kind] += 1
        producer.poll(0)
        time.sleep(0.1)
    producer.flush(30)
    return produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--topic", default="clicks")
    parser.add_argument("--rate", type=int, default=300, help="clicks per second")
    parser.add_argument("--seconds", type=float, default=None, help="default: forever")
    parser.add_argument(
        "--bootstrap", default=os.environ.get("ONCEFLOW_KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    )
    args = parser.parse_args()
    print(produce_clicks(args.bootstrap, args.topic, args.seconds, args.rate))


if __name__ == "__main__":
    main()
