"""A class-data-sharing archive of the driver JVM's classes, for a faster start.

Most of the seconds before a restarted pipeline's first output go to the driver JVM loading
and verifying Spark's classes from their jars, the same classes on every start. The JVM can
instead map them from an archive written once (JDK's dynamic AppCDS: a run with
`-XX:ArchiveClassesAtExit` records what it loaded, later runs use `-XX:SharedArchiveFile`).
`make setup` and the image build record one here, by starting Spark and running a small
windowed streaming query and a Python data source job. An archive that no longer matches
the JVM or Spark's jars (an upgrade) is ignored by the JVM, which then loads classes as
usual: it can only cost speed, never correctness. `python -m onceflow.class_archive`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Unified logging off for CDS: a stale archive is ignored quietly instead of printing a
# warning on every start.
QUIET = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"
RECORD_TIMEOUT_S = 300


def archive_path() -> Path:
    """Where the archive of this installation lives (beside the Python environment)."""
    return Path(sys.prefix) / "share" / "onceflow" / "spark-driver.jsa"


def driver_java_options() -> str | None:
    """The driver's JVM options that use the archive, or None when there is none."""
    path = archive_path()
    return f"-XX:SharedArchiveFile={path} {QUIET}" if path.is_file() else None


def record(path: Path) -> None:
    """Record the archive at `path`: run the workload in a Python process of its own, whose
    driver JVM writes the archive as it exits, then move it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # one per recording
    started = time.monotonic()
    print(
        f"class archive: starting Spark once to record the classes it loads into {path} "
        "(about a minute) ...",
        flush=True,
    )
    workload = subprocess.Popen(
        [sys.executable, "-m", "onceflow.class_archive", "--workload", str(partial)],
        start_new_session=True,  # a process group: its JVM is stopped with it
    )
    try:
        try:
            code = workload.wait(RECORD_TIMEOUT_S)
        except BaseException:  # a timeout or Ctrl-C: stop the JVM before it dumps
            os.killpg(workload.pid, signal.SIGKILL)
            workload.wait()
            raise
        if code != 0:
            with contextlib.suppress(ProcessLookupError):  # its JVM, if it outlived it
                os.killpg(workload.pid, signal.SIGKILL)
            raise RuntimeError(f"the recording run exited {code}")
        if not partial.is_file():
            raise RuntimeError(f"the JVM wrote no class archive at {partial}")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)  # what a failed recording may have left
    size_mb = path.stat().st_size / 1e6
    print(f"class archive: {size_mb:.0f} MB in {time.monotonic() - started:.0f} s", flush=True)


def _workload(partial: Path) -> None:
    """What a pipeline's driver loads: the session, a Python data source job, and a windowed
    streaming query with RocksDB state; then the JVM exits and writes the archive."""
    from pyspark import SparkContext
    from pyspark.sql import functions as F

    from .spark_session import build_session, driver_collector
    from .warmup import warm_up

    collector = driver_collector({}) or ""  # as the pipelines' driver will run
    options = f"{collector} -XX:ArchiveClassesAtExit={partial} {QUIET}".strip()
    spark = build_session(conf={"spark.driver.extraJavaOptions": options})
    spark.sparkContext.setLogLevel("OFF")  # stopping the query mid-epoch is expected here
    warm_up(spark)
    with tempfile.TemporaryDirectory(prefix="onceflow-class-archive-") as checkpoint:
        counts = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", 100)
            .load()
            .withWatermark("timestamp", "1 second")
            .groupBy(F.window("timestamp", "1 second"), (F.col("value") % 10).alias("key"))
            .count()
        )
        query = (
            counts.writeStream.format("noop")
            .outputMode("append")
            .option("checkpointLocation", checkpoint)
            .trigger(processingTime="200 milliseconds")
            .start()
        )
        deadline = time.monotonic() + RECORD_TIMEOUT_S / 2
        while (query.lastProgress or {}).get("batchId", -1) < 3:
            if not query.isActive or time.monotonic() > deadline:
                raise RuntimeError(f"the recording query did not run: {query.exception()}")
            query.awaitTermination(0.2)
        query.stop()
    spark.stop()
    jvm = SparkContext._gateway.proc  # exits, writing the archive, when its stdin closes
    SparkContext._gateway.shutdown()
    jvm.stdin.close()
    if jvm.wait(RECORD_TIMEOUT_S / 2) != 0:  # a dump cut short must not be used
        raise RuntimeError(f"the JVM exited {jvm.returncode} while writing the class archive")


def main(argv: list[str]) -> None:
    if argv[:1] == ["--workload"]:
        _workload(Path(argv[1]))
        return
    try:
        record(Path(argv[0]) if argv else archive_path())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        # Setup goes on: the archive only makes starts faster.
        print(
            f"class archive: not recorded ({exc}); onceflow runs without it and starts a few "
            "seconds slower. To try again: python -m onceflow.class_archive",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
