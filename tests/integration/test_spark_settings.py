"""The settings onceflow runs Spark with reach the driver JVM and the query."""

from __future__ import annotations

import pytest

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
