"""Side records (dead letters, late records) staged by executors for the epoch's transaction.

Each staged record carries its source position (`topic/partition/offset`), and the sink
publishes a position once even if two files of one batch hold it.

Spark cannot route one scan of the input to two branches of a query without reading Kafka
twice (self-unions re-scan the source; exchange reuse does not apply to streaming scans).
So the step that classifies input records keeps the good ones in the query and *stages*
the others here, keyed by (batch id, task partition), and the sink's phase 2 publishes them
with the epoch's results in the same Kafka transaction. Staging is part of phase 1: nothing
is visible until the commit, and a replayed batch overwrites its own files with the same
records (its offset ranges, and so its partitions, are fixed by Spark's offset log).

The directory lives inside the checkpoint, which every node of a cluster can already reach.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

STAGING_DIR = "onceflow-staged"


def staged_schema(pa):
    """The sink's record columns, plus the source position and why the record is here."""
    from onceflow.connectors.source import headers_type

    return pa.schema(
        [
            ("topic", pa.string()),  # null: no topic configured; counted and logged
            ("partition", pa.int32()),
            ("key", pa.binary()),
            ("value", pa.binary()),
            ("headers", headers_type(pa)),
            ("source", pa.string()),
            ("reason", pa.string()),
        ]
    )


def batch_dir(checkpoint: str | Path, batch_id: int) -> Path:
    return Path(str(checkpoint).removeprefix("file:")) / STAGING_DIR / str(batch_id)


def stage(checkpoint: str | Path, batch_id: int, partition_id: int, table) -> None:
    """Write one task's side records atomically (a retried task replaces its own file)."""
    import pyarrow as pa

    directory = batch_dir(checkpoint, batch_id)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"part-{partition_id:05d}.arrow"
    tmp = final.with_suffix(f".tmp-{os.getpid()}")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(tmp, final)


def staged_tables(checkpoint: str | Path, batch_id: int) -> list:
    """Every task's staged side records for `batch_id`, as Arrow tables."""
    import pyarrow as pa

    directory = batch_dir(checkpoint, batch_id)
    if not directory.is_dir():
        return []
    tables = []
    for path in sorted(directory.glob("part-*.arrow")):
        with pa.memory_map(str(path)) as source:
            tables.append(pa.ipc.open_file(source).read_all())
    return tables


def clean_up_to(checkpoint: str | Path, batch_id: int) -> None:
    """Forget the staged records of `batch_id` and earlier: they are published."""
    root = batch_dir(checkpoint, batch_id).parent
    if not root.is_dir():
        return
    for child in root.iterdir():
        if child.name.isdigit() and int(child.name) <= batch_id:
            shutil.rmtree(child, ignore_errors=True)
