"""The same pipeline file on a real Spark standalone cluster (a master and one worker started
from the pyspark installation, the worker in a network namespace of its own), with
exactly-once window results."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyspark
import pytest
import yaml

from onceflow.connectors.topics import read_committed
from tests.helpers import free_port, produce

pytestmark = pytest.mark.integration
SPARK_HOME = Path(pyspark.__file__).parent
BASE = 1_700_000_000_000


@dataclass(frozen=True)
class Network:
    """Where the cluster's nodes live: the master and the driver bind to and advertise
    `host_address`; the worker `worker_address`, run through `worker_prefix`."""

    host_address: str
    worker_address: str
    worker_prefix: tuple[str, ...] = ()


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def _wait_for(log: Path, process: subprocess.Popen, text: bytes, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_bytes():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {text!r} in {log}: {log.read_text()[-3000:]}"
        time.sleep(0.3)


def _can_make_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


@pytest.fixture
def network(kafka_bootstrap: str, tmp_path: Path) -> Iterator[Network]:
    """The worker in a network namespace of its own, joined to this one by a veth pair, as
    compose's containers are: it reaches the master and the driver only at the addresses they
    advertise, so a node that binds to or advertises loopback fails the test. The broker is
    reached through two relays (it listens on this namespace's loopback only).

    Where no namespace can be made (not root, no iproute2, a broker elsewhere) every node is
    on 127.0.0.1, which still runs the pipeline on a cluster but cannot see loopback binding.
    """
    kafka_host, kafka_port = kafka_bootstrap.rsplit(":", 1)
    if not _can_make_namespaces() or kafka_host != "127.0.0.1":
        warnings.warn("Spark cluster test on loopback: no network namespace here", stacklevel=1)
        yield Network("127.0.0.1", "127.0.0.1")
        return
    tag = os.getpid() % 100_000
    namespace, host_link, worker_link = f"onceflow{tag}", f"ofh{tag}", f"ofw{tag}"
    subnet = random.randrange(1 << 14) * 4  # a /30 of 10.213.0.0/16
    host_address = f"10.213.{subnet >> 8}.{(subnet & 255) + 1}"
    worker_address = f"10.213.{subnet >> 8}.{(subnet & 255) + 2}"
    inside = ("ip", "netns", "exec", namespace)
    relays: list[subprocess.Popen] = []
    try:
        for command in (
            ["ip", "netns", "add", namespace],
            ["ip", "link", "add", host_link, "type", "veth", "peer", "name", worker_link],
            ["ip", "link", "set", worker_link, "netns", namespace],
            ["ip", "addr", "add", f"{host_address}/30", "dev", host_link],
            ["ip", "link", "set", host_link, "up"],
            [*inside, "ip", "addr", "add", f"{worker_address}/30", "dev", worker_link],
            [*inside, "ip", "link", "set", worker_link, "up"],
            [*inside, "ip", "link", "set", "lo", "up"],
        ):
            subprocess.run(command, check=True, capture_output=True)
        relay = [sys.executable, "-m", "tests.tcp_proxy"]
        for prefix, listen, target in (
            ((), f"{host_address}:{kafka_port}", kafka_bootstrap),
            (inside, kafka_bootstrap, f"{host_address}:{kafka_port}"),
        ):
            log = tmp_path / f"relay-{len(relays)}.log"
            relays.append(_spawn([*prefix, *relay, listen, target], log, dict(os.environ)))
            _wait_for(log, relays[-1], b"relaying")
        yield Network(host_address, worker_address, inside)
    finally:
        for process in relays:
            process.kill()
            process.wait()
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", host_link], capture_output=True)


@pytest.fixture
def spark_cluster(network: Network, tmp_path: Path) -> Iterator[str]:
    env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "PYSPARK_PYTHON": sys.executable}
    env.pop("SPARK_LOCAL_IP", None)
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    port = free_port()
    processes = []
    try:
        master_log = tmp_path / "master.log"
        master = _spawn(
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                network.host_address,
                "--port",
                str(port),
                "--webui-port",
                str(free_port()),
            ],
            master_log,
            env,
        )
        processes.append(master)
        _wait_for(master_log, master, b"I have been elected leader")
        worker_log = tmp_path / "worker.log"
        worker = _spawn(
            [
                *network.worker_prefix,
                spark_class,
                "org.apache.spark.deploy.worker.Worker",
                f"spark://{network.host_address}:{port}",
                "--host",
                network.worker_address,
                "--cores",
                "2",
                "--memory",
                "2g",
                "--webui-port",
                str(free_port()),
                "--work-dir",
                str(tmp_path / "work"),
            ],
            worker_log,
            env,
        )
        processes.append(worker)
        _wait_for(worker_log, worker, b"Successfully registered with master")
        yield f"spark://{network.host_address}:{port}"
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_windowed_pipeline_on_a_standalone_cluster_is_exactly_once(
    network, spark_cluster, kafka_bootstrap, new_topic, tmp_path
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
    # The driver advertises the host's address, as compose's onceflow service its name.
    driver_env = {**os.environ, "SPARK_LOCAL_HOSTNAME": network.host_address}
    driver_env.pop("SPARK_LOCAL_IP", None)
    result = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "run", "--available-now", str(pipeline)],
        capture_output=True,
        text=True,
        timeout=300,
        env=driver_env,
    )
    assert result.returncode == 0, result.stderr[-4000:]

    got = Counter()
    for m in read_committed(kafka_bootstrap, topics["out"]):
        value = json.loads(m.value())
        got[(value["key"], value["window_start"])] += value["clicks"]
    expected = Counter((u, BASE + (ts - BASE) // 10_000 * 10_000) for u, ts in events)
    assert got == expected
