"""Session fixtures: a real Kafka broker, a real schema registry and a real Spark session.

The broker is, in order of preference: KAFKA_BOOTSTRAP_SERVERS if set; an `apache/kafka`
container when a Docker engine answers; else onceflow's own local broker (jars from Maven
Central), which is stopped at the end only if this session started it. The registry is
chosen the same way: SCHEMA_REGISTRY_URL, an Apicurio Registry container, or onceflow's
local registry (`onceflow registry start`).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator

import pytest

from onceflow.connectors.topics import create_topic
from onceflow.local_kafka import KAFKA_VERSION, LocalKafka
from onceflow.local_registry import API_PATH, REGISTRY_VERSION, LocalRegistry, environment
from tests.helpers import free_port

# The settings a one-node apache/kafka container needs for transactions (same as compose).
KAFKA_CONTAINER_ENV = {
    "KAFKA_NODE_ID": "1",
    "KAFKA_PROCESS_ROLES": "broker,controller",
    "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
    "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
    "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
    "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093",
    "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
    "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
    "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
}


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="the full fault matrix: more records, every fault point (also in the sink's "
        "crash tests), 10+ random kills, pass-through and windowed",
    )
    parser.addoption(
        "--nodes",
        type=int,
        default=3,
        help="nodes of the local Kafka cluster that tests/fault/test_cluster.py starts for its "
        "scenarios (3 to 5; 1 skips them)",
    )


def docker_engine_answers() -> bool:
    """True only when a Docker engine (not just the client) responds to a ping."""
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    if bootstrap := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield bootstrap
        return
    if docker_engine_answers():
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.waiting_utils import wait_for_logs

        port = free_port()
        container = DockerContainer(f"apache/kafka:{KAFKA_VERSION}").with_bind_ports(9092, port)
        for key, value in {
            **KAFKA_CONTAINER_ENV,
            "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{port}",
        }.items():
            container = container.with_env(key, value)
        with container:
            wait_for_logs(container, "Kafka Server started", timeout=120)
            yield f"127.0.0.1:{port}"
        return
    broker = LocalKafka.from_env()
    started_here = broker.pid() is None
    bootstrap = broker.start()
    yield bootstrap
    if started_here:
        broker.stop()


@pytest.fixture(scope="session")
def schema_registry(kafka_bootstrap: str) -> Iterator[str]:
    """The URL of a Confluent-compatible schema registry (Confluent's API)."""
    if url := os.environ.get("SCHEMA_REGISTRY_URL"):
        yield url
        return
    if docker_engine_answers():
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.waiting_utils import wait_for_logs

        port = free_port()
        container = DockerContainer(
            f"apicurio/apicurio-registry:{REGISTRY_VERSION}"
        ).with_bind_ports(8080, port)
        for key, value in environment().items():
            container = container.with_env(key, value)
        with container:
            wait_for_logs(container, "Installed features", timeout=120)
            yield f"http://127.0.0.1:{port}{API_PATH}"
        return
    registry = dataclasses.replace(LocalRegistry.from_env(), kafka_bootstrap=kafka_bootstrap)
    started_here = registry.pid() is None
    url = registry.start()
    yield url
    if started_here:
        registry.stop()


@pytest.fixture(scope="session")
def local_broker(kafka_bootstrap: str) -> LocalKafka:
    """onceflow's own broker, for tests that stop, kill and restart it."""
    broker = LocalKafka.from_env()
    if broker.bootstrap != kafka_bootstrap or broker.pid() is None:
        pytest.skip("this test bounces the broker, so it needs onceflow's local broker")
    return broker


@pytest.fixture
def new_topic(kafka_bootstrap: str):
    """A factory for fresh, uniquely named topics."""

    def make(partitions: int = 1, prefix: str = "t", config: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        create_topic(kafka_bootstrap, name, partitions, config)
        return name

    return make


@pytest.fixture(scope="session")
def spark():
    from onceflow.spark_session import build_session

    session = build_session("local[2]", "onceflow-tests")
    yield session
    session.stop()
