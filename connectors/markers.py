"""Commit markers: which epoch each sink last published, stored in a compacted Kafka topic.

A marker is produced in the same Kafka transaction as the epoch's output, so for a
`read_committed` reader the marker is visible if and only if the output is.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

from . import kafka_clients
from .errors import OnceflowError
from .topics import create_topic, read_committed

log = logging.getLogger("onceflow.sink")

DEFAULT_MARKER_TOPIC = "onceflow.commits"
MARKER_TOPIC_CONFIG = {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"}


@dataclass(frozen=True)
class Marker:
    """`sink` published epoch `batch_id` of the query whose checkpoint has id `query_id`."""

    sink: str
    batch_id: int
    query_id: str
    records: int
    source_offsets: list = field(default_factory=list)
    plan: str = ""  # the batch plan's fingerprint (CheckpointDir.batch_plan); "" in old markers

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Marker:
        return cls(**json.loads(raw))


def ensure_marker_topic(conf: dict[str, str], topic: str) -> None:
    """Create the compacted marker topic if it is missing (one partition keeps order simple)."""
    create_topic(conf, topic, 1, MARKER_TOPIC_CONFIG)


def last_marker(conf: dict[str, str], topic: str, sink: str, wait_s: float) -> Marker | None:
    """The newest committed marker of `sink` (the marker topic is small: it is compacted).

    A `read_committed` reader stops at the first open transaction, and the marker topic is
    shared: another app's open transaction would hide this sink's newer markers behind it.
    So first wait (up to `wait_s`) until every transaction open on the topic now is settled.
    """
    partitions = sorted(kafka_clients.metadata(conf).topics[topic].partitions)
    tps = [(topic, p) for p in partitions]
    written = kafka_clients.high_watermarks(conf, tps)
    deadline = time.monotonic() + wait_s
    logged = False
    while any(o < written[tp] for tp, o in kafka_clients.stable_ends(conf, tps).items()):
        if time.monotonic() > deadline:
            raise OnceflowError(
                f"a transaction on the marker topic {topic!r} stayed open for over {wait_s:.0f} "
                "s, so the last published epoch cannot be read; check the apps that share "
                "this marker topic (their transaction timeout), then restart"
            )
        if not logged:
            log.info("waiting for transactions open on %s to settle before reading it", topic)
            logged = True
        time.sleep(0.05)
    key = sink.encode()
    records = [m for m in read_committed(conf, topic) if m.key() == key]
    # A tombstone (null value) deletes the sink's history: the app starts over on purpose.
    return Marker.decode(records[-1].value()) if records and records[-1].value() else None
