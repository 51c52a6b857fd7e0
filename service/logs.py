"""Logging setup: human-readable lines, or one JSON object per line (ONCEFLOW_LOG_FORMAT=json).

Epoch lines carry `app`, `batch_id`, `offsets` and Spark's `phases_ms` as fields, so log
pipelines can index them. The level goes to ONCEFLOW_LOG_LEVEL too, which the Python
processes Spark starts inherit: the sink's commit runs in one of them, and its lines come to
the same log in the same format (`configure_if_asked`).
"""

from __future__ import annotations

import json
import logging
import os
import time

LEVEL_VARIABLE = "ONCEFLOW_LOG_LEVEL"
EXTRA_FIELDS = ("app", "batch_id", "offsets", "input_records", "duration_ms", "phases_ms")
LEVELS = ("debug", "info", "warning", "error")


class JsonFormatter(logging.Formatter):
    converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update({k: getattr(record, k) for k in EXTRA_FIELDS if hasattr(record, k)})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str = "info") -> None:
    handler = logging.StreamHandler()
    if os.environ.get("ONCEFLOW_LOG_FORMAT", "").lower() == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    os.environ[LEVEL_VARIABLE] = level


def configure_if_asked() -> None:
    """In a Python process that Spark started for the service (ONCEFLOW_LOG_LEVEL set, no
    logging set up yet): log as the service does. Elsewhere (the connectors in a user's own
    Spark application) leave logging alone."""
    level = os.environ.get(LEVEL_VARIABLE)
    if level in LEVELS and not logging.getLogger().handlers:
        configure(level)
