"""Output records over the producer's size limit: each becomes a dead letter small enough to
publish (what does not fit is dropped, onceflow's own headers are kept), or, with no
dead-letter topic, is counted and logged as the sink does records of no topic. Never an
epoch that fails again on every restart.

Uses the fake producer of test_publisher.py, whose produce() here refuses a record the way
librdkafka does: MSG_SIZE_TOO_LARGE, raised by produce() itself, when key + value + headers
(with their framing) exceed `message.max.bytes`.
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pytest
from confluent_kafka import KafkaError, KafkaException

from onceflow.connectors import publisher as publishing
from onceflow.connectors.records import (
    HEADER_ERROR,
    HEADER_LATE,
    HEADER_SOURCE,
    OUTPUT_COLUMNS,
    headers_type,
)
from onceflow.connectors.sink import _Records
from tests.unit import test_publisher as harness

broker = harness.broker  # the fixture: fake producers and marker store
LIMIT = 1_000
OVERHEAD = 40  # librdkafka's per-record framing, counted against the limit too
DLQ = "out.dlq"
SOURCE = (HEADER_SOURCE, b"clicks/0/7")


@pytest.fixture
def accepted(broker, monkeypatch) -> list[tuple]:
    """(topic, key, value, headers) of every record produce() accepted."""
    original = harness.FakeProducer.produce
    records: list[tuple] = []

    def produce(self, topic, value=None, key=None, partition=None, headers=None, **kw):
        limit = int(self.config.get("message.max.bytes", 1_000_000))
        framed = sum(len(name) + len(v or b"") + 2 for name, v in headers or [])
        if OVERHEAD + len(key or b"") + len(value or b"") + framed > limit:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        records.append((topic, key, value, headers))
        return original(self, topic, value, key, partition, headers, **kw)

    monkeypatch.setattr(harness.FakeProducer, "produce", produce)
    return records


def publisher(kind: str, dead_letter_topic: str | None = DLQ) -> publishing.EpochPublisher:
    conf = {"bootstrap.servers": "fake:9092", "message.max.bytes": str(LIMIT)}
    publisher_class = {
        "exactly_once": publishing.TransactionalPublisher,
        "at_least_once": publishing.AtLeastOncePublisher,
    }[kind]
    return publisher_class(conf, harness.SINK, harness.MARKERS, dead_letter_topic)


def dead_letters(accepted: list[tuple]) -> list[tuple]:
    return [(key, value, headers) for topic, key, value, headers in accepted if topic == DLQ]


def error_of(headers: list[tuple]) -> str:
    return [v for name, v in headers if name == HEADER_ERROR][-1].decode()


@pytest.mark.parametrize("kind", ["exactly_once", "at_least_once"])
def test_a_record_whose_key_alone_is_too_large_is_a_dead_letter_without_its_key(
    broker, accepted, kind
):
    big_key = b"k" * 2_000
    published = publisher(kind).publish(
        0, "q", [("out", None, big_key, b"v", [("trace", b"t1"), SOURCE])], harness.OFFSETS
    )

    assert published and broker.marker is not None and broker.marker.batch_id == 0
    [(key, value, headers)] = dead_letters(accepted)
    assert (key, value) == (None, None)
    assert headers[:2] == [("trace", b"t1"), SOURCE]  # the headers fit: kept
    error = error_of(headers)
    assert "value (1 bytes)" in error and "key (2000 bytes)" in error, error
    assert f"limit of {LIMIT} bytes" in error, error
    assert not [c for c in broker.calls if c[1] == "abort"]  # published in one attempt


def test_a_record_whose_headers_alone_are_too_large_keeps_its_key_and_onceflows_headers(
    broker, accepted
):
    big_headers = [("trace", b"t" * 2_000), (HEADER_ERROR, b"value is not JSON"), SOURCE]
    publisher("exactly_once").publish(
        0, "q", [("out", None, b"user-1", b"v", big_headers)], harness.OFFSETS
    )

    assert broker.marker is not None
    [(key, value, headers)] = dead_letters(accepted)
    assert (key, value) == (b"user-1", None)
    assert headers[:2] == [(HEADER_ERROR, b"value is not JSON"), SOURCE]
    error = error_of(headers)
    assert "headers (" in error and "key" not in error.split("dropped")[-1], error


def test_a_record_whose_key_and_headers_are_too_large_keeps_only_onceflows_headers(
    broker, accepted
):
    big = [("trace", b"t" * 800), SOURCE]  # each of key and headers too large with the error
    publisher("exactly_once").publish(
        0, "q", [("out", None, b"k" * 800, b"v" * 5_000, big)], harness.OFFSETS
    )

    [(key, value, headers)] = dead_letters(accepted)
    assert (key, value) == (None, None)
    assert headers[0] == SOURCE and len(headers) == 2
    error = error_of(headers)
    for dropped in ("value (5000 bytes)", "key (800 bytes)", "headers ("):
        assert dropped in error, error


def test_a_record_too_large_for_its_value_keeps_its_key_and_headers(broker, accepted):
    publisher("exactly_once").publish(
        0, "q", [("out", None, b"user-1", b"v" * 5_000, [SOURCE])], harness.OFFSETS
    )

    [(key, value, headers)] = dead_letters(accepted)
    assert (key, value, headers[0]) == (b"user-1", None, SOURCE)
    error = error_of(headers)
    assert "value (5000 bytes)" in error and "key" not in error.split("dropped")[-1], error


def test_onceflow_headers_too_large_themselves_leave_the_input_position(broker, accepted):
    forged = [(HEADER_ERROR, b"e" * 2_000), SOURCE]  # set upstream, not by this pipeline
    publisher("exactly_once").publish(0, "q", [("out", None, b"k", b"v", forged)], harness.OFFSETS)

    [(key, value, headers)] = dead_letters(accepted)
    assert (key, value, headers[0], len(headers)) == (b"k", None, SOURCE, 2)
    assert "headers (2014 bytes)" in error_of(headers)


def test_with_no_dead_letter_topic_a_plain_epoch_logs_the_record_left_out(broker, accepted, caplog):
    with caplog.at_level(logging.WARNING, logger="onceflow.sink"):
        publisher("exactly_once", dead_letter_topic=None).publish(
            0, "q", [("out", None, b"k", b"v" * 5_000, [SOURCE])], harness.OFFSETS
        )

    assert broker.marker is not None and broker.marker.records == 0
    [warning] = [r.getMessage() for r in caplog.records if "not published" in r.getMessage()]
    assert "at clicks/0/7" in warning and "sink.dead_letter_topic is not set" in warning
    assert f"limit of {LIMIT} bytes" in warning, warning


def _results(*rows: tuple) -> pa.Table:
    """A task's result records as the sink hands them to the publisher."""
    columns = dict(zip(OUTPUT_COLUMNS, zip(*rows, strict=True), strict=True))
    headers = [[{"key": k, "value": v} for k, v in h or []] for h in columns["headers"]]
    return pa.table(
        {
            "topic": pa.array(columns["topic"], pa.string()),
            "partition": pa.array(columns["partition"], pa.int32()),
            "key": pa.array(columns["key"], pa.binary()),
            "value": pa.array(columns["value"], pa.binary()),
            "headers": pa.array(headers, headers_type(pa)),
        }
    )


def test_with_no_dead_letter_topic_a_record_too_large_is_counted_and_logged_as_dropped(
    broker, accepted, caplog
):
    records = _Records(
        [
            _results(
                ("out", None, b"k1", b"v" * 5_000, [SOURCE]),
                ("out", None, b"k2", b"fine", [(HEADER_SOURCE, b"clicks/0/8")]),
            )
        ],
        batch_id=0,
    )
    epoch = publishing.Epoch(0, "q", harness.OFFSETS, records)

    with caplog.at_level(logging.WARNING, logger="onceflow.sink"):
        assert publisher("exactly_once", dead_letter_topic=None).publish_epoch(epoch)

    assert [(t, k) for t, k, _v, _h in accepted if t == "out"] == [("out", b"k2")]
    assert broker.marker is not None and broker.marker.records == 1
    assert +records.counts == {"result": 1, "dropped_dead_letter": 1}  # not 2 results
    [warning] = [r.getMessage() for r in caplog.records if "not published" in r.getMessage()]
    assert "1 dead-letter records not published" in warning, warning
    assert "sink.dead_letter_topic is not set" in warning and "clicks/0 offsets 7" in warning
    assert f"limit of {LIMIT} bytes" in warning, warning


def test_an_oversized_result_published_as_a_dead_letter_is_counted_as_one(broker, accepted):
    """The sink counts records as it yields them; the publisher tells it when one went out
    as something else."""
    records = _Records(
        [
            _results(
                ("out", None, b"k1", b"v" * 5_000, [SOURCE]),
                ("out", None, b"k2", b"fine", [(HEADER_SOURCE, b"clicks/0/8")]),
            )
        ],
        batch_id=0,
    )
    assert publisher("exactly_once").publish_epoch(
        publishing.Epoch(0, "q", harness.OFFSETS, records)
    )
    assert len(dead_letters(accepted)) == 1
    assert +records.counts == {"result": 1, "dead_letter": 1}


def test_an_oversized_result_that_passes_on_an_inputs_late_headers_is_counted_as_a_result(
    broker, accepted
):
    """A job that re-reads a late topic passes its records' headers on: the sink knows what
    it yielded, the headers do not say."""
    passed_on = [(HEADER_LATE, b"true"), (HEADER_SOURCE, b"clicks/0/9")]
    records = _Records([_results(("out", None, b"k1", b"v" * 5_000, passed_on))], batch_id=0)
    assert publisher("exactly_once", dead_letter_topic=None).publish_epoch(
        publishing.Epoch(0, "q", harness.OFFSETS, records)
    )
    assert +records.counts == {"dropped_dead_letter": 1}
