"""A local Confluent-compatible schema registry (Apicurio Registry) for development and tests.

Apicurio Registry is on Maven Central as an assembly (a runner jar and its `lib/`), so it is
fetched like the local broker's jars: with Maven, once, into ONCEFLOW_HOME. It answers
Confluent's API at `/apis/ccompat/v7`. Like Confluent's registry it keeps its schemas in a
Kafka topic (Apicurio's `kafkasql` storage), so a schema id means the same as long as the
records that carry it exist: a registry that forgot its ids after a restart would turn every
record written before into a dead letter. Two more settings make it behave like Confluent's:
BACKWARD compatibility by default (Apicurio's own default is NONE) and canonical hashing, so
a schema registered again with other whitespace gets the same id (the same fields in another
order are another schema with another id: `test_schema_registry.py` checks it).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tarfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import local_process
from .local_process import (
    LocalServiceError,
    locked,
    port_open,
    require_tool,
)

REGISTRY_VERSION = "3.0.9"  # 3.1+ needs Java 21; onceflow runs on Java 17
ARTIFACT = f"io.apicurio:apicurio-registry-app:{REGISTRY_VERSION}:tar.gz:all"
ASSEMBLY_MB = 109
DEFAULT_PORT = 8081
API_PATH = "/apis/ccompat/v7"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
# What makes it behave like Confluent's registry (see above); Quarkus reads each one as a
# system property or as an environment variable (`environment()`, for its container image).
# The storage settings come on top (`storage_settings`).
SETTINGS = {
    "apicurio.rules.global.compatibility": "BACKWARD",
    "apicurio.ccompat.use-canonical-hash": "true",
}


def storage_settings(kafka_bootstrap: str) -> dict[str, str]:
    """Schemas kept in Kafka topics (`kafkasql-journal` and friends) at `kafka_bootstrap`."""
    return {
        "apicurio.storage.kind": "kafkasql",
        "apicurio.kafkasql.bootstrap.servers": kafka_bootstrap,
    }


def environment(settings: dict[str, str] = SETTINGS) -> dict[str, str]:
    """Settings as the environment variables Quarkus maps to them (for containers)."""
    return {re.sub(r"[^A-Za-z0-9]", "_", k).upper(): v for k, v in settings.items()}


class LocalRegistryError(LocalServiceError):
    """The local registry could not be set up or started; the message says what to do."""


@dataclass(frozen=True)
class LocalRegistry:
    """Where the local registry keeps its files, pid and log, its port, and the Kafka that
    keeps its schemas."""

    home: Path
    kafka_bootstrap: str
    port: int = DEFAULT_PORT

    @classmethod
    def from_env(cls) -> LocalRegistry:
        """In ONCEFLOW_HOME, on ONCEFLOW_REGISTRY_PORT, its schemas in the Kafka at
        KAFKA_BOOTSTRAP_SERVERS or else the local broker."""
        from .local_kafka import LocalKafka

        broker = LocalKafka.from_env()
        kafka = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or broker.bootstrap
        port = os.environ.get("ONCEFLOW_REGISTRY_PORT", str(DEFAULT_PORT))
        if not port.isdigit():
            raise LocalRegistryError(f"ONCEFLOW_REGISTRY_PORT={port!r} is not a port number")
        return cls(broker.home, kafka, int(port))

    @property
    def url(self) -> str:
        """The URL clients use (a pipeline's `registry.url`)."""
        return f"http://127.0.0.1:{self.port}{API_PATH}"

    @property
    def dist(self) -> Path:
        return self.home / f"apicurio-registry-{REGISTRY_VERSION}"

    @property
    def runner_jar(self) -> Path:
        return self.dist / f"apicurio-registry-app-{REGISTRY_VERSION}-runner.jar"

    @property
    def run_dir(self) -> Path:
        return self.home / f"registry-{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.run_dir / "registry.pid"

    @property
    def log_file(self) -> Path:
        return self.run_dir / "registry.log"

    # -- state -----------------------------------------------------------------------------

    def pid(self) -> int | None:
        """The pid of our registry if its process is alive (a stale pid file counts as none)."""
        return local_process.pid_in(self.pid_file, b"apicurio-registry-app")

    def answers(self, timeout: float = 2.0) -> bool:
        """True when the registry on our port answers Confluent's API."""
        try:
            with urllib.request.urlopen(f"{self.url}/subjects", timeout=timeout) as response:
                return response.status == 200
        except OSError:
            return False

    def status(self) -> str:
        pid = self.pid()
        if pid is None:
            if port_open(self.port):
                return f"not running (port {self.port} is taken by another process)"
            return "not running"
        if self.answers():
            return f"running at {self.url} (pid {pid}, log {self.log_file})"
        return f"starting or unhealthy (pid {pid}, not answering yet; log {self.log_file})"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] = print) -> str:
        """Start the registry, or reuse the one already running; returns its URL."""
        t0 = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with locked(self.run_dir / "start.lock"):
            pid = self.pid()
            started = pid is None
            if started:
                pid = self._launch(progress)
        try:
            self._wait_ready(pid, progress)
        except LocalServiceError:
            if started:  # not left running half-started
                self.stop(progress)
            raise
        if started:
            progress(f"Schema registry is ready at {self.url} after {time.monotonic() - t0:.1f}s")
        else:
            progress(f"Schema registry is already running at {self.url} (pid {pid})")
        return self.url

    def stop(self, progress: Callable[[str], None] = print) -> bool:
        """Stop our registry; True if one was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        local_process.stop(pid, "the schema registry", STOP_TIMEOUT_S, progress)
        self.pid_file.unlink(missing_ok=True)
        return True

    def _launch(self, progress: Callable[[str], None]) -> int:
        if port_open(self.port):
            raise LocalRegistryError(
                f"port {self.port} is in use by a process that is not onceflow's registry. "
                "Stop it, or pick another port with ONCEFLOW_REGISTRY_PORT=<port>."
            )
        java = require_tool(
            "java", "a Java 17+ runtime (Debian: apt-get install openjdk-17-jre-headless)"
        )
        self._require_kafka()
        self.fetch(progress)
        progress(f"Starting Apicurio Registry {REGISTRY_VERSION} on {self.url} ...")
        command = [
            java,
            "-Xmx256m",
            "-Dquarkus.http.host=127.0.0.1",
            f"-Dquarkus.http.port={self.port}",
            *(
                f"-D{key}={value}"
                for key, value in {**SETTINGS, **storage_settings(self.kafka_bootstrap)}.items()
            ),
            "-jar",
            str(self.runner_jar),
        ]
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                command,
                cwd=self.run_dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pid_file.write_text(str(proc.pid))
        return proc.pid

    def _require_kafka(self) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.kafka_bootstrap, "log_level": 0})
        try:
            admin.list_topics(timeout=10)
        except Exception:
            raise LocalRegistryError(
                f"the schema registry keeps its schemas in Kafka at {self.kafka_bootstrap}, "
                "which does not answer: start it first (`onceflow kafka start`), or set "
                "KAFKA_BOOTSTRAP_SERVERS"
            ) from None

    # -- setup -----------------------------------------------------------------------------

    def fetch(self, progress: Callable[[str], None] = print) -> None:
        """Fetch the assembly from Maven Central and unpack it, once, showing progress."""
        marker = self.dist / ".complete"
        if marker.exists():
            return
        mvn = require_tool("mvn", "Apache Maven (Debian: apt-get install maven)")
        self.dist.mkdir(parents=True, exist_ok=True)
        with locked(self.dist.parent / f"{self.dist.name}.lock"):  # registries on two ports
            if not marker.exists():
                self._fetch(mvn, progress)
                marker.touch()

    def _fetch(self, mvn: str, progress: Callable[[str], None]) -> None:
        progress(
            f"Fetching Apicurio Registry {REGISTRY_VERSION} (~{ASSEMBLY_MB} MB) from Maven "
            f"Central into {self.dist}"
        )
        command = [
            mvn,
            "-B",
            "-q",
            "dependency:copy",
            f"-Dartifact={ARTIFACT}",
            f"-DoutputDirectory={self.dist}",
            "-Dtransitive=false",  # its parent pom is not on Maven Central
        ]
        done = threading.Event()
        watcher = threading.Thread(target=self._show_download, args=(done, progress), daemon=True)
        watcher.start()
        try:
            result = subprocess.run(command, capture_output=True, text=True)
        finally:
            done.set()
            watcher.join()
        archives = list(self.dist.glob("*.tar.gz"))
        if result.returncode != 0 or not archives:
            raise LocalRegistryError(
                "mvn could not fetch the schema registry. Check that Maven Central is "
                f"reachable (mvn -B dependency:get -Dtransitive=false -Dartifact={ARTIFACT}). "
                f"Maven's output ends with:\n{(result.stdout + result.stderr)[-2000:]}"
            )
        progress(f"Unpacking {archives[0].name} ...")
        with tarfile.open(archives[0]) as archive:
            if hasattr(tarfile, "data_filter"):  # Python 3.11.4+: nothing outside dist
                archive.extractall(self.dist, filter="data")
            else:
                archive.extractall(self.dist)
        archives[0].unlink()
        if not self.runner_jar.is_file():
            raise LocalRegistryError(
                f"the assembly has no {self.runner_jar.name}; delete {self.dist} and try again"
            )

    def _show_download(self, done: threading.Event, progress: Callable[[str], None]) -> None:
        """Maven in batch mode prints nothing while it downloads: report what has arrived in
        its local repository every 5 s."""
        folder = Path.home() / ".m2" / "repository" / "io" / "apicurio" / "apicurio-registry-app"
        while not done.wait(5):
            with contextlib.suppress(OSError):
                arrived = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6
                progress(f"  {arrived:.0f} of ~{ASSEMBLY_MB} MB")

    def _wait_ready(self, pid: int, progress: Callable[[str], None]) -> None:
        local_process.wait_ready(
            self.answers, pid, "the schema registry", self.log_file, START_TIMEOUT_S, progress
        )
