"""A standby's warm-up: the first epoch after it takes over finds Spark's Python daemons
running."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from tests.helpers import produce

pytestmark = pytest.mark.integration

# Runs in a process of its own: daemons live as long as the JVM, and the shared test session
# has started them all long ago.
SCRIPT = """
import json, sys
from pathlib import Path
from pyspark import SparkContext
from onceflow import pipeline
from onceflow.config import load
from onceflow.spark_session import build_session
from onceflow.warmup import start_warm_up
from tests.helpers import processes

def daemons():
    jvm = SparkContext._gateway.proc.pid
    return [
        b" ".join(command[command.index(b"pyspark.daemon"):]).decode()
        for parent, command in processes().values()
        if parent == jvm and b"pyspark.daemon" in command
    ]

config = load(sys.argv[1])
spark = build_session(config.spark_master, "warm-up-test", config.spark_conf)
start_warm_up(spark).join()  # on a thread of its own, as the runner does
warm = daemons()
query = pipeline.start(spark, config, available_now=True)
query.awaitTermination()
print(json.dumps({"warm": warm, "after_query": daemons(), "rows": query.lastProgress and 1}))
"""


def test_the_first_epoch_starts_no_python_daemon_the_warm_up_did_not(
    kafka_bootstrap, new_topic, tmp_path
):
    source, output = new_topic(partitions=2, prefix="in"), new_topic(prefix="out")
    produce(kafka_bootstrap, source, [(None, f"r{i}".encode(), i % 2) for i in range(20)])
    config = {
        "app_id": f"warm-{source}",
        "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [source], "starting_offsets": "earliest", "format": "raw"},
        "sink": {"topic": output},
        "checkpoint": {"location": str(tmp_path / "ck")},
        "spark": {"master": "local[2]"},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["rows"], "the query ran no epoch"
    modules = " ".join(seen["warm"])
    for module in ("plan_data_source_read", "write_into_data_source", "pyspark.daemon"):
        assert module in modules, f"the warm-up did not start {module}: {seen['warm']}"
    # The streaming sink's commit runner starts at the first commit: a batch job has none.
    started = Counter(seen["after_query"]) - Counter(seen["warm"])
    assert list(started) in (
        [],
        ["pyspark.daemon pyspark.sql.worker.python_streaming_sink_runner "],
    ), f"the query started Python daemons of its own: {seen}"
