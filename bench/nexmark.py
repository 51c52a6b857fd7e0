"""Nexmark's bid stream and the four benchmark queries, as onceflow pipelines.

The generator follows Nexmark's (Beam's `NexmarkGenerator`, default config): one new auction
per 50 events and one new person per 50 events, 100 auctions in flight, 1,000 active people;
half of the bids go to the hot auction (hot ratio 2) and three in four to a hot bidder (hot
ratio 4); prices are 10^(6u) cents; four hot channels take half of the bids. `extra` stays
empty: Nexmark pads bids to 100 bytes on average and ours are larger already. Event time
advances 1 ms per 10 events (Nexmark's 10,000 events/s first-event rate).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from confluent_kafka import Producer

FIRST_EVENT_MS = 1_700_000_000_000
EVENTS_PER_MS = 10
HOT_CHANNELS = ("Google", "Facebook", "Baidu", "Apple")
BID_SCHEMA = (
    "auction BIGINT, bidder BIGINT, price BIGINT, channel STRING, url STRING, "
    "dateTime BIGINT, extra STRING"
)


def bids(count: int, seed: int = 42) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of `count` bids: key = auction id, value = the bid as JSON."""
    rng = random.Random(seed)
    for n in range(count):
        event = n * 50 // 46  # bids are 46 of every 50 Nexmark events
        last_auction = 1000 + event // 50
        auction = (
            last_auction // 2 * 2
            if rng.randrange(2)
            else last_auction - rng.randrange(min(100, last_auction - 999))
        )
        last_person = 1000 + event // 50
        bidder = (
            last_person // 4 * 4 + 1
            if rng.randrange(4)
            else last_person - rng.randrange(min(1000, last_person - 999))
        )
        channel_id = rng.randrange(10_000)
        channel = HOT_CHANNELS[channel_id % 4] if rng.randrange(2) else f"channel-{channel_id}"
        url = f"https://www.nexmark.com/{_word(rng)}/{_word(rng)}/item.htm?channel_id={channel_id}"
        bid = {
            "auction": auction,
            "bidder": bidder,
            "price": round(10 ** (rng.random() * 6) * 100),
            "channel": channel,
            "url": url,
            "dateTime": FIRST_EVENT_MS + event // EVENTS_PER_MS,
            "extra": "",
        }
        yield str(auction).encode(), json.dumps(bid, separators=(",", ":")).encode()


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))


def preload(bootstrap: str, topic: str, count: int, partitions: int) -> int:
    """Produce `count` bids as fast as the broker takes them; returns the payload bytes."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "queue.buffering.max.messages": 2_000_000,
            "compression.type": "lz4",
        }
    )
    size = 0
    for i, (key, value) in enumerate(bids(count)):
        size += len(key) + len(value)
        while True:
            try:
                producer.produce(topic, value, key, i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(300)
    return size


def q1(routed):
    """Q1 (currency conversion, stateless): price in euros, keyed by auction."""
    from pyspark.sql import functions as F

    value = F.to_json(
        F.struct(
            "auction",
            "bidder",
            (F.col("price") * 0.908).cast("bigint").alias("price"),
            "dateTime",
        )
    )
    return routed.select(F.col("auction").cast("string").alias("key"), value.alias("value"))


# Windowed queries as onceflow `window:` sections. Q7's "highest bid per window" is kept per
# channel: onceflow windows need a key.
WINDOWS = {
    "q5": {
        "type": "sliding",
        "size": "10s",
        "slide": "2s",
        "key": "auction",
        "aggregations": {"bids": "count(*)"},
    },
    "q7": {
        "type": "tumbling",
        "size": "10s",
        "key": "channel",
        "aggregations": {"max_price": "max(price)"},
    },
    "q11": {
        "type": "session",
        "gap": "10s",
        "key": "bidder",
        "aggregations": {"bids": "count(*)"},
    },
}
QUERIES = ("q1", *WINDOWS)
EPOCH_RECORDS = 100_000  # per micro-batch (onceflow, Spark) and per transaction (copier)


def pipeline(
    query: str,
    bootstrap: str,
    source: str,
    sink: str,
    checkpoint: str,
    guarantee: str = "exactly_once",
    master: str = "local[2]",
) -> dict:
    """The onceflow pipeline file (as a dict) of one benchmark query."""
    config = {
        "app_id": f"bench-{query}-{sink}",
        "kafka": {"bootstrap_servers": bootstrap},
        "source": {
            "topics": [source],
            "starting_offsets": "earliest",
            "format": "json",
            "schema": BID_SCHEMA,
            "max_records_per_batch": EPOCH_RECORDS,
        },
        "event_time": {"field": "dateTime", "watermark_delay": "1s"},
        "sink": {"topic": sink, "guarantee": guarantee},
        "checkpoint": {"location": checkpoint, "interval": "1s"},
        "spark": {"master": master},
        "metrics": {"port": 0},
    }
    if query == "q1":
        config["transform"] = "bench.nexmark:q1"
    else:
        config["window"] = WINDOWS[query]
    return config
