"""The checkpoint directory: the only code that knows its layout.

Spark owns `metadata` (the query id), `offsets/<batch>` (the write-ahead log: a version line,
the batch's metadata with its watermark, then one offset per source) and `commits/<batch>`.
onceflow keeps its own files beside them: the source's initial offsets, the staged side
records of each epoch, the stats files the metrics endpoint reads, and the app's claim.
Everything else asks this module, so a change of layout is a change here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointClaimError, OptionError

STAGING = "onceflow-staged"
SINK_STATS = "onceflow-sink-stats.json"
SOURCE_STATS = "onceflow-source-stats.json"
INITIAL_OFFSETS = "onceflow-initial-offsets.json"
DEFAULT_SOURCE = "input"  # a pipeline's only input; its file keeps the name it always had
CLAIM = "onceflow-app.json"
# How long a claimer waits for the claim's lock, which every claimer holds for milliseconds;
# one held longer belongs to a paused (SIGSTOP, a frozen container) or hung process.
CLAIM_WAIT_S = 10.0
# Spark writes its logs and state files through a CheckpointFileManager. Its default
# (FileContext) forks 8 `readlink`s per file on a local disk (Hadoop 3.5 without its native
# library), and is no more atomic there than this one: Hadoop's local rename checks that
# the target is absent, then renames (`AbstractFileSystem.renameInternal`, then
# `File.renameTo`), which is what this manager does too. The lease keeps writers apart.
LOCAL_FILE_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)


@dataclass(frozen=True)
class BatchPlan:
    """What Spark wrote ahead for one batch: its source end offsets and its watermark."""

    batch_id: int
    source_offsets: list  # one entry per source, as Spark logged it (a dict, or "-" for none)
    watermark_ms: int
    fingerprint: str  # changes whenever the batch's start or end offsets were planned anew


class CheckpointDir:
    """A query's checkpoint directory, given as Spark's `checkpointLocation` (path or file:)."""

    def __init__(self, location: str | os.PathLike) -> None:
        self.location = str(location)
        self.path = Path(self.location.removeprefix("file:"))

    @property
    def is_local(self) -> bool:
        return "://" not in self.location or self.location.startswith("file:")

    def spark_conf(self) -> dict[str, str]:
        """The Spark settings this checkpoint is written with: on a local disk, Spark's
        FileSystem-based file manager (see LOCAL_FILE_MANAGER)."""
        if not self.is_local:
            return {}
        return {"spark.sql.streaming.checkpointFileManagerClass": LOCAL_FILE_MANAGER}

    # -- Spark's files ---------------------------------------------------------------------

    def query_id(self) -> str:
        """The id Spark stores in the checkpoint: it names the checkpoint across restarts."""
        path = self.path / "metadata"
        try:
            return json.loads(path.read_text())["id"]
        except (OSError, ValueError, KeyError) as exc:
            raise OptionError(
                f"cannot read the query id from {path} ({exc}); the onceflow-kafka sink needs "
                "a checkpoint on a file system this host can read"
            ) from None

    def batch_plan(self, batch_id: int) -> BatchPlan:
        """Batch `batch_id` as Spark's offset log has it (the log is written before it runs)."""
        raw = self._offset_log(batch_id)
        if raw is None:
            raise OptionError(
                f"the offset log {self.path / 'offsets' / str(batch_id)} is missing: the "
                "checkpoint must be on a file system the driver and executors can read"
            )
        lines = raw.decode().splitlines()
        metadata = json.loads(lines[1])
        sources = [json.loads(line) if line.startswith("{") else line for line in lines[2:]]
        previous = self._offset_log(batch_id - 1) or b""
        fingerprint = hashlib.sha256(previous + b"\0" + raw).hexdigest()[:16]
        return BatchPlan(batch_id, sources, int(metadata.get("batchWatermarkMs", 0)), fingerprint)

    def planned(self, batch_id: int) -> bool:
        """Whether Spark wrote batch `batch_id` ahead in its offset log."""
        return self._offset_log(batch_id) is not None

    def _offset_log(self, batch_id: int) -> bytes | None:
        try:
            return (self.path / "offsets" / str(batch_id)).read_bytes()
        except FileNotFoundError:
            return None

    def committed_batches(self) -> list[int]:
        """Batch ids in Spark's commit log, oldest first."""
        directory = self.path / "commits"
        if not directory.is_dir():
            return []
        return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())

    # -- the source's initial offsets --------------------------------------------------------

    def initial_offsets(self, source: str = DEFAULT_SOURCE) -> dict | None:
        """The offsets the query's input `source` started from, if it already chose them."""
        return self._read_json(_initial_offsets_file(source))

    def save_initial_offsets(self, offsets: dict, source: str = DEFAULT_SOURCE) -> None:
        write_atomically(self.path / _initial_offsets_file(source), json.dumps(offsets).encode())

    # -- staged side records -----------------------------------------------------------------

    def staging_root(self) -> Path:
        return self.path / STAGING

    def staging_dir(self, plan: BatchPlan) -> Path:
        """Where this plan of the batch stages its side records; another plan of the same
        batch id (a checkpoint restored from an older copy) never reads these files."""
        return self.staging_root() / str(plan.batch_id) / plan.fingerprint

    # -- stats and claim files ---------------------------------------------------------------

    def sink_stats(self) -> dict:
        return self._read_json(SINK_STATS) or {}

    def published_batch(self, sink: str) -> int:
        """The last batch the sink's stats record `sink` published (-1: none). The stats are
        written after each epoch's Kafka commit (by older versions too, without the sink's
        name), so the sink's marker is never older than this unless markers went missing."""
        stats = self.sink_stats()
        batch = stats.get("last_committed_batch", -1)
        if stats.get("sink", sink) != sink or not isinstance(batch, int):
            return -1
        return batch

    def write_sink_stats(self, stats: dict) -> None:
        write_atomically(self.path / SINK_STATS, json.dumps(stats).encode())

    def source_stats(self) -> dict[tuple[str, int], int]:
        """Offsets counted as lost per (topic, partition), kept as {"topic/partition": n}."""
        lost = {}
        for key, offsets in (self._read_json(SOURCE_STATS) or {}).items():
            topic, _, partition = key.rpartition("/")
            lost[(topic, int(partition))] = offsets
        return lost

    def add_source_data_loss(self, topic: str, partition: int, offsets: int) -> None:
        """Count `offsets` lost on topic/partition; tasks of one batch may add at once."""
        with self._locked(SOURCE_STATS):
            lost = self.source_stats()
            lost[(topic, partition)] = lost.get((topic, partition), 0) + offsets
            kept = {f"{t}/{p}": n for (t, p), n in lost.items()}
            write_atomically(self.path / SOURCE_STATS, json.dumps(kept).encode())

    def read_claim(self) -> dict:
        """The claim as last written, read without its lock (it is replaced by a rename, so
        it is read whole or not at all); {} when there is none yet.

        An unreadable claim raises CheckpointClaimError: read as no claim, it would let a
        start take a live holder's lease, and tell the holder that it lost it."""
        path = self.path / CLAIM
        try:
            claim = json.loads(path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            claim = exc
        if not isinstance(claim, dict):
            raise CheckpointClaimError(
                f"cannot read the checkpoint's claim {path} ({claim!r:.200}). It is tried again "
                "while the app runs (a network file system's passing error); if it stays "
                "unreadable and no instance of the app runs, delete it, then start again."
            )
        return claim

    @contextlib.contextmanager
    def claim(self) -> Iterator[dict]:
        """The app's claim on the checkpoint, read and (if changed) written back under a
        lock, so that two instances starting at once cannot both take it (across hosts only
        where the file system shares flock: not NFS mounted with `nolock` or `local_lock`).
        Raises CheckpointClaimError when another process holds that lock for over
        CLAIM_WAIT_S."""
        with self._locked(CLAIM, CLAIM_WAIT_S):
            claim = self.read_claim()
            before = dict(claim)
            yield claim
            if claim != before:
                write_atomically(self.path / CLAIM, json.dumps(claim).encode())

    def _read_json(self, name: str):
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    @contextlib.contextmanager
    def _locked(self, name: str, wait_s: float | None = None) -> Iterator[None]:
        """Hold the lock of file `name`, waiting for it for up to `wait_s` (None: for ever)."""
        self.path.mkdir(parents=True, exist_ok=True)
        path = self.path / f".{name}.lock"
        with open(path, "w") as lock:
            if wait_s is None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            else:
                _lock_within(lock.fileno(), path, wait_s)
            yield


def _lock_within(fd: int, path: Path, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise CheckpointClaimError(
                    f"another process has held {path} for over {wait_s:.0f} s: an instance of "
                    f"the app that is paused or hung inside its claim, or a disk that slow "
                    f"(`fuser {path}` names the process). Resume or stop it, then try again."
                ) from None
            time.sleep(0.01)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new file, whole.

    The data and the rename are fsynced: after a host crash the file is not empty or torn.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique: two hosts' containers sharing a volume may both run onceflow as pid 1.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    with open(tmp, "xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync(path.parent)


def fsync(path: Path) -> None:
    """fsync a file, or a directory (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _initial_offsets_file(source: str) -> str:
    """Each input of a query chooses its initial offsets once, in a file of its own."""
    if source == DEFAULT_SOURCE:
        return INITIAL_OFFSETS
    return INITIAL_OFFSETS.replace(".json", f"-{source}.json")
