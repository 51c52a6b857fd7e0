"""The shapes a Kafka record takes on its way through onceflow, defined once.

- What the source hands Spark: the columns of Spark's own Kafka source.
- What the sink publishes: (topic, partition, key, value, headers) per record.
- What the router stages for the sink: the same, plus the input record's position
  (`topic/partition/offset`) and why it left the query (a dead-letter reason, or "late").
"""

from __future__ import annotations

SOURCE_COLUMNS = (
    "key",
    "value",
    "topic",
    "partition",
    "offset",
    "timestamp",
    "timestampType",
    "headers",
)
SOURCE_SCHEMA = (
    "key BINARY, value BINARY, topic STRING, partition INT, offset BIGINT, "
    "timestamp TIMESTAMP, timestampType INT, headers ARRAY<STRUCT<key: STRING, value: BINARY>>"
)
OUTPUT_COLUMNS = ("topic", "partition", "key", "value", "headers")
LATE_REASON = "late"


def headers_type(pa):
    """Kafka headers as Spark's Kafka source shows them: array<struct<key, value>>."""
    return pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def staged_schema(pa):
    """OUTPUT_COLUMNS, plus the input record's position and why it left the query."""
    return pa.schema(
        [
            ("topic", pa.string()),  # null: no topic configured; counted and logged
            ("partition", pa.int32()),
            ("key", pa.binary()),
            ("value", pa.binary()),
            ("headers", headers_type(pa)),
            ("source", pa.string()),
            ("reason", pa.string()),  # LATE_REASON, or why it is a dead letter
        ]
    )


def side_record(
    topic: str | None, key, value, headers: list[dict], source: str, reason: str
) -> dict:
    """One staged row of staged_schema."""
    return {
        "topic": topic,
        "partition": None,
        "key": key,
        "value": value,
        "headers": headers,
        "source": source,
        "reason": reason,
    }
