"""The same pipeline file on a real Spark standalone cluster (a master and one worker started
from the pyspark installation), with exactly-once window results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyspark
import pytest
import yaml

from onceflow.connectors.topics import read_committed
from tests.helpers import produce

pytestmark = pytest.mark.integration
SPARK_HOME = Path(pyspark.__file__).parent
BASE = 1_700_000_000_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, process: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert process.poll() is None, log.read_text()[-3000:]
        time.sleep(0.3)
    raise AssertionError(f"port {port} did not open: {log.read_text()[-3000:]}")


@pytest.fixture
def spark_cluster(tmp_path):
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
    }
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    port = _free_port()
    processes = []
    try:
        master_log = tmp_path / "master.log"
        master = subprocess.Popen(
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(_free_port()),
            ],
            stdout=master_log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        processes.append(master)
        _wait_port(port, master, master_log)
        worker_log = tmp_path / "worker.log"
        worker = subprocess.Popen(
            [
                spark_class,
                "org.apache.spark.deploy.worker.Worker",
                f"spark://127.0.0.1:{port}",
                "--cores",
                "2",
                "--memory",
                "2g",
                "--webui-port",
                str(_free_port()),
                "--work-dir",
                str(tmp_path / "work"),
            ],
            stdout=worker_log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        processes.append(worker)
        deadline = time.monotonic() + 90
        while b"Successfully registered with master" not in worker_log.read_bytes():
            assert time.monotonic() < deadline, worker_log.read_text()[-3000:]
            assert worker.poll() is None, worker_log.read_text()[-3000:]
            time.sleep(0.3)
        yield f"spark://127.0.0.1:{port}"
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_windowed_pipeline_on_a_standalone_cluster_is_exactly_once(
    spark_cluster, kafka_bootstrap, new_topic, tmp_path
):
    topics = {n: new_topic(partitions=2, prefix=n) for n in ("in", "out", "dlq", "late")}
    events = [(f"u{i % 5}", BASE + i * 13) for i in range(5000)]
    produce(
        kafka_bootstrap,
        topics["in"],
        [
            (u.encode(), json.dumps({"user": u, "ts": ts}).encode(), i % 2)
            for i, (u, ts) in enumerate(events)
        ]
        + [(b"u0", json.dumps({"user": "u0", "ts": BASE + 10**9}).encode(), 0)],
    )
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "app_id": f"cluster-{topics['in']}",
                "kafka": {"bootstrap_servers": kafka_bootstrap},
                "source": {
                    "topics": [topics["in"]],
                    "starting_offsets": "earliest",
                    "schema": "user STRING, ts LONG",
                    "max_records_per_batch": 2000,
                },
                "event_time": {"field": "ts", "watermark_delay": "1s"},
                "window": {
                    "type": "tumbling",
                    "size": "10s",
                    "key": "user",
                    "aggregations": {"clicks": "count(*)"},
                },
                "sink": {
                    "topic": topics["out"],
                    "dead_letter_topic": topics["dlq"],
                    "late_topic": topics["late"],
                },
                # Every node reaches this path: the cluster runs on this machine.
                "checkpoint": {"location": str(tmp_path / "checkpoint")},
                "spark": {"master": spark_cluster, "conf": {"spark.executor.memory": "1g"}},
                "metrics": {"port": 0},
            }
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "run", "--available-now", str(pipeline)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]

    got = Counter()
    for m in read_committed(kafka_bootstrap, topics["out"]):
        value = json.loads(m.value())
        got[(value["key"], value["window_start"])] += value["clicks"]
    expected = Counter((u, BASE + (ts - BASE) // 10_000 * 10_000) for u, ts in events)
    assert got == expected
