"""The sink's counters, handed from the process that commits epochs to the metrics endpoint.

Spark runs the sink's phase 2 in a Python process of its own, so the counters travel in a
small JSON file in the checkpoint, replaced atomically after every epoch. Counters are
cumulative per sink process; `pid` tells the reader when a new process started from zero.
"""

from __future__ import annotations

import logging
import os
from collections import Counter

from .checkpoint import CheckpointDir

log = logging.getLogger("onceflow.sink")

records_published: Counter[str] = Counter()  # by kind, in this process


def write(checkpoint: CheckpointDir, sink: str, publisher_stats) -> None:
    stats = {
        "sink": sink,  # the transactional id: whose last_committed_batch this is
        "pid": os.getpid(),
        "transactions_committed": publisher_stats.transactions_committed,
        "transactions_aborted": publisher_stats.transactions_aborted,
        "replays_skipped": publisher_stats.replays_skipped,
        "last_committed_batch": publisher_stats.last_committed_batch,
        "last_commit_seconds": (publisher_stats.commit_seconds or [0.0])[-1],
        "records": dict(records_published),
    }
    try:
        checkpoint.write_sink_stats(stats)
    except OSError as exc:  # metrics must never fail an epoch that Kafka already committed
        log.warning("could not write sink stats to %s: %s", checkpoint.path, exc)
