"""Offsets the source skipped over (failOnDataLoss=false), handed to the metrics endpoint.

Spark plans a Python source's epochs in a Python process of its own, so, like the sink's
counters (sink_stats.py), the figures travel in a JSON file in the checkpoint: offsets lost
per "topic/partition", cumulative over the checkpoint's life.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

STATS_FILE = "onceflow-source-stats.json"
log = logging.getLogger("onceflow.source")


def add_data_loss(checkpoint: str, topic: str, partition: int, offsets: int) -> None:
    path = Path(checkpoint.removeprefix("file:")) / STATS_FILE
    lost = read(checkpoint)
    key = f"{topic}/{partition}"
    lost[key] = lost.get(key, 0) + offsets
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(lost))
        os.replace(tmp, path)
    except OSError as exc:  # the loss is also in the log; the metric must not stop the query
        log.warning("could not write source stats to %s: %s", path, exc)


def read(checkpoint: str) -> dict[str, int]:
    try:
        return json.loads((Path(checkpoint.removeprefix("file:")) / STATS_FILE).read_text())
    except (OSError, ValueError):
        return {}
