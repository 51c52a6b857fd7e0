"""Building the SparkSession onceflow runs in, with the settings exactly-once needs."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping

from . import class_archive, forkserver, logs

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"

DEFAULT_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # Keyed state (transformWithState) needs RocksDB; it is also the store that scales.
    "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
    # Each epoch uploads only the state's changes (Spark reads a checkpoint written either
    # way, so existing ones too). Every 10th version is also snapshotted, and the snapshot is
    # uploaded by the state store's maintenance task, which Spark first runs one interval
    # after the state is loaded: with its default (60 s) a process that lives shorter never
    # uploads one, and every restart replays all the changelogs since the last.
    "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
    "spark.sql.streaming.stateStore.maintenanceInterval": "5s",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # A failed task is a failed epoch: Spark retries the whole batch from its offset log.
    "spark.task.maxFailures": "1",
    # Python processes wait this long for the JVM's socket (Spark's default 15 s); a machine
    # short of CPU for that long should slow the pipeline down, not fail it.
    "spark.python.authenticate.socketTimeout": "120s",
    # Spark's default, plus librdkafka's secrets that it misses (`kafka.ssl.key.pem`, a JAAS
    # line): option values whose names match are redacted wherever Spark shows them.
    "spark.redaction.regex": r"(?i)secret|password|token|access[.]?key|pem|jaas",
}

# The longest `spark.python.unix.domain.socket.dir` Spark takes, in characters; its sockets
# there, `.<uuid>.sock`, must fit a sockaddr_un's 107 bytes. Counted here in bytes, both hold.
# With a longer one every Python stage fails.
UNIX_SOCKET_DIR_MAX = 61

# The driver JVM's collector: with it a restart on a small machine came sooner than with G1,
# and the pipelines moved as many records per second once warm (README, "Recovery").
DRIVER_GARBAGE_COLLECTOR = "-XX:+UseParallelGC"
# Where else a collector can be chosen for the driver JVM; the JVM refuses to start with two.
JVM_OPTION_VARIABLES = (
    "JAVA_TOOL_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "_JAVA_OPTIONS",
    "SPARK_SUBMIT_OPTS",
)
CHOSEN_COLLECTOR = re.compile(r"-XX:\+Use\w+GC\b")


def driver_collector(conf: Mapping[str, str]) -> str | None:
    """The collector option, unless one is chosen elsewhere (the JVM's environment,
    `spark.driver.defaultJavaOptions`). A choice in spark-defaults.conf or spark-env.sh is
    not seen here: set `spark.driver.extraJavaOptions` in the pipeline instead."""
    elsewhere = [os.environ.get(name, "") for name in JVM_OPTION_VARIABLES]
    elsewhere.append(conf.get("spark.driver.defaultJavaOptions", ""))
    return None if CHOSEN_COLLECTOR.search(" ".join(elsewhere)) else DRIVER_GARBAGE_COLLECTOR


def driver_java_options(conf: Mapping[str, str]) -> str:
    """The driver JVM's options: the collector and the class archive, if recorded."""
    return " ".join(filter(None, (driver_collector(conf), class_archive.driver_java_options())))


def build_session(
    master: str = "local[2]", app_name: str = "onceflow", conf: Mapping[str, str] | None = None
):
    """A SparkSession with the onceflow Kafka data source registered as `onceflow-kafka`."""
    # Python workers must run the interpreter onceflow is installed in, not whatever
    # `python3` is first on PATH.
    own_python = False
    for name in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON"):
        own_python |= os.environ.setdefault(name, sys.executable) != sys.executable
    launcher = None
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # Spark's Python processes forked from a process that has imported pyspark, unless
        # the user chose a Python for Spark (executors of a cluster start theirs as usual).
        launcher = None if own_python else forkserver.start_server()
    # Fault points (tests only) kill this process group: the driver and its JVM.
    os.environ.setdefault("ONCEFLOW_SERVICE_PGID", str(os.getpgid(0)))
    from pyspark.sql import SparkSession

    settings = DEFAULT_CONF | python_socket_conf(launcher)
    java_options = driver_java_options(conf or {})
    if java_options:  # a user's own JVM options replace these
        settings["spark.driver.extraJavaOptions"] = java_options
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in {**settings, **(conf or {})}.items():
        builder = builder.config(key, value)
    # pyspark's Py4J converters import pandas and pyarrow (`pyspark.testing.utils`) at the
    # first call into the JVM: imported while the JVM starts, they are there by then.
    importing = _import_in_background("pyarrow", "pandas")
    with forkserver.spark_python(launcher), logs.for_spark_processes():
        spark = builder.getOrCreate()
    if importing is not None:
        importing.join()
    if "spark.sql.shuffle.partitions" not in (conf or {}):
        cores = spark.sparkContext.defaultParallelism
        spark.conf.set("spark.sql.shuffle.partitions", str(state_partitions(master, cores)))
    quiet_spark_logs(spark)
    register_data_source(spark)
    return spark


def python_socket_conf(launcher: str | None) -> dict[str, str]:
    """Spark's Python processes connect to the JVM through Unix sockets in the fork server's
    directory instead of loopback TCP, where each Python stage of an epoch waited for a
    delayed ACK (Nagle's algorithm; bench/results/first-epoch.md). Spark authenticates
    those connections by nothing but the directory's mode, and this one is the driver's own
    (0700), removed with it (after a SIGKILL, by the next driver's start). Only with the fork
    server, which runs for a local master: Spark's Python processes then run where the
    directory is."""
    if launcher is None:
        return {}
    directory = os.path.dirname(launcher)
    if len(directory.encode()) > UNIX_SOCKET_DIR_MAX:
        return {}
    return {
        "spark.python.unix.domain.socket.enabled": "true",
        "spark.python.unix.domain.socket.dir": directory,
    }


def _import_in_background(*modules: str) -> threading.Thread | None:
    def import_them() -> None:
        for module in modules:
            with contextlib.suppress(Exception):  # then pyspark finds it missing, as before
                importlib.import_module(module)

    if all(module in sys.modules for module in modules):
        return None
    thread = threading.Thread(target=import_them, name="onceflow-imports")
    thread.start()
    return thread


def state_partitions(master: str, cores: int) -> int:
    """Partitions of a new query's keyed state: one per core of a local master (`cores`, as
    Spark counts them: a container's CPU limit, not the host's CPUs), at least 2, so that a
    stateful stage runs in one wave (every task of an epoch pays a fixed cost to open and
    commit its state store); else 4. Spark pins the number in the checkpoint at its first
    epoch; `spark.sql.shuffle.partitions` in `spark.conf` sets it."""
    local = master.strip() == "local" or master.strip().startswith("local[")
    return max(2, cores) if local else 4


# Spark loggers that print a failed task's or query's stack trace: onceflow reports the
# failure itself, in one line that says what to do next.
FAILURE_TRACE_LOGGERS = (
    "org.apache.spark.executor.Executor",
    "org.apache.spark.scheduler.TaskSetManager",
    "org.apache.spark.sql.execution.streaming.runtime.MicroBatchExecution",
)


def quiet_spark_logs(spark) -> None:
    """Spark's warnings and errors, without the stack traces of a failure, unless onceflow
    logs at debug level (`--log-level debug`), which shows those too."""
    spark.sparkContext.setLogLevel("WARN")
    if logging.getLogger("onceflow").isEnabledFor(logging.DEBUG):
        return
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j
    for name in FAILURE_TRACE_LOGGERS:
        log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)


def register_data_source(spark) -> None:
    from onceflow.connectors.datasource import KafkaDataSource

    spark.dataSource.register(KafkaDataSource)
