"""Logging setup: human-readable lines, or one JSON object per line (ONCEFLOW_LOG_FORMAT=json).

Epoch lines carry `app`, `batch_id`, `offsets` and Spark's `phases_ms` as fields, so log
pipelines can index them. The Python processes that Spark starts for the service (the sink
commits in one of them) log onceflow's lines the same way (`for_spark_processes`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator

# Private: set only in the environment the JVM starts with, never read from a user's shell.
SPARK_PROCESS_LEVEL = "_ONCEFLOW_SPARK_PROCESS_LOG_LEVEL"
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


_service_level: str | None = None  # set by configure: this process is the service's driver


def _handler() -> logging.Handler:
    handler = logging.StreamHandler()
    if os.environ.get("ONCEFLOW_LOG_FORMAT", "").lower() == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler


def configure(level: str = "info") -> None:
    """The service's logging: this process is the service's (the CLI's) own."""
    global _service_level
    logging.basicConfig(level=level.upper(), handlers=[_handler()], force=True)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    _service_level = level


@contextlib.contextmanager
def for_spark_processes() -> Iterator[None]:
    """While the JVM starts inside: its Python processes inherit the service's level (in
    SPARK_PROCESS_LEVEL), so that `configure_spark_process` sets them up. Removed after, so
    that nothing this process starts later inherits it."""
    if _service_level is None:  # not the service (a test, a user's own application)
        yield
        return
    os.environ[SPARK_PROCESS_LEVEL] = _service_level
    try:
        yield
    finally:
        os.environ.pop(SPARK_PROCESS_LEVEL, None)


def configure_spark_process() -> None:
    """In a Python process that Spark started for the service: onceflow's loggers write to
    this process' stderr (which Spark passes on to the service's) at the service's level
    and in its format. Only onceflow's loggers: the root logger stays Spark's."""
    level = os.environ.get(SPARK_PROCESS_LEVEL)
    logger = logging.getLogger("onceflow")
    if level in LEVELS and not logger.handlers:
        logger.addHandler(_handler())
        logger.setLevel(level.upper())
        logger.propagate = False
