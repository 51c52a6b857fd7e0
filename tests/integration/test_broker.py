"""The broker the tests use is a real Kafka: transactions commit and abort for real."""

import uuid

import pytest
from confluent_kafka import Producer

from onceflow.connectors.topics import read_committed
from tests.helpers import aborted_records_before_an_open_transaction

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
    committed = Producer({**conf, "transactional.id": f"{topic}-committed"})
    committed.init_transactions(30)
    committed.begin_transaction()
    committed.produce(topic, value=b"committed", partition=0)
    committed.commit_transaction(30)  # offsets 0, 1
    with aborted_records_before_an_open_transaction(kafka_bootstrap, topic) as stable_end:
        assert stable_end == 5  # offsets 2-4 aborted
        records = read_committed(kafka_bootstrap, topic, timeout=10)
        assert [m.value() for m in records] == [b"committed"]
