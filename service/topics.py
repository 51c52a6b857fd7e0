"""Creating topics and reading them back the way a `read_committed` consumer sees them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    IsolationLevel,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec


def admin_client(bootstrap: str, **conf: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap, **conf})


def create_topic(
    bootstrap: str,
    name: str,
    partitions: int = 1,
    config: dict[str, str] | None = None,
    **client_conf: str,
) -> None:
    """Create a topic if it does not exist yet, and wait until its leaders are known."""
    admin = admin_client(bootstrap, **client_conf)
    futures = admin.create_topics([NewTopic(name, partitions, 1, config=config or {})])
    try:
        futures[name].result(30)
    except KafkaException as exc:
        if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
            raise
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        meta = admin.list_topics(name, timeout=5).topics.get(name)
        if (
            meta
            and meta.error is None
            and meta.partitions
            and all(p.leader >= 0 for p in meta.partitions.values())
        ):
            return
        time.sleep(0.1)
    raise TimeoutError(f"topic {name!r} has no leader after 30 s; is the broker healthy?")


def stable_end_offsets(
    admin: AdminClient, partitions: Iterable[TopicPartition]
) -> dict[tuple[str, int], int]:
    """The last stable offset of each partition: how far a read_committed reader can get.

    This is a ListOffsets request with isolation_level=read_committed, not the high watermark:
    records behind an open transaction are not readable yet.
    """
    request = {TopicPartition(tp.topic, tp.partition): OffsetSpec.latest() for tp in partitions}
    if not request:
        return {}
    futures = admin.list_offsets(
        request, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=30
    )
    return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}


def read_committed(bootstrap: str, topic: str, timeout: float = 60.0, **conf: str) -> list:
    """Every committed record of `topic`, in partition order, read up to the current stable end.

    A partition is finished when the consumer *position* reaches the stable end offset, not
    when a record with offset end-1 arrives: transaction markers and aborted records leave gaps.
    """
    admin = admin_client(bootstrap, **conf)
    meta = admin.list_topics(topic, timeout=10).topics[topic]
    if meta.error is not None:
        raise KafkaException(meta.error)
    tps = [TopicPartition(topic, p) for p in sorted(meta.partitions)]
    ends = stable_end_offsets(admin, tps)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"onceflow-reader-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            **conf,
        }
    )
    try:
        pending = [tp for tp in tps if ends[(topic, tp.partition)] > 0]
        consumer.assign([TopicPartition(topic, tp.partition, OFFSET_BEGINNING) for tp in pending])
        records: list = []
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"reading {topic} did not reach the stable end {ends} in {timeout}s"
                )
            for msg in consumer.consume(10000, 0.2):
                if msg.error() is not None:
                    raise KafkaException(msg.error())
                if msg.offset() < ends[(topic, msg.partition())]:
                    records.append(msg)
            positions = consumer.position(pending)
            pending = [p for p in positions if p.offset < ends[(topic, p.partition)]]
        records.sort(key=lambda m: (m.partition(), m.offset()))
        return records
    finally:
        consumer.close()
