"""Small helpers the integration tests share: producing input and running queries."""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from confluent_kafka import Producer
from pyspark.errors import StreamingQueryException

from onceflow.local_kafka import LocalKafka
from onceflow.pipeline import START_ATTEMPTS, missed_its_start
from onceflow.testing import free_port  # noqa: F401  (the tests' name for it)


def produce(
    bootstrap: str | dict[str, str],
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None, int]],
    transactional: bool = False,
) -> None:
    """Produce (key, value, partition) records and wait until the broker has them all, in the
    order given per partition (idempotence: a retried batch cannot land behind a later one,
    as it can right after a topic is created and its leader is not yet known).

    `bootstrap` is an address, or a librdkafka config (a secured listener's)."""
    client = {"bootstrap.servers": bootstrap} if isinstance(bootstrap, str) else bootstrap
    conf = {**client, "linger.ms": 5, "enable.idempotence": True}
    if transactional:
        conf["transactional.id"] = f"test-producer-{uuid.uuid4()}"
    producer = Producer(conf)
    if transactional:
        producer.init_transactions(30)
        producer.begin_transaction()
    for key, value, partition in records:
        while True:
            try:
                producer.produce(topic, key=key, value=value, partition=partition)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                producer.poll(0.1)
    if transactional:
        producer.commit_transaction(30)
    assert producer.flush(30) == 0


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports that are free now (a broker, its controller,
    ...), below the range the kernel draws clients' ephemeral ports from: a broker stopped
    in a test must find its port free again when it starts, not taken by a client."""
    ephemeral_low = 32768
    with contextlib.suppress(OSError, ValueError):
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        first = random.randrange(10_000, ephemeral_low - count)
        sockets = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise AssertionError(f"found no {count} consecutive free ports")


@contextlib.contextmanager
def own_broker(sasl_ssl: bool = False) -> Iterator[LocalKafka]:
    """A local broker of the test's own (on free ports, the jars from the usual cache), for
    tests that stop it or secure it without touching the broker the suite shares."""
    broker = LocalKafka(LocalKafka.from_env().home, port=free_ports(4), sasl_ssl=sasl_ssl)
    try:
        broker.start(progress=lambda line: None)
        yield broker
    finally:
        try:
            broker.stop(progress=lambda line: None)
        finally:
            shutil.rmtree(broker.run_dir, ignore_errors=True)


def wait_until(condition: Callable[[], bool], timeout: float = 60, what: str = "condition"):
    """Poll `condition` until it holds; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def source_reader(spark, bootstrap: str, topic: str, **options: str):
    reader = (
        spark.readStream.format("onceflow-kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def started(writer):
    """`writer.start()`, with the first epoch planned or the query ended; started again, as
    `onceflow run` does, when it missed its start (Spark's Python source worker was late)."""
    for _ in range(START_ATTEMPTS):
        query = writer.start()
        wait_until(
            lambda q=query: q.lastProgress is not None or not q.isActive,
            300,
            "the query's first epoch or its end",
        )
        if not missed_its_start(query):
            return query
        with contextlib.suppress(StreamingQueryException):
            query.awaitTermination()
    return query


def drain(df, checkpoint: str) -> tuple[list, list]:
    """Run `df` with Trigger.AvailableNow; return (rows in batch order, progress reports).

    Collects through foreachBatch, which (unlike the memory sink) restarts from a checkpoint.
    """
    rows: list = []

    def collect(batch, batch_id: int) -> None:
        rows.extend(batch.collect())

    query = started(
        df.writeStream.foreachBatch(collect)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
    )
    query.awaitTermination(300)
    if query.exception() is not None:
        raise query.exception()
    return rows, query.recentProgress


def processes() -> dict[int, tuple[int, list[bytes]]]:
    """Every process on the machine: pid -> (parent pid, argv), read from /proc."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        found[int(stat.parent.name)] = (parent, command)
    return found


@contextlib.contextmanager
def aborted_records_before_an_open_transaction(bootstrap: str, topic: str) -> Iterator[int]:
    """After what partition 0 of `topic` holds: three records of an aborted transaction,
    then one of another producer's transaction, left open inside. Yields the stable end (the
    open record's offset), waited for: Kafka writes an abort's marker after it answered."""
    from onceflow.connectors import kafka_clients

    conf = {"bootstrap.servers": bootstrap}
    aborted, still_open = (
        Producer({**conf, "transactional.id": f"{topic}-{name}"}) for name in ("aborted", "open")
    )
    for producer in (aborted, still_open):
        producer.init_transactions(30)
        producer.begin_transaction()
    for _ in range(3):
        aborted.produce(topic, value=b"aborted", partition=0)
    aborted.flush(30)
    opened: list[int] = []
    still_open.produce(
        topic, value=b"open", partition=0, on_delivery=lambda _, msg: opened.append(msg.offset())
    )
    still_open.flush(30)
    aborted.abort_transaction(30)  # its marker lands past the open record
    try:
        end = {(topic, 0): opened[0]}
        wait_until(
            lambda: kafka_clients.stable_ends(conf, [(topic, 0)]) == end,
            30,
            "the stable end at the open transaction",
        )
        yield opened[0]
    finally:
        still_open.abort_transaction(30)
