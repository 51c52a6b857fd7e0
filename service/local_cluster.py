"""A local Apache Kafka cluster: several KRaft nodes (each a broker and a controller, a
controller quorum of all of them) from the same jars as the single local broker.

Node K of a cluster on port P listens for clients on P + K - 1 and for its controllers on
that port + 10, with its own data directory, log and pid under `cluster-P/node-K`. Topics
and Kafka's internal topics get three replicas and take a write when two have it (min ISR 2),
as users run Kafka. Fault tests and users stop, kill or pause single nodes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .local_kafka import (
    INTERNAL_TOPIC_PARTITIONS,
    LocalKafka,
    LocalKafkaError,
    new_cluster_id,
)

DEFAULT_NODES = 3
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LocalCluster:
    home: Path
    port: int
    size: int = DEFAULT_NODES
    # Node K also advertises a listener at proxy_ports[K - 1] (see LocalKafka.proxy_port).
    proxy_ports: tuple[int, ...] = ()

    @classmethod
    def of(cls, home: Path, port: int, size: int | None = None) -> LocalCluster:
        """The cluster on `port`; its size as it was made when `size` is None."""
        recorded = cls(home, port).directory / "nodes"
        if size is None:
            size = int(recorded.read_text()) if recorded.exists() else DEFAULT_NODES
        if size < 2:
            raise LocalKafkaError("a local cluster has at least 2 nodes")
        return cls(home, port, size)

    @property
    def directory(self) -> Path:
        return self.home / f"cluster-{self.port}"

    @property
    def ports(self) -> tuple[int, ...]:
        return tuple(range(self.port, self.port + self.size))

    @property
    def nodes(self) -> list[LocalKafka]:
        return [self.node(k) for k in range(1, self.size + 1)]

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    def node(self, node_id: int) -> LocalKafka:
        if not 1 <= node_id <= self.size:
            raise LocalKafkaError(f"the cluster on port {self.port} has nodes 1-{self.size}")
        port = self.port + node_id - 1
        proxy = self.proxy_ports[node_id - 1] if self.proxy_ports else None
        return LocalKafka(
            self.home, port, node_id=node_id, cluster_ports=self.ports, proxy_port=proxy
        )

    def exists(self) -> bool:
        return (self.directory / "nodes").exists()

    def transaction_coordinator(self, transactional_id: str, bootstrap: str | None = None) -> int:
        """The node that coordinates `transactional_id`'s transactions, as the nodes of
        `bootstrap` (default: all) see it: the one to fail in a test."""
        return self._coordinator("__transaction_state", transactional_id, bootstrap)

    def group_coordinator(self, group_id: str, bootstrap: str | None = None) -> int:
        """The node that coordinates consumer group `group_id` (its committed offsets)."""
        return self._coordinator("__consumer_offsets", group_id, bootstrap)

    def _coordinator(self, topic: str, key: str, bootstrap: str | None) -> int:
        """The leader of `topic`'s partition for `key`, Kafka's `abs(key.hashCode()) %
        partitions` (both internal topics have INTERNAL_TOPIC_PARTITIONS here)."""
        from confluent_kafka.admin import AdminClient

        code = 0
        for char in key:
            code = (31 * code + ord(char)) & 0xFFFFFFFF
        code = code - 2**32 if code >= 2**31 else code
        partition = (0 if code == -(2**31) else abs(code)) % INTERNAL_TOPIC_PARTITIONS
        admin = AdminClient({"bootstrap.servers": bootstrap or self.bootstrap, "log_level": 0})
        return admin.list_topics(topic, timeout=30).topics[topic].partitions[partition].leader

    def running(self) -> list[int]:
        """The ids of the nodes whose process runs."""
        return [node.node_id for node in self.nodes if node.pid() is not None]

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] = print) -> str:
        """Start every node not running (all at once: a node answers only when a majority
        runs) and wait until each is a broker of the cluster; the bootstrap address."""
        t0 = time.monotonic()
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "nodes").write_text(str(self.size))
        cluster_id = self._cluster_id()
        launched = [node.launch(progress, cluster_id) for node in self.nodes]
        for node, (pid, _) in zip(self.nodes, launched, strict=True):
            node._wait_ready(pid, progress)
        self.wait_for_brokers(self.size, progress)
        progress(
            f"Kafka cluster of {self.size} nodes is ready at {self.bootstrap} after "
            f"{time.monotonic() - t0:.1f}s"
        )
        return self.bootstrap

    def start_node(
        self, node_id: int, progress: Callable[[str], None] = print, in_sync: bool = True
    ) -> None:
        """Start one node again (after `stop_node` or a kill), with its data as it was, or
        empty (re-replicated from the others) if its data directory is gone; then wait until
        every replica is in sync (`in_sync`), or only until it is a broker of the cluster
        (a partition whose other replicas are stopped never gets in sync)."""
        node = self.node(node_id)
        pid, _ = node.launch(progress, self._cluster_id())
        node._wait_ready(pid, progress)
        self.wait_for_brokers(len(self.running()), progress)
        if in_sync:
            self.wait_in_sync(progress)

    def stop(self, progress: Callable[[str], None] = print) -> bool:
        """Stop every node at once (cleanly, SIGKILL after 30 s); True if one was running.
        One after another, the last nodes would wait for a controller quorum that the
        first ones took with them."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.size) as pool:  # every node's error raises, not the first
            stopped = list(pool.map(lambda node: node.stop(progress), self.nodes))
        return any(stopped)

    def status(self) -> str:
        lines = [f"node {node.node_id}: {node.status()}" for node in self.nodes]
        return "\n".join(lines)

    def wait_for_brokers(self, count: int, progress: Callable[[str], None] = print) -> None:
        """Until the cluster's metadata lists `count` brokers (a restarted node registers a
        moment after it answers)."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        deadline = time.monotonic() + START_TIMEOUT_S
        seen = 0
        while time.monotonic() < deadline:
            try:
                seen = len(admin.list_topics(timeout=2).brokers)
            except Exception:
                seen = 0
            if seen >= count:
                return
            time.sleep(0.2)
        raise LocalKafkaError(
            f"the cluster on port {self.port} lists {seen} of {count} brokers after "
            f"{START_TIMEOUT_S:.0f}s; see the nodes' logs under {self.directory}, then "
            "`onceflow kafka stop` and start it again"
        )

    def wait_in_sync(self, progress: Callable[[str], None] = print) -> None:
        """Until every replica of every partition is in sync again, as an operator waits
        between the nodes of a rolling restart (stopping the next one sooner leaves some
        partitions below min ISR, refusing writes)."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        deadline = time.monotonic() + START_TIMEOUT_S
        behind: list[str] = []
        while time.monotonic() < deadline:
            try:
                topics = admin.list_topics(timeout=5).topics
            except Exception:
                time.sleep(0.5)
                continue
            behind = [
                f"{name}/{p.id}"
                for name, topic in topics.items()
                for p in topic.partitions.values()
                if len(p.isrs) < len(p.replicas)
            ]
            if not behind:
                return
            time.sleep(0.5)
        raise LocalKafkaError(
            f"{len(behind)} partitions of the cluster on port {self.port} still have replicas "
            f"out of sync after {START_TIMEOUT_S:.0f}s (e.g. {behind[:3]}); see the nodes' "
            f"logs under {self.directory}"
        )

    def _cluster_id(self) -> str:
        path = self.directory / "cluster.id"
        if not path.exists():
            path.write_text(new_cluster_id())
        return path.read_text().strip()
