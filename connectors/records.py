"""The shapes a Kafka record takes on its way through onceflow, defined once.

- What the source hands Spark: the columns of Spark's own Kafka source.
- What the sink publishes: (topic, partition, key, value, headers) per record.
- What the router stages for the sink: the same, plus the input record's position
  (`topic/partition/offset`) and why it left the query (a dead-letter reason, or "late").
- The headers onceflow adds: an input record's position (`onceflow.source`) on every
  record published from it unchanged (pass-through, dead letters, late records), which is
  what `onceflow verify` matches inputs by; why a dead letter is one (`onceflow.error`);
  and `onceflow.late` on late records.
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
HEADER_SOURCE = "onceflow.source"
HEADER_ERROR = "onceflow.error"
HEADER_LATE = "onceflow.late"
POSITION_SEPARATOR = "/"  # topic names hold no "/" (Kafka allows [A-Za-z0-9._-])


def position(topic: str, partition: int, offset: int) -> str:
    """An input record's position, as HEADER_SOURCE and the staged `source` column hold it."""
    return f"{topic}{POSITION_SEPARATOR}{partition}{POSITION_SEPARATOR}{offset}"


def parse_position(text: str | None) -> tuple[str, int, int] | None:
    """(topic, partition, offset) of a `position`; None for anything else."""
    parts = (text or "").rsplit(POSITION_SEPARATOR, 2)
    if len(parts) != 3 or not parts[0]:
        return None
    partition, offset = _natural(parts[1]), _natural(parts[2])
    if partition is None or offset is None:
        return None
    return parts[0], partition, offset


def _natural(text: str | None) -> int | None:
    """`text` as a non-negative integer, or None (`isdigit` alone takes "²")."""
    if not (text and text.isascii() and text.isdigit() and len(text) <= 20):
        return None
    return int(text)


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
