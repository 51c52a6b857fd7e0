"""The session defaults that depend on the master (pure logic, no Spark started)."""

import os

import pytest

from onceflow import local_fs, spark_session
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


@pytest.mark.parametrize(
    ("master", "used"),
    [
        ("local[2]", True),
        ("local", True),
        ("local[3, 2]", True),
        ("local-cluster[2,1,1024]", False),  # executors in JVMs of their own
        ("spark://master:7077", False),
    ],
)
def test_a_local_master_writes_files_through_the_built_file_system(
    master, used, tmp_path, monkeypatch
):
    """Only where the driver's JVM is the executors' too, and never in place of a pipeline's
    own choice; without the jar (no JDK at setup), Hadoop's own."""
    jar = tmp_path / "onceflow-local-fs.jar"
    monkeypatch.setattr(local_fs, "jar_path", lambda: jar)
    assert local_fs.spark_conf(master, {}) == {}
    jar.write_bytes(b"")
    setting = {local_fs.FILE_SYSTEM_SETTING: local_fs.CLASS_NAME}
    assert local_fs.spark_conf(master, {}) == (setting if used else {})
    own = {local_fs.FILE_SYSTEM_SETTING: "org.example.TheirFileSystem"}
    assert local_fs.spark_conf(master, own) == {}


def test_the_jar_joins_the_class_path_only_while_the_jvm_starts(tmp_path, monkeypatch):
    jar = tmp_path / "onceflow-local-fs.jar"
    monkeypatch.setattr(local_fs, "jar_path", lambda: jar)
    monkeypatch.setenv(local_fs.CLASS_PATH_VARIABLE, "/opt/their.jar")
    with local_fs.on_class_path(True):
        assert os.environ[local_fs.CLASS_PATH_VARIABLE] == f"/opt/their.jar{os.pathsep}{jar}"
    assert os.environ[local_fs.CLASS_PATH_VARIABLE] == "/opt/their.jar"
    monkeypatch.delenv(local_fs.CLASS_PATH_VARIABLE)
    with local_fs.on_class_path(True):
        assert os.environ[local_fs.CLASS_PATH_VARIABLE] == str(jar)
    assert local_fs.CLASS_PATH_VARIABLE not in os.environ
    with local_fs.on_class_path(False):
        assert local_fs.CLASS_PATH_VARIABLE not in os.environ
