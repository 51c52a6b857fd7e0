"""Commit markers: which epoch each sink last published, stored in a compacted Kafka topic.

A marker is produced in the same Kafka transaction as the epoch's output, so for a
`read_committed` reader the marker is visible if and only if the output is.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from onceflow.connectors.topics import create_topic, read_committed

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

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Marker:
        return cls(**json.loads(raw))


def ensure_marker_topic(conf: dict[str, str], topic: str) -> None:
    """Create the compacted marker topic if it is missing (one partition keeps order simple)."""
    create_topic(conf, topic, 1, MARKER_TOPIC_CONFIG)


def last_marker(conf: dict[str, str], topic: str, sink: str) -> Marker | None:
    """The newest committed marker of `sink` (the marker topic is small: it is compacted)."""
    key = sink.encode()
    records = [m for m in read_committed(conf, topic) if m.key() == key]
    # A tombstone (null value) deletes the sink's history: the app starts over on purpose.
    return Marker.decode(records[-1].value()) if records and records[-1].value() else None
