"""A real Apache Kafka broker for the demo, the tests and local development.

The broker jars come from Maven Central (fetched once with `mvn` into a cache directory) and
run with the machine's `java`: one combined broker+controller node in KRaft mode on
127.0.0.1, configured so that transactions work on a single node, or one node of a local
cluster (local_cluster.py). With `sasl_ssl` it also listens for SASL_SSL clients on its
port + 3 (see secure_listener). With `proxy_port` it also listens on its port + 5 and
advertises that listener at the proxy's port, so that clients which bootstrap there reach it
only through a proxy (the fault tests' slow and broken networks).
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import local_process
from .local_process import (
    LocalServiceError,
    locked,
    port_open,
    require_tool,
    wait_exit,
)
from .secure_listener import SecureListener

KAFKA_VERSION = "4.1.1"
LOG4J_VERSION = "2.24.3"
SLF4J_VERSION = "2.0.17"

DEFAULT_PORT = 9092
# A cluster's nodes listen for clients on consecutive ports, their controllers 10 above.
CLUSTER_CONTROLLER_OFFSET = 10
PROXIED_LISTENER_OFFSET = 5
START_TIMEOUT_S = 90.0
INTERNAL_TOPIC_PARTITIONS = 4  # of the offsets and transaction logs: a node's start loads each
STOP_TIMEOUT_S = 30.0

POM = f"""<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by onceflow: the Apache Kafka broker and a logging backend, nothing is built. -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.onceflow</groupId>
  <artifactId>onceflow-local-kafka</artifactId>
  <version>{KAFKA_VERSION}</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>{KAFKA_VERSION}</version>
    </dependency>
    <dependency>
      <groupId>org.slf4j</groupId>
      <artifactId>slf4j-api</artifactId>
      <version>{SLF4J_VERSION}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j2-impl</artifactId>
      <version>{LOG4J_VERSION}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>{LOG4J_VERSION}</version>
    </dependency>
  </dependencies>
</project>
"""

LOG4J2_PROPERTIES = """\
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = STDOUT
logger.raft.name = kafka.server.KafkaRaftServer
logger.raft.level = INFO
logger.logs.name = kafka.log.LogManager
logger.logs.level = INFO
"""
# LogManager's line per partition log loaded at start: "... (2300/4642 completed in /data)".
LOADED_LOGS = re.compile(rb"\((\d+)/(\d+) completed in ")


def new_cluster_id() -> str:
    """A KRaft cluster id: a base64url UUID that does not start with '-'.

    The storage tool's argument parser reads a leading '-' as an option (1 id in 64 failed CI);
    Kafka's own Uuid.randomUuid() redraws in that case, and so do we.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


class LocalKafkaError(LocalServiceError):
    """The local broker could not be set up or started; the message says what to do."""


@dataclass(frozen=True)
class LocalKafka:
    """Where the local broker keeps its jars, data, pid and log, and which ports it uses.
    Alone by default; a node of a local cluster (local_cluster.py) when `cluster_ports`
    lists the broker ports of all its nodes."""

    home: Path
    port: int = DEFAULT_PORT
    sasl_ssl: bool = False
    node_id: int = 1
    cluster_ports: tuple[int, ...] = ()
    proxy_port: int | None = None

    @classmethod
    def from_env(cls) -> LocalKafka:
        if not sys.platform.startswith("linux"):
            raise LocalKafkaError(
                "the local broker runs on Linux only (it tracks its process through /proc); "
                "elsewhere start Kafka with `docker compose up -d kafka` and point "
                "KAFKA_BOOTSTRAP_SERVERS (tests) or kafka.bootstrap_servers at localhost:9094"
            )
        home = os.environ.get("ONCEFLOW_HOME") or Path.home() / ".cache" / "onceflow"
        port = int(os.environ.get("ONCEFLOW_KAFKA_PORT", DEFAULT_PORT))
        return cls(Path(home), port)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def libs(self) -> Path:
        return self.home / f"kafka-{KAFKA_VERSION}" / "libs"

    @property
    def run_dir(self) -> Path:
        if self.cluster_ports:
            return self.home / f"cluster-{self.cluster_ports[0]}" / f"node-{self.node_id}"
        return self.home / f"broker-{self.port}"

    @property
    def controller_port(self) -> int:
        return self.port + (CLUSTER_CONTROLLER_OFFSET if self.cluster_ports else 1)

    @property
    def proxied_listener_port(self) -> int:
        """Where the listener that is advertised at `proxy_port` listens."""
        return self.port + PROXIED_LISTENER_OFFSET

    @property
    def replicas(self) -> int:
        """Replicas of internal and new topics: 3 in a cluster of 3 or more (min ISR 2)."""
        return min(3, max(1, len(self.cluster_ports)))

    @property
    def pid_file(self) -> Path:
        return self.run_dir / "broker.pid"

    @property
    def log_file(self) -> Path:
        return self.run_dir / "broker.log"

    @property
    def data_dir(self) -> Path:
        return self.run_dir / "data"

    @property
    def config_file(self) -> Path:
        return self.run_dir / "server.properties"

    @property
    def secure_listener(self) -> SecureListener:
        # + 3: the compose file publishes its broker's host listener on 9094.
        return SecureListener(self.run_dir / "sasl_ssl", self.port + 3)

    def _listens_sasl_ssl(self) -> bool:
        """Whether the broker's current configuration has the SASL_SSL listener."""
        try:
            return "SASL_SSL://" in self.config_file.read_text()
        except FileNotFoundError:
            return False

    # -- state -----------------------------------------------------------------------------

    def pid(self) -> int | None:
        """The pid of our broker if its process is alive (a stale pid file counts as none)."""
        return local_process.pid_in(self.pid_file, b"kafka.Kafka")

    def answers(self, timeout: float = 2.0) -> bool:
        """True when a broker on our port answers a metadata request."""
        from confluent_kafka.admin import AdminClient

        if not port_open(self.port):
            return False
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        try:
            return bool(admin.list_topics(timeout=timeout).brokers)
        except Exception:
            return False

    def status(self) -> str:
        pid = self.pid()
        if pid is None:
            if port_open(self.port):
                return f"not running (port {self.port} is taken by another process)"
            return "not running"
        if self.answers():
            secure = ""
            if self._listens_sasl_ssl():
                listener = self.secure_listener
                secure = (
                    f"; SASL_SSL at {listener.bootstrap}, settings in {listener.client_properties}"
                )
            return f"running at {self.bootstrap} (pid {pid}, log {self.log_file}{secure})"
        return f"starting or unhealthy (pid {pid}, not answering yet; log {self.log_file})"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] = print) -> str:
        """Start the broker, or reuse the one already running; returns the bootstrap address."""
        t0 = time.monotonic()
        pid, started = self.launch(progress)
        self._wait_ready(pid, progress)
        if not started:
            progress(f"Kafka is already running at {self.bootstrap} (pid {pid})")
            if self.sasl_ssl:
                self.secure_listener.describe(progress)
            return self.bootstrap
        if self.sasl_ssl:
            self.secure_listener.create_user(self.bootstrap, progress)
        progress(f"Kafka is ready at {self.bootstrap} after {time.monotonic() - t0:.1f}s")
        return self.bootstrap

    def launch(
        self, progress: Callable[[str], None] = print, cluster_id: str | None = None
    ) -> tuple[int, bool]:
        """Start the broker's process without waiting for it (a cluster's nodes answer only
        once a majority of them runs); its pid, and whether it was started here. A new data
        directory is formatted for `cluster_id` (a new id if None)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with locked(self.run_dir / "start.lock"):
            pid = self.pid()
            if pid is not None:
                if self.sasl_ssl and not self._listens_sasl_ssl():
                    raise LocalKafkaError(
                        f"Kafka is already running at {self.bootstrap} (pid {pid}) without "
                        "the SASL_SSL listener; `onceflow kafka stop`, then start it again "
                        "with --sasl-ssl"
                    )
                return pid, False
            if port_open(self.port):
                raise LocalKafkaError(
                    f"port {self.port} is in use by a process that is not onceflow's broker. "
                    "Stop it, or pick another port with ONCEFLOW_KAFKA_PORT=<port>."
                )
            java = require_tool(
                "java", "a Java 17+ runtime (Debian: apt-get install openjdk-17-jre-headless)"
            )
            self.fetch_jars(progress)
            config = self._write_config()
            if not (self.data_dir / "meta.properties").exists():
                self._format(java, config, cluster_id or new_cluster_id())
            progress(f"Starting Apache Kafka {KAFKA_VERSION} on {self.bootstrap} ...")
            with open(self.log_file, "ab") as log:
                proc = subprocess.Popen(
                    [java, "-Xms256m", "-Xmx1g", *self._java_opts(), "kafka.Kafka", str(config)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            self.pid_file.write_text(str(proc.pid))
            return proc.pid, True

    def stop(self, progress: Callable[[str], None] = print) -> bool:
        """Stop our broker; True if one was running. Clean shutdown first, SIGKILL after 30 s."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        local_process.stop(pid, "Kafka", STOP_TIMEOUT_S, progress)
        self.pid_file.unlink(missing_ok=True)
        return True

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would (for fault tests). The pid file stays behind."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            if not wait_exit(pid, local_process.EXIT_WAIT_S):
                raise LocalKafkaError(
                    f"the broker at {self.bootstrap} (pid {pid}) outlived SIGKILL by "
                    f"{local_process.EXIT_WAIT_S:.0f} s; see `ps -L -p {pid}` for what it is "
                    "stuck in"
                )

    def pause(self, paused: bool = True) -> None:
        """SIGSTOP the broker (a hung node: its connections stay open, nothing answers), or
        SIGCONT it."""
        pid = self.pid()
        if pid is None:
            raise LocalKafkaError(f"no broker is running at {self.bootstrap}")
        os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)

    # -- setup -----------------------------------------------------------------------------

    def fetch_jars(self, progress: Callable[[str], None] = print) -> None:
        """Copy the broker's jars from Maven Central into the cache, once, showing progress."""
        marker = self.libs / ".complete"
        if marker.exists():
            return
        mvn = require_tool("mvn", "Apache Maven (Debian: apt-get install maven)")
        build = self.libs.parent / "pom"
        build.mkdir(parents=True, exist_ok=True)
        (build / "pom.xml").write_text(POM)
        progress(f"Fetching Apache Kafka {KAFKA_VERSION} jars from Maven Central into {self.libs}")
        cmd = [
            mvn,
            "-B",
            "-f",
            str(build / "pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={self.libs}",
            "-DincludeScope=runtime",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        tail: list[str] = []
        fetched = 0
        for line in proc.stdout:
            tail = [*tail[-30:], line.rstrip()]
            m = re.match(
                r".*Downloaded from \S+: \S+/([^/]+\.jar) \(([^)]*?)(?: at [^)]*)?\)", line
            )
            if m:
                fetched += 1
                progress(f"  [{fetched:3d}] {m.group(1)} ({m.group(2)})")
        if proc.wait() != 0:
            raise LocalKafkaError(
                "mvn could not fetch the Kafka jars. Check that Maven Central is reachable "
                "(mvn -B dependency:get -Dartifact=org.apache.kafka:kafka_2.13:"
                f"{KAFKA_VERSION}). Last lines of Maven's output:\n" + "\n".join(tail)
            )
        jars = list(self.libs.glob("*.jar"))
        progress(f"Fetched {len(jars)} jars ({_mb(jars):.1f} MB)")
        marker.touch()

    def _java_opts(self) -> list[str]:
        return [
            "-cp",
            f"{self.libs}/*",
            f"-Dlog4j2.configurationFile={self.run_dir / 'log4j2.properties'}",
            "-Djava.awt.headless=true",
        ]

    def _write_config(self) -> Path:
        controller_port = self.controller_port
        voters = [f"1@127.0.0.1:{controller_port}"]
        if self.cluster_ports:
            voters = [
                f"{node}@127.0.0.1:{port + CLUSTER_CONTROLLER_OFFSET}"
                for node, port in enumerate(self.cluster_ports, start=1)
            ]
        replicas, min_isr = self.replicas, max(1, self.replicas - 1)
        listeners = [f"PLAINTEXT://127.0.0.1:{self.port}"]
        advertised = list(listeners)
        protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
        if self.proxy_port is not None:
            listeners.append(f"PROXIED://127.0.0.1:{self.proxied_listener_port}")
            advertised.append(f"PROXIED://127.0.0.1:{self.proxy_port}")
            protocols.append("PROXIED:PLAINTEXT")
        secure: list[str] = []
        if self.sasl_ssl:
            listeners.append(f"SASL_SSL://{self.secure_listener.bootstrap}")
            advertised.append(listeners[-1])
            protocols.append("SASL_SSL:SASL_SSL")
            secure = self.secure_listener.prepare()
        config = self.config_file
        config.touch(mode=0o600)
        config.chmod(0o600)  # before it holds the key store's password
        config.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    f"node.id={self.node_id}",
                    f"controller.quorum.voters={','.join(voters)}",
                    f"listeners={','.join(listeners)},CONTROLLER://127.0.0.1:{controller_port}",
                    f"advertised.listeners={','.join(advertised)}",
                    "controller.listener.names=CONTROLLER",
                    f"listener.security.protocol.map={','.join(protocols)}",
                    "inter.broker.listener.name=PLAINTEXT",
                    *secure,
                    f"log.dirs={self.data_dir}",
                    "num.partitions=1",
                    # A single node can only hold one replica of each topic; a cluster
                    # keeps three, and takes a write when two have it.
                    f"default.replication.factor={replicas}",
                    f"min.insync.replicas={min_isr}",
                    f"offsets.topic.replication.factor={replicas}",
                    f"offsets.topic.num.partitions={INTERNAL_TOPIC_PARTITIONS}",
                    f"transaction.state.log.replication.factor={replicas}",
                    f"transaction.state.log.min.isr={min_isr}",
                    f"transaction.state.log.num.partitions={INTERNAL_TOPIC_PARTITIONS}",
                    f"share.coordinator.state.topic.replication.factor={replicas}",
                    f"share.coordinator.state.topic.min.isr={min_isr}",
                    "group.initial.rebalance.delay.ms=0",
                    # Tests create their topics on purpose; a typo must not create one.
                    "auto.create.topics.enable=false",
                    "",
                ]
            )
        )
        (self.run_dir / "log4j2.properties").write_text(LOG4J2_PROPERTIES)
        return config

    def _format(self, java: str, config: Path, cluster_id: str) -> None:
        result = subprocess.run(
            [
                java,
                *self._java_opts(),
                "kafka.tools.StorageTool",
                "format",
                "-t",
                cluster_id,
                "-c",
                str(config),
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise LocalKafkaError(
                f"formatting the KRaft storage in {self.data_dir} failed; delete that directory "
                f"and try again.\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )

    def _wait_ready(self, pid: int, progress: Callable[[str], None]) -> None:
        local_process.wait_ready(
            lambda: self.answers(1.0),
            pid,
            "Kafka",
            self.log_file,
            START_TIMEOUT_S,
            progress,
            partition_logs_loaded(self.log_file),
        )


def partition_logs_loaded(log: Path) -> Callable[[], str | None]:
    """How far a starting broker is in loading its partitions' logs, from what its log gains
    from now on: a broker with thousands of partitions, after a crash, loads (and recovers)
    them for minutes before it answers."""
    try:
        position = log.stat().st_size
    except OSError:  # no log yet
        position = 0
    loaded: str | None = None

    def news() -> str | None:
        nonlocal position, loaded
        try:
            with open(log, "rb") as fh:
                fh.seek(position)
                gained = fh.read()
        except OSError:
            return loaded
        whole = gained[: gained.rfind(b"\n") + 1]  # a line still being written waits
        position += len(whole)
        if counts := LOADED_LOGS.findall(whole):
            done, total = counts[-1]
            loaded = f"loaded {int(done):,} of {int(total):,} partitions' logs"
        return loaded

    return news


def _mb(paths: list[Path]) -> float:
    return sum(p.stat().st_size for p in paths) / 1e6
