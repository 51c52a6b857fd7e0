"""The broker the tests use is a real Kafka: transactions commit and abort for real."""

import uuid

import pytest
from confluent_kafka import Producer

from onceflow.connectors import kafka_clients
from onceflow.connectors.topics import read_committed
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def test_read_committed_sees_only_the_committed_transaction(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=2)
    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"tx-{uuid.uuid4()}"}
    )
    producer.init_transactions(30)

    producer.begin_transaction()
    for i in range(10):
        producer.produce(
            topic, key=str(i).encode(), value=f"committed-{i}".encode(), partition=i % 2
        )
    producer.commit_transaction(30)

    producer.begin_transaction()
    for i in range(10):
        producer.produce(topic, key=str(i).encode(), value=f"aborted-{i}".encode(), partition=i % 2)
    producer.flush(30)
    producer.abort_transaction(30)

    values = sorted(m.value().decode() for m in read_committed(kafka_bootstrap, topic))
    assert values == sorted(f"committed-{i}" for i in range(10))


def test_read_committed_ends_at_aborted_records_before_another_producers_open_transaction(
    kafka_bootstrap, new_topic
):
    """`onceflow verify` beside a running pipeline: the stable end stops at the open
    transaction, and the aborted records just before it move the position no further (none
    is delivered; their abort marker lies past the stable end). The end event says the read
    is done; it used to wait for its 60 s timeout."""
    topic = new_topic(partitions=1)
    conf = {"bootstrap.servers": kafka_bootstrap}
    committed, aborted, still_open = (
        Producer({**conf, "transactional.id": f"{topic}-{name}"}) for name in ("c", "a", "o")
    )
    for producer in (committed, aborted, still_open):
        producer.init_transactions(30)
        producer.begin_transaction()
    committed.produce(topic, value=b"committed", partition=0)
    committed.commit_transaction(30)  # offsets 0, 1
    for _ in range(3):  # offsets 2-4
        aborted.produce(topic, value=b"aborted", partition=0)
    aborted.flush(30)
    still_open.produce(topic, value=b"open", partition=0)  # offset 5
    still_open.flush(30)
    aborted.abort_transaction(30)  # its marker at offset 6
    try:
        # Kafka writes the abort's marker after it answered the abort.
        wait_until(
            lambda: kafka_clients.stable_ends(conf, [(topic, 0)]) == {(topic, 0): 5},
            30,
            "the stable end at the open transaction",
        )
        records = read_committed(kafka_bootstrap, topic, timeout=10)
        assert [m.value() for m in records] == [b"committed"]
    finally:
        still_open.abort_transaction(30)
