"""A read_committed consumer that watches a pipeline's output while faults happen, as
Kafka's own `transactions_test.py` does: not only what is there at the end, but what a
reader saw on the way (Jepsen's aborted reads: a record visible, then gone)."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable, Hashable

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from onceflow.connectors.topics import read_committed

Seen = dict[tuple[int, int], tuple[bytes | None, bytes | None]]  # (partition, offset) -> record


class LiveChecker:
    """Reads `topic` from its beginning with read_committed until `finish()`.

    `identity(message)` names what must be published once (a window, an input position);
    `order(message)` (optional) gives (group, sequence): within a group, sequences must rise
    in the order a reader sees them in one partition (one key's records of one input
    partition, for a pass-through pipeline)."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        partitions: int,
        identity: Callable[[object], Hashable],
        order: Callable[[object], tuple[Hashable, int]] | None = None,
    ) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.identity, self.order = identity, order
        self.seen: Seen = {}
        self.published: Counter = Counter()
        self.out_of_order: list[str] = []
        self._last: dict[Hashable, int] = {}
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"live-checker-{uuid.uuid4()}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "log_level": 0,
            }
        )
        self._consumer.assign(
            [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)]
        )
        self._thread = threading.Thread(target=self._run, name="live-checker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for message in self._consumer.consume(1000, 0.2):
                if message.error() is not None:
                    continue  # a broker going away: librdkafka reconnects and goes on
                self.seen[(message.partition(), message.offset())] = (
                    message.key(),
                    message.value(),
                )
                self.published[self.identity(message)] += 1
                if self.order is not None:
                    group, sequence = self.order(message)
                    if sequence <= self._last.get(group, -1):
                        self.out_of_order.append(
                            f"{group}: {sequence} after {self._last[group]} "
                            f"(partition {message.partition()}, offset {message.offset()})"
                        )
                    self._last[group] = sequence
        self._consumer.close()

    def finish(self) -> dict:
        """Stop watching; what was seen, against a fresh read_committed read of the topic."""
        self._stop.set()
        self._thread.join(60)
        final = {(m.partition(), m.offset()): (m.key(), m.value()) for m in self._final()}
        vanished = [p for p, record in self.seen.items() if final.get(p) != record]
        duplicates = [name for name, count in self.published.items() if count > 1]
        return {
            "seen_live": len(self.seen),
            "final": len(final),
            "duplicates": duplicates,
            "vanished": vanished,
            "out_of_order": self.out_of_order,
        }

    def _final(self) -> list:
        return read_committed(self.bootstrap, self.topic, timeout=120)
