"""The settings onceflow runs Spark with reach the driver JVM and the query."""

from __future__ import annotations

import os
import stat

import pytest

from onceflow import local_fs
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


def test_the_driver_writes_local_files_without_a_chmod_process_as_hadoop_would(spark, tmp_path):
    """onceflow's local file system (`make setup` builds it): each file and directory gets
    the permission Hadoop's own gives it, and its checksum file, set without a process."""
    assert local_fs.jar_path().is_file(), "built by `make setup` (python -m onceflow.local_fs)"
    jvm = spark.sparkContext._jvm
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    directory = jvm.org.apache.hadoop.fs.Path(f"file://{tmp_path}/d")
    file_system = directory.getFileSystem(hadoop)
    assert file_system.getClass().getName() == local_fs.CLASS_NAME
    assert file_system.mkdirs(directory)
    out = file_system.create(jvm.org.apache.hadoop.fs.Path(directory, "f"), True)
    out.write(120)
    out.close()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((tmp_path / "d" / "f").stat().st_mode) == 0o666 & ~umask
    assert (tmp_path / "d" / "f").read_bytes() == b"x"
    assert (tmp_path / "d" / ".f.crc").is_file()


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
