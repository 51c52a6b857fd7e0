"""Parsing the data source options shared by the Kafka source and sink.

Option names follow Spark's own Kafka connector (`kafka.bootstrap.servers`, `subscribe`,
`startingOffsets`, `maxOffsetsPerTrigger`, `failOnDataLoss`, `kafka.*` pass-through) so that
Spark users feel at home; `parallelism` (how many tasks read a batch) is onceflow's own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from .errors import OptionError

# librdkafka settings the connectors own; a user value would break exactly-once.
RESERVED_CONSUMER_KEYS = {"isolation.level", "enable.auto.commit", "group.id"}
RESERVED_PRODUCER_KEYS = {"transactional.id", "enable.idempotence"}


def kafka_conf(options: Mapping[str, str], reserved: set[str]) -> dict[str, str]:
    """The `kafka.*` options as a librdkafka config (prefix stripped), bootstrap included."""
    conf = {k[len("kafka.") :]: v for k, v in options.items() if k.lower().startswith("kafka.")}
    if not conf.get("bootstrap.servers"):
        raise OptionError("option 'kafka.bootstrap.servers' is required, e.g. 127.0.0.1:9092")
    bad = sorted(reserved & conf.keys())
    if bad:
        raise OptionError(
            f"option(s) {', '.join('kafka.' + k for k in bad)} are set by onceflow for "
            "exactly-once and cannot be overridden; remove them"
        )
    return conf


def get_bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = options.get(name)
    if raw is None:
        return default
    value = str(raw).strip().lower()
    if value not in ("true", "false"):
        raise OptionError(f"option '{name}' must be true or false, got {raw!r}")
    return value == "true"


def get_positive_int(options: Mapping[str, str], name: str) -> int | None:
    raw = options.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise OptionError(f"option '{name}' must be a positive integer, got {raw!r}") from None
    if value <= 0:
        raise OptionError(f"option '{name}' must be a positive integer, got {raw!r}")
    return value


def parse_topic_list(options: Mapping[str, str]) -> list[str]:
    return [t.strip() for t in options.get("subscribe", "").split(",") if t.strip()]


def parse_starting_offsets(raw: str) -> str | dict[str, dict[str, int]]:
    """`earliest`, `latest`, or Spark's JSON form {"topic": {"0": 23, "1": -2}}.

    In the JSON form -2 means earliest and -1 latest, as in Spark.
    """
    text = raw.strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OptionError(
            f"option 'startingOffsets' must be earliest, latest or JSON like "
            f'{{"topic": {{"0": 23}}}}; {raw!r} is not valid JSON ({exc.msg} at {exc.pos})'
        ) from None
    if not isinstance(parsed, dict) or not parsed:
        raise OptionError(
            f"option 'startingOffsets' JSON must map topic -> {{partition: offset}}, got {raw!r}"
        )
    result: dict[str, dict[str, int]] = {}
    # Offsets copied from a marker or the offset log carry topic ids under '@' keys.
    parsed = {t: parts for t, parts in parsed.items() if not t.startswith("@")}
    for topic, parts in parsed.items():
        if not isinstance(parts, dict):
            raise OptionError(
                f"option 'startingOffsets': topic {topic!r} must map partition -> offset, "
                f"got {parts!r}"
            )
        result[topic] = {}
        for partition, offset in parts.items():
            if not str(partition).isdigit() or not isinstance(offset, int) or offset < -2:
                raise OptionError(
                    f"option 'startingOffsets': {topic}[{partition}] = {offset!r} is not a "
                    "partition number mapped to an offset (>= 0, or -2 earliest, -1 latest)"
                )
            result[topic][str(int(partition))] = offset
    return result
