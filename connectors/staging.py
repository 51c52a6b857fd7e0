"""Side records (dead letters, late records) staged by executors for the epoch's transaction.

Spark cannot route one scan of the input to two branches of a query without reading Kafka
twice (self-unions re-scan the source; exchange reuse does not apply to streaming scans).
So the step that classifies input records keeps the good ones in the query and *stages*
the others here, and the sink's phase 2 publishes them with the epoch's results in the same
Kafka transaction. Staging is part of phase 1: nothing is visible until the commit.

Three rules keep staging exactly-once:
- A file is durable (data and rename fsynced) before its task ends, so before Spark can
  write its commit log; after a host crash it is whole or absent.
- Files live under the batch's plan fingerprint (see CheckpointDir.staging_dir): a file
  left by another plan of the same batch id is never published. Within one plan a
  retried task replaces its own file, and the sink publishes each source position once.
- Before a query starts, what earlier runs staged for batches not in Spark's commit log is
  discarded (`discard_uncommitted`): those batches are recomputed whole, and their tasks may
  stage other records than last time (a record dead-lettered because its schema id was not
  found yet decodes on the replay) under other task numbers (another parallelism).
- A file that cannot be read fails the epoch with StagingError and is removed: the
  epoch is not in Spark's commit log, so a restart recomputes its tasks and stages anew.
"""

from __future__ import annotations

import shutil

from .checkpoint import BatchPlan, CheckpointDir, write_atomically
from .errors import StagingError
from .records import staged_schema


def stage(
    checkpoint: CheckpointDir, plan: BatchPlan, source: str, task: int, rows: list[dict]
) -> None:
    """Write one task's side records of input `source` durably and atomically (the inputs of
    a join are read in stages of their own, whose task numbers overlap). A task without
    any removes what an earlier attempt of it staged, which its results now replace."""
    import pyarrow as pa

    path = checkpoint.staging_dir(plan) / f"part-{source}-{task:05d}.arrow"
    if not rows:
        path.unlink(missing_ok=True)
        return
    table = pa.Table.from_pylist(rows, schema=staged_schema(pa))
    buffer = pa.BufferOutputStream()
    with pa.ipc.new_file(buffer, table.schema) as writer:
        writer.write_table(table)
    write_atomically(path, buffer.getvalue().to_pybytes())


def staged_tables(checkpoint: CheckpointDir, plan: BatchPlan) -> list:
    """Every task's staged side records for this plan of the batch, as Arrow tables."""
    import pyarrow as pa

    directory = checkpoint.staging_dir(plan)
    if not directory.is_dir():
        return []
    tables = []
    for path in sorted(directory.glob("part-*.arrow")):
        try:
            with pa.memory_map(str(path)) as source:
                tables.append(pa.ipc.open_file(source).read_all())
        except (OSError, pa.ArrowInvalid) as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise StagingError(
                f"staged side records {path} of batch {plan.batch_id} are unreadable ({exc}); "
                "they were removed, and the batch is recomputed when the app restarts "
                "(nothing of it was published)"
            ) from None
    return tables


def discard_uncommitted(checkpoint: CheckpointDir) -> None:
    """Forget what was staged for batches after the last one in Spark's commit log. They are
    recomputed whole when the query starts (a batch whose transaction did commit is then
    skipped by the sink's marker check, so its staged records are not needed either)."""
    root = checkpoint.staging_root()
    if not root.is_dir():
        return
    last = max(checkpoint.committed_batches(), default=-1)
    for child in root.iterdir():
        if child.name.isdigit() and int(child.name) > last:
            shutil.rmtree(child)


def clean_up_to(checkpoint: CheckpointDir, batch_id: int) -> None:
    """Forget the staged records of `batch_id` and earlier: they are published."""
    root = checkpoint.staging_root()
    if not root.is_dir():
        return
    for child in root.iterdir():
        if child.name.isdigit() and int(child.name) <= batch_id:
            shutil.rmtree(child, ignore_errors=True)
