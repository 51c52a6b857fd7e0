"""Named fault points, so that fault tests can crash the service at exact protocol steps.

`ONCEFLOW_FAULT=<point>` or `<point>@<batch id>` kills the whole service with SIGKILL when
that point is reached (in that batch), as `kill -9` would. `hold:<point>@<batch id>` instead
creates the file ONCEFLOW_FAULT_HOLD_FILE there and waits until the test removes it, once per
process: a test breaks something outside (kills a broker) at that exact step. Two points
make the Kafka commit fail instead, once per process, as a broker can: `commit_abortable`
(refused before it commits) and `commit_outcome_unknown` (committed, then reported as timed
out). Unset (always, in production) a point costs one environment lookup. The service
records its process group in ONCEFLOW_SERVICE_PGID at start; Spark's Python workers run in a
process group of their own, so both groups are killed.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from .checkpoint import CheckpointDir

POINTS = (
    "before_prepare",
    "after_prepare",
    "before_kafka_commit",
    "after_kafka_commit",
    "during_state_store_commit",
)
# Stateless pipelines have no state store to interrupt.
STATELESS_POINTS = POINTS[:-1]
STATE_STORE_POINT = "during_state_store_commit"
COMMIT_FAILURES = ("commit_abortable", "commit_outcome_unknown")
_failed_commits: set[str] = set()


_held: set[str] = set()


def point(name: str, batch_id: int | None = None) -> None:
    wanted = os.environ.get("ONCEFLOW_FAULT")
    if not wanted:
        return
    hold = wanted.startswith("hold:")
    wanted_name, _, wanted_batch = wanted.removeprefix("hold:").partition("@")
    if wanted_name != name:
        return
    if wanted_batch and str(_current_batch() if batch_id is None else batch_id) != wanted_batch:
        return
    if hold:
        _hold(wanted)
    else:
        _kill_service()


def _hold(wanted: str) -> None:
    if wanted in _held:
        return
    _held.add(wanted)
    held = os.environ["ONCEFLOW_FAULT_HOLD_FILE"]
    with open(held, "w"):
        pass
    while os.path.exists(held):
        time.sleep(0.01)


def commit_failure(name: str, batch_id: int) -> None:
    """Raise the librdkafka error of commit failure `name` if armed for this batch."""
    wanted = os.environ.get("ONCEFLOW_FAULT", "")
    if wanted != f"{name}@{batch_id}" or wanted in _failed_commits:
        return
    _failed_commits.add(wanted)
    from confluent_kafka import KafkaError, KafkaException

    if name == "commit_abortable":
        error = KafkaError(
            KafkaError._STATE, "fault point: commit refused", txn_requires_abort=True
        )
    else:
        error = KafkaError(KafkaError._TIMED_OUT, "fault point: commit timed out", retriable=True)
    raise KafkaException(error)


def _kill_service() -> None:
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


def watch_state_store_commits(checkpoint: str) -> None:
    """Arm `during_state_store_commit@<batch>`: the state store commit runs inside Spark's JVM,
    so a driver thread watches the checkpoint and kills the service as soon as the first
    state file of that batch's version appears (some partitions committed, others not, and
    Spark's commit log not yet written)."""
    name, _, batch = os.environ.get("ONCEFLOW_FAULT", "").partition("@")
    if name != STATE_STORE_POINT:
        return
    version = str(int(batch or 0) + 1)
    state = CheckpointDir(checkpoint).path / "state"

    def written(entry: str) -> bool:  # final files and the temp files written before rename
        return entry.split(".")[0] == version or entry.startswith(f".{version}.")

    def watch() -> None:
        while True:
            for partition in state.glob("*/*"):
                if any(written(e) for e in os.listdir(partition)):
                    _kill_service()
            time.sleep(0.001)

    threading.Thread(target=watch, name="onceflow-fault-watch", daemon=True).start()
