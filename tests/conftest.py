"""Session fixtures: a real Kafka broker, a real schema registry and a real Spark session.

The broker and the registry are what onceflow's pytest plugin (onceflow/testing.py) gives
users' tests: KAFKA_BOOTSTRAP_SERVERS / SCHEMA_REGISTRY_URL if set, else containers when a
Docker engine answers, else onceflow's own local broker and registry, stopped at the end only
if this session started them.
"""

from __future__ import annotations

import os
import uuid
import warnings

import pytest
from confluent_kafka.admin import AdminClient

from onceflow.connectors.topics import create_topic
from onceflow.local_kafka import LocalKafka
from onceflow.local_process import LocalServiceError


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


def pytest_configure(config) -> None:
    config.onceflow_broker_is_the_tests = _broker_is_the_tests()


def _broker_is_the_tests() -> bool:
    """Whether onceflow's local broker serves these tests alone: not a broker of your own
    (KAFKA_BOOTSTRAP_SERVERS), and started for them (by deploy/run-tests.sh, or by this
    session) rather than found running, perhaps with your pipelines on it."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return False
    if os.environ.get("ONCEFLOW_TESTS_OWN_BROKER") == "1":
        return True
    try:
        return LocalKafka.from_env().pid() is None
    except LocalServiceError:  # no local broker on this platform
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap(onceflow_kafka: str, pytestconfig):
    """The session's broker: onceflow's pytest plugin chooses it (onceflow/testing.py).

    On a local broker started for the tests, the topics the session made are deleted at its
    end: a broker that keeps every run's thousands of partitions takes minutes to start after
    a crash. A broker found running, or your own, is left as it is."""
    ours = pytestconfig.onceflow_broker_is_the_tests
    if not ours or LocalKafka.from_env().bootstrap != onceflow_kafka:
        yield onceflow_kafka
        return
    before = _topics(onceflow_kafka)
    yield onceflow_kafka
    try:  # hygiene, not a test: a failure is said and the session goes on
        made = sorted(_topics(onceflow_kafka) - before)
        admin = AdminClient({"bootstrap.servers": onceflow_kafka})  # held until all end
        for deleted in (admin.delete_topics(made) if made else {}).values():
            deleted.result(120)
    except Exception as exc:
        warnings.warn(f"could not delete the session's test topics: {exc!r}", stacklevel=1)


def _topics(bootstrap: str) -> set[str]:
    topics = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30).topics
    return {name for name in topics if not name.startswith("__")}


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
