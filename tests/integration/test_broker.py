"""The broker the tests use is a real Kafka: transactions commit and abort for real."""

import uuid

import pytest
from confluent_kafka import Producer

from onceflow.connectors.topics import read_committed

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
