"""The session defaults that depend on the master (pure logic, no Spark started)."""

import pytest

from onceflow import spark_session
from onceflow.spark_session import state_partitions


@pytest.mark.parametrize(
    ("master", "cores", "partitions"),
    [
        ("local[2]", 2, 2),
        ("local[*]", 8, 8),  # cores as Spark counts them: a container's CPU limit
        ("local[3, 2]", 3, 3),  # local[cores, maxFailures]
        ("local", 1, 2),  # one core, but a checkpoint keeps its partitions for good
        ("local[1]", 1, 2),
        ("spark://master:7077", 16, 4),
        ("local-cluster[2,1,1024]", 2, 4),
    ],
)
def test_keyed_state_has_a_partition_per_core_of_a_local_master(master, cores, partitions):
    assert state_partitions(master, cores) == partitions


def test_the_driver_collects_with_the_parallel_collector_unless_one_is_chosen_elsewhere(
    monkeypatch,
):
    """The JVM refuses to start with two collectors ("Multiple garbage collectors selected")."""
    for name in spark_session.JVM_OPTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert "-XX:+UseParallelGC" in spark_session.driver_java_options({}).split()
    chosen = {"spark.driver.defaultJavaOptions": "-Xss4m -XX:+UseZGC"}
    assert "GC" not in spark_session.driver_java_options(chosen)
    for name in spark_session.JVM_OPTION_VARIABLES:
        monkeypatch.setenv(name, "-XX:+UseG1GC -Xmx2g")
        assert "GC" not in spark_session.driver_java_options({}), name
        monkeypatch.delenv(name)


def test_python_processes_use_unix_sockets_in_the_fork_servers_directory_when_it_runs():
    launcher = "/tmp/onceflow-forkserver-123-abcd/python"
    assert spark_session.python_socket_conf(launcher) == {
        "spark.python.unix.domain.socket.enabled": "true",
        "spark.python.unix.domain.socket.dir": "/tmp/onceflow-forkserver-123-abcd",
    }
    assert spark_session.python_socket_conf(None) == {}  # no server: Spark's TCP, as before


def test_a_directory_longer_than_spark_takes_keeps_tcp():
    """Spark refuses a socket directory over 61 characters, and every Python stage fails."""
    fits = "/" + "d" * (spark_session.UNIX_SOCKET_DIR_MAX - 1)
    assert spark_session.python_socket_conf(f"{fits}/python")
    assert spark_session.python_socket_conf(f"{fits}d/python") == {}
    assert spark_session.python_socket_conf(f"{fits[:-1]}\u00e9/python") == {}  # 62 bytes
