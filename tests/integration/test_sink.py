"""The transactional sink against a real broker: exactly-once across crashes, fencing, aborts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from onceflow.connectors.markers import last_marker, marker_topic_for
from onceflow.connectors.publisher import (
    AtLeastOncePublisher,
    CheckpointMismatchError,
    FencedError,
    TransactionalPublisher,
)
from onceflow.connectors.topics import read_committed
from tests.helpers import drain, produce, source_reader, started, wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
INPUT_RECORDS = 3000


def run_passthrough(
    bootstrap, source, sink, checkpoint, app, fault=None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("ONCEFLOW_SERVICE_PGID", None)
    if fault:
        env["ONCEFLOW_FAULT"] = fault
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.apps.passthrough",
            "--bootstrap",
            bootstrap,
            "--source",
            source,
            "--sink",
            sink,
            "--checkpoint",
            checkpoint,
            "--app",
            app,
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,  # its own process group, which a fault point kills
    )


@pytest.fixture
def passthrough_input(kafka_bootstrap, new_topic):
    source = new_topic(partitions=3, prefix="in")
    values = [f"record-{i}".encode() for i in range(INPUT_RECORDS)]
    produce(kafka_bootstrap, source, ((str(i).encode(), v, i % 3) for i, v in enumerate(values)))
    return source, values


CRASH_POINTS = ("before_prepare", "after_prepare", "before_kafka_commit", "after_kafka_commit")
# CI kills before the prepare step (no fault-suite CI test does) and before the Kafka commit
# (the fault suite's CI run does for at-least-once only); `--long` at every point. Between
# the two suites' CI runs every point is killed at least once.
CI_CRASH_POINTS = ("before_prepare", "before_kafka_commit")


def pytest_generate_tests(metafunc) -> None:
    if "crash_point" in metafunc.fixturenames:
        long = metafunc.config.getoption("--long")
        metafunc.parametrize("crash_point", CRASH_POINTS if long else CI_CRASH_POINTS)


def test_exactly_once_across_a_crash(
    kafka_bootstrap, new_topic, passthrough_input, tmp_path, crash_point
):
    fault = f"{crash_point}@2"
    source, values = passthrough_input
    sink = new_topic(partitions=2, prefix="out")
    checkpoint, app = str(tmp_path / "ck"), f"crash-{uuid.uuid4().hex[:8]}"

    crashed = run_passthrough(kafka_bootstrap, source, sink, checkpoint, app, fault)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    before = Counter(m.value() for m in read_committed(kafka_bootstrap, sink))
    assert set(before.values()) == {1} and set(before) < set(values)
    # The crash hit batch 2: its output is visible only if Kafka committed it. Settle the
    # transaction the crash left open, as the restart's init_transactions does, then look.
    from confluent_kafka import Producer

    conf, txn_id = {"bootstrap.servers": kafka_bootstrap}, f"onceflow-{app}-{sink}"
    Producer({**conf, "transactional.id": txn_id}).init_transactions(30)
    marker = last_marker(conf, marker_topic_for(txn_id), txn_id, wait_s=30)
    assert marker.batch_id == (2 if fault.startswith("after_kafka_commit") else 1)

    restarted = run_passthrough(kafka_bootstrap, source, sink, checkpoint, app)
    assert restarted.returncode == 0, restarted.stderr[-3000:]

    output = Counter(m.value() for m in read_committed(kafka_bootstrap, sink))
    assert output == Counter(values), "output differs from input: loss or duplicates"


def test_a_zombie_with_the_same_transactional_id_is_fenced(kafka_bootstrap, new_topic):
    sink = new_topic(prefix="out")
    conf = {"bootstrap.servers": kafka_bootstrap}
    txn_id, markers = f"zombie-{uuid.uuid4().hex[:8]}", f"markers-{uuid.uuid4().hex[:8]}"
    zombie = TransactionalPublisher(conf, txn_id, markers)
    assert zombie.publish(0, "q1", [(sink, None, b"k", b"from-zombie-0", None)], [])

    successor = TransactionalPublisher(conf, txn_id, markers)
    assert not successor.publish(0, "q1", [(sink, None, b"k", b"replayed-0", None)], [])
    assert successor.publish(1, "q1", [(sink, None, b"k", b"from-successor-1", None)], [])

    with pytest.raises(FencedError, match=txn_id):
        zombie.publish(1, "q1", [(sink, None, b"k", b"from-zombie-1", None)], [])
    expected = [b"from-zombie-0", b"from-successor-1"]
    wait_until(  # the last stable offset can trail commit_transaction for a moment
        lambda: [m.value() for m in read_committed(kafka_bootstrap, sink)] == expected, 30
    )


def test_an_epoch_aborted_inside_its_transaction_is_never_visible(kafka_bootstrap, new_topic):
    sink = new_topic(prefix="out")
    conf = {"bootstrap.servers": kafka_bootstrap}
    publisher = TransactionalPublisher(conf, f"abort-{uuid.uuid4().hex[:8]}", f"m-{uuid.uuid4()}")

    def bad_records():
        yield (sink, None, None, b"half-published", None)
        raise RuntimeError("a record of this epoch cannot be encoded")

    class Epoch:
        def __iter__(self):
            return bad_records()

    with pytest.raises(RuntimeError):
        publisher.publish(0, "q", Epoch(), [])
    assert publisher.publish(0, "q", [(sink, None, None, b"retried", None)], [])
    wait_until(  # the last stable offset can trail commit_transaction for a moment
        lambda: [m.value() for m in read_committed(kafka_bootstrap, sink)] == [b"retried"], 30
    )


def test_sink_without_app_id_fails_naming_the_option(spark, kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic()
    produce(kafka_bootstrap, topic, [(None, b"x", 0)])
    df = source_reader(spark, kafka_bootstrap, topic).selectExpr("value")
    with pytest.raises(Exception, match="needs option 'appId'"):
        started(
            df.writeStream.format("onceflow-kafka")
            .option("kafka.bootstrap.servers", kafka_bootstrap)
            .option("topic", topic)
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True)
        ).awaitTermination()
    assert drain  # the shared helper module stays imported for the other tests


def test_a_tombstone_on_the_marker_key_lets_an_app_start_over(kafka_bootstrap, new_topic):
    from confluent_kafka import Producer

    sink = new_topic(prefix="out")
    conf = {"bootstrap.servers": kafka_bootstrap}
    txn_id, markers = f"reset-{uuid.uuid4().hex[:8]}", f"markers-{uuid.uuid4().hex[:8]}"
    assert TransactionalPublisher(conf, txn_id, markers).publish(
        0, "q1", [(sink, None, None, b"a", None)], []
    )
    with pytest.raises(CheckpointMismatchError):
        TransactionalPublisher(conf, txn_id, markers).publish(
            0, "q2", [(sink, None, None, b"b", None)], []
        )

    producer = Producer(conf)
    producer.produce(markers, key=txn_id.encode(), value=None)
    producer.flush(30)
    assert TransactionalPublisher(conf, txn_id, markers).publish(
        0, "q2", [(sink, None, None, b"c", None)], []
    )
    # commit_transaction returns before the coordinator has written every commit marker, so
    # the last stable offset can trail it for a moment: poll for the committed records.
    wait_until(
        lambda: [m.value() for m in read_committed(kafka_bootstrap, sink)] == [b"a", b"c"],
        30,
        "the restarted app's record",
    )


def test_at_least_once_publishes_without_a_transaction_and_still_skips_marked_replays(
    kafka_bootstrap, new_topic
):
    sink = new_topic(prefix="out")
    conf = {"bootstrap.servers": kafka_bootstrap}
    sink_id, markers = f"alo-{uuid.uuid4().hex[:8]}", f"markers-{uuid.uuid4().hex[:8]}"
    publisher = AtLeastOncePublisher(conf, sink_id, markers)
    assert publisher.publish(0, "q", [(sink, None, None, b"a", None)], [])
    assert publisher.stats.transactions_committed == 0
    # Delivered means visible at once: no transaction, so no commit marker to wait for.
    assert [m.value() for m in read_committed(kafka_bootstrap, sink)] == [b"a"]

    restarted = AtLeastOncePublisher(conf, sink_id, markers)
    assert not restarted.publish(0, "q", [(sink, None, None, b"replayed", None)], [])
    assert restarted.publish(1, "q", [(sink, None, None, b"b", None)], [])
    assert [m.value() for m in read_committed(kafka_bootstrap, sink)] == [b"a", b"b"]


@pytest.mark.parametrize("fault", ["commit_outcome_unknown@2", "commit_abortable@2"])
def test_a_failed_commit_is_settled_by_the_marker_not_retried_blindly(
    kafka_bootstrap, new_topic, passthrough_input, tmp_path, fault
):
    """The Kafka commit of batch 2 fails once: after it committed (a timeout: outcome
    unknown), or before (an abortable error). Either way the epoch is published once."""
    source, values = passthrough_input
    sink = new_topic(partitions=2, prefix="out")
    app = f"commit-{uuid.uuid4().hex[:8]}"
    result = run_passthrough(kafka_bootstrap, source, sink, str(tmp_path / "ck"), app, fault)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 2: commit failed" in result.stderr  # the fault did fire, in batch 2
    assert "a new producer settles the transaction" in result.stderr
    output = Counter(m.value() for m in read_committed(kafka_bootstrap, sink))
    assert output == Counter(values), "output differs from input: loss or duplicates"


def test_a_marker_behind_another_apps_open_transaction_is_still_read(kafka_bootstrap, new_topic):
    """Apps share the marker topic; a read_committed reader stops at the first open
    transaction, which would hide this app's newer marker and let its replay publish again."""
    import threading

    from confluent_kafka import Producer

    sink = new_topic(prefix="out")
    conf = {"bootstrap.servers": kafka_bootstrap}
    app, markers = f"app-{uuid.uuid4().hex[:8]}", f"markers-{uuid.uuid4().hex[:8]}"
    publisher = TransactionalPublisher(conf, app, markers)
    assert publisher.publish(0, "q", [(sink, None, None, b"a0", None)], [])
    other = Producer({**conf, "transactional.id": f"other-{uuid.uuid4().hex[:8]}"})
    other.init_transactions(30)
    other.begin_transaction()
    other.produce(markers, key=b"other-app", value=b"{}")
    assert other.flush(30) == 0  # an open transaction on the marker topic
    assert publisher.publish(1, "q", [(sink, None, None, b"a1", None)], [])  # behind it
    threading.Timer(2.0, lambda: other.commit_transaction(30)).start()  # settles in 2 s

    restarted = TransactionalPublisher(conf, app, markers)
    assert not restarted.publish(1, "q", [(sink, None, None, b"a1-again", None)], [])
    wait_until(
        lambda: [m.value() for m in read_committed(kafka_bootstrap, sink)] == [b"a0", b"a1"],
        30,
        "each epoch once",
    )
