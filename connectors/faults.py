"""Named fault points, so that fault tests can crash the service at exact protocol steps.

`ONCEFLOW_FAULT=<point>` or `<point>@<batch id>` kills the whole service with SIGKILL when
that point is reached (in that batch), as `kill -9` would. Unset (always, in production) a
point costs one environment lookup. The service records its process group in
ONCEFLOW_SERVICE_PGID at start; Spark's Python workers run in a process group of their own,
so both groups are killed.
"""

from __future__ import annotations

import os
import signal

POINTS = ("before_prepare", "after_prepare", "before_kafka_commit", "after_kafka_commit")


def point(name: str, batch_id: int | None = None) -> None:
    wanted = os.environ.get("ONCEFLOW_FAULT")
    if not wanted:
        return
    wanted_name, _, wanted_batch = wanted.partition("@")
    if wanted_name != name:
        return
    if wanted_batch and str(_current_batch() if batch_id is None else batch_id) != wanted_batch:
        return
    own = os.getpgid(0)
    service = int(os.environ.get("ONCEFLOW_SERVICE_PGID", own))
    if service != own:
        os.killpg(service, signal.SIGKILL)
    os.killpg(own, signal.SIGKILL)


def _current_batch() -> str | None:
    """The micro-batch id of the running Spark task (executors only)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    return context.getLocalProperty("streaming.sql.batchId") if context else None
