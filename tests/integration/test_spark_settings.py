"""The settings onceflow runs Spark with reach the driver JVM and the query."""

from __future__ import annotations

import os
import re
import stat

import pytest

from onceflow import forkserver
from onceflow.config import parse
from onceflow.connectors.checkpoint import LOCAL_FILE_MANAGER
from onceflow.connectors.topics import read_committed
from onceflow.runner import run
from tests.helpers import produce
from tests.integration.test_pipeline import BASE, click, pipeline

pytestmark = pytest.mark.integration

MANAGER = "spark.sql.streaming.checkpointFileManagerClass"


@pytest.fixture
def topics(new_topic):
    return {name: new_topic(partitions=1, prefix=name) for name in ("in", "out", "dlq", "late")}


def test_the_driver_jvm_collects_garbage_with_the_parallel_collector(spark):
    management = spark.sparkContext._jvm.java.lang.management.ManagementFactory
    collectors = sorted(bean.getName() for bean in management.getGarbageCollectorMXBeans())
    assert collectors == ["PS MarkSweep", "PS Scavenge"]


def test_a_pipeline_writes_its_local_checkpoint_through_sparks_file_system_manager(
    kafka_bootstrap, spark, topics, tmp_path
):
    spark.conf.unset(MANAGER)  # the session is shared: only this run may set it
    config = parse(pipeline(topics, tmp_path, kafka_bootstrap))
    produce(kafka_bootstrap, topics["in"], [(b"u1", click("u1", BASE), 0)])
    run(config, available_now=True)
    assert spark.conf.get(MANAGER) == LOCAL_FILE_MANAGER
    assert [m.value() for m in read_committed(kafka_bootstrap, topics["out"])] == [
        click("u1", BASE)
    ]


def _worker_sockets(batches):
    """In a task's Python worker: the family and name of each socket it holds."""
    import socket

    import pyarrow as pa

    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                found.append((sock.family.name, str(sock.getsockname())))
        except OSError:
            continue
    for _ in batches:
        pass
    yield pa.RecordBatch.from_pylist(
        [{"family": f, "name": n} for f, n in found],
        schema=pa.schema([("family", pa.string()), ("name", pa.string())]),
    )


def test_sparks_python_workers_reach_the_jvm_through_unix_sockets_in_the_drivers_directory(
    spark,
):
    """Over loopback TCP a Python stage waited 40 ms for a delayed ACK (Nagle's algorithm)."""
    assert forkserver._server is not None, "no fork server: is PYSPARK_PYTHON set?"
    directory = os.path.dirname(forkserver._server[1])
    conf = spark.sparkContext.getConf()
    assert conf.get("spark.python.unix.domain.socket.dir") == directory, conf.getAll()
    rows = spark.range(0, 4, 1, 2).mapInArrow(_worker_sockets, "family STRING, name STRING")
    sockets = {(row.family, row.name) for row in rows.collect()}
    # A worker's connection from the JVM came to its daemon's socket, Spark's `.<uuid>.sock`
    # (its other sockets: a Kafka client an earlier task left in a reused worker).
    spark_sockets = [
        name
        for family, name in sockets
        if family == "AF_UNIX"
        and os.path.dirname(name) == directory
        and re.fullmatch(r"\.[0-9a-f-]{36}\.sock", os.path.basename(name))
    ]
    assert len(spark_sockets) == 1, sockets
    # Spark does not authenticate a Unix socket's connections: the directory's mode does.
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
