"""Session fixtures: a real Kafka broker, a real schema registry and a real Spark session.

The broker and the registry are what onceflow's pytest plugin (onceflow/testing.py) gives
users' tests: KAFKA_BOOTSTRAP_SERVERS / SCHEMA_REGISTRY_URL if set, else containers when a
Docker engine answers, else onceflow's own local broker and registry, stopped at the end only
if this session started them.
"""

from __future__ import annotations

import uuid

import pytest

from onceflow.connectors.topics import create_topic
from onceflow.local_kafka import LocalKafka


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


@pytest.fixture(scope="session")
def kafka_bootstrap(onceflow_kafka: str) -> str:
    """The session's broker: onceflow's pytest plugin chooses it (onceflow/testing.py)."""
    return onceflow_kafka


@pytest.fixture(scope="session")
def schema_registry(onceflow_registry: str) -> str:
    """The session's schema registry, chosen by the plugin too."""
    return onceflow_registry


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
