"""Creating topics and reading them back the way a `read_committed` consumer sees them."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import NewTopic

from . import kafka_clients


def create_topic(
    conf: dict[str, str] | str,
    name: str,
    partitions: int = 1,
    config: dict[str, str] | None = None,
) -> None:
    """Create a topic if it does not exist yet, and wait until its leaders answer for it.

    `conf` is a librdkafka config, or just a bootstrap address.
    """
    conf = _conf(conf)
    _create(conf, NewTopic(name, partitions, -1, config=config or {}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        meta = kafka_clients.admin(conf).list_topics(name, timeout=5).topics.get(name)
        if (
            meta
            and meta.error is None
            and meta.partitions
            and all(p.leader >= 0 for p in meta.partitions.values())
            and _leaders_answer(conf, name, list(meta.partitions))
        ):
            return
        time.sleep(0.1)
    raise TimeoutError(f"topic {name!r} has no leader after 30 s; is the broker healthy?")


def _leaders_answer(conf: dict[str, str], name: str, partitions: list[int]) -> bool:
    """Whether each partition's leader answers an offset look-up: on a cluster, the broker
    that answered the metadata request may know the topic before its leaders do, and a
    leader that does not know it yet answers UNKNOWN_TOPIC_OR_PART."""
    try:
        kafka_clients.high_watermarks(conf, [(name, p) for p in partitions])
    except KafkaException as exc:
        if exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            return False
        raise
    return True


@kafka_clients.kafka_request
def _create(conf: dict[str, str], topic: NewTopic) -> None:
    """One CreateTopics request, retried like a look-up: an answer the client gave up on (a
    controller moving or slow) is asked again, and a topic that exists is what was asked."""
    admin = kafka_clients.admin(conf)
    future = admin.create_topics([topic], request_timeout=kafka_clients.ATTEMPT_TIMEOUT_S)
    try:
        future[topic.topic].result()
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise


def read_committed(conf: dict[str, str] | str, topic: str, timeout: float = 60.0) -> list:
    """Every committed record of `topic`, in partition then offset order, up to the stable end.

    A partition is finished when the consumer *position* reaches the stable end offset, not
    when a record with offset end-1 arrives: transaction markers and aborted records leave gaps.
    Or when its end event comes: aborted records just before another producer's open
    transaction move the position no further (see source.read_range).
    """
    conf = _conf(conf)
    meta = kafka_clients.admin(conf).list_topics(topic, timeout=15).topics[topic]
    if meta.error is not None:
        raise KafkaException(meta.error)
    ends = kafka_clients.stable_ends(conf, [(topic, p) for p in sorted(meta.partitions)])
    consumer = Consumer(
        {
            **kafka_clients.client_conf(conf),
            "group.id": f"onceflow-reader-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        pending = [TopicPartition(t, p, OFFSET_BEGINNING) for (t, p), end in ends.items() if end]
        consumer.assign(pending)
        records: list = []
        at_end: dict[int, int] = {}  # partition -> the offset of its last end event
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} did not reach its stable end in {timeout}s")
            for msg in consumer.consume(10_000, kafka_clients.CONSUME_WAIT_S):
                error = msg.error()
                if error is not None and error.code() == KafkaError._PARTITION_EOF:
                    at_end[msg.partition()] = msg.offset()
                elif error is not None:
                    raise KafkaException(error)
                elif msg.offset() < ends[(topic, msg.partition())]:
                    records.append(msg)
            positions = consumer.position(pending)
            pending = [
                p
                for p in positions
                if max(p.offset, at_end.get(p.partition, -1)) < ends[(topic, p.partition)]
            ]
        records.sort(key=lambda m: (m.partition(), m.offset()))
        return records
    finally:
        consumer.close()


def _conf(conf: dict[str, str] | str) -> dict[str, str]:
    return {"bootstrap.servers": conf} if isinstance(conf, str) else conf
