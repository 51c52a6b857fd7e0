"""Starting Spark's Python processes before the first epoch needs them: a standby's wait.

A Python data source's first epoch waits for three Python daemons that Spark starts one
after another on the micro-batch thread (read planning, write planning, then the tasks'
`pyspark.worker`), and for RocksDB's native library. Daemons live as long as the JVM and are
shared by every job of the session, so a one-row batch job through a Python data source has
them ready for a query started later (measured in bench/results/first-epoch.md). A failed
warm-up costs nothing but time: the query starts whatever it still needs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)

from .spark_session import ROCKSDB_PROVIDER

log = logging.getLogger("onceflow.run")

NAME = "onceflow-warmup"


class WarmupDataSource(DataSource):
    """One row per partition in, nothing out: only Spark's Python processes do any work."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return "n INT"

    def reader(self, schema) -> DataSourceReader:
        return _OneRowReader(int(self.options.get("partitions", "1")))

    def writer(self, schema, overwrite: bool) -> DataSourceWriter:
        return _DiscardingWriter()


class _OneRowReader(DataSourceReader):
    def __init__(self, partitions: int) -> None:
        self.count = partitions

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(n) for n in range(self.count)]

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        yield (partition.value,)


class _DiscardingWriter(DataSourceWriter):
    def write(self, iterator) -> WriterCommitMessage:
        for _ in iterator:
            pass
        return WriterCommitMessage()

    def commit(self, messages) -> None:
        pass


def warm_up(spark) -> None:
    """RocksDB's native library (when the state store is RocksDB), then one batch job that
    starts the read-planning, write-planning and task daemons, one task per core."""
    # A Python data source is found for a write through the JVM thread's active session,
    # which a thread of our own has not got.
    spark._jvm.org.apache.spark.sql.classic.SparkSession.setActiveSession(spark._jsparkSession)
    if spark.conf.get("spark.sql.streaming.stateStore.providerClass", "") == ROCKSDB_PROVIDER:
        spark._jvm.org.rocksdb.RocksDB.loadLibrary()
    spark.dataSource.register(WarmupDataSource)
    cores = spark.sparkContext.defaultParallelism
    rows = spark.read.format(NAME).option("partitions", str(cores)).load()
    rows.write.format(NAME).mode("append").save()


def start_warm_up(spark) -> threading.Thread:
    """warm_up(spark) on a daemon thread; its failure is logged, never raised."""

    def run() -> None:
        try:
            warm_up(spark)
        except Exception as exc:  # the query starts what it needs itself
            log.info("warm-up skipped (%s); the first epoch starts Spark's Python processes", exc)

    thread = threading.Thread(target=run, name="onceflow-warm-up", daemon=True)
    thread.start()
    return thread
