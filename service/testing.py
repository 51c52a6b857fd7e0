"""onceflow's pytest plugin: test a pipeline file on a real Kafka, as it runs in production.

Installed with onceflow (a `pytest11` entry point), it gives every test of the project:
- `onceflow_kafka`: a broker's bootstrap address: KAFKA_BOOTSTRAP_SERVERS if set, else an
  `apache/kafka` container when a Docker engine answers, else onceflow's local broker (jars
  from Maven Central), stopped at the end only if this session started it;
- `onceflow_registry`: a schema registry's URL, chosen the same way (SCHEMA_REGISTRY_URL, an
  Apicurio Registry container, or `onceflow registry`);
- `onceflow_run`: runs a pipeline file on given input records with `--available-now`, on
  fresh topics and a fresh checkpoint, and returns what it published (`Published`);
and `assert_published`, which compares published records with expected ones as multisets and
names the duplicates, the missing and the unexpected ones by key.

Runs share the test process' Spark session (started by the first, ~5 s): a pipeline's
`spark.conf` settings that Spark can change at run time carry over to later runs, and those
it cannot are those of the first run.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import socket
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from onceflow.connectors.records import HEADER_ERROR, HEADER_SOURCE

from .local_kafka import KAFKA_VERSION, LocalKafka
from .local_registry import API_PATH, REGISTRY_VERSION, LocalRegistry, environment

# The settings a one-node apache/kafka container needs for transactions (as in compose).
KAFKA_CONTAINER_ENV = {
    "KAFKA_NODE_ID": "1",
    "KAFKA_PROCESS_ROLES": "broker,controller",
    "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
    "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
    "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
    "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093",
    "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
    "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
    "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
}
# An input record: a value (bytes, text, or a dict encoded in the source's format), a
# (key, value) pair, or (key, value, partition).
InputRecord = bytes | str | dict | tuple
# The records of a pipeline's one input, or of each of its named inputs (`sources:`).
InputRecords = Iterable[InputRecord] | Mapping[str, Iterable[InputRecord]]


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """A record the pipeline could not use: its value, and the `onceflow.error` reason."""

    value: bytes | None
    reason: str
    source: str  # topic/partition/offset of the input record


@dataclasses.dataclass(frozen=True)
class Published:
    """What one run published, read with `read_committed`: results decoded (JSON and
    avro-confluent values as dicts, others as bytes), dead letters, and late records (their
    values decoded like the input's)."""

    results: list
    dead_letters: list[DeadLetter]
    late: list


# -- fixtures ----------------------------------------------------------------------------------


def docker_engine_answers() -> bool:
    """True only when a Docker engine (not just the client) responds to a ping."""
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def onceflow_kafka() -> Iterator[str]:
    """A Kafka broker's bootstrap address for the test session."""
    if bootstrap := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield bootstrap
        return
    if docker_engine_answers():
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.waiting_utils import wait_for_logs

        port = free_port()
        container = DockerContainer(f"apache/kafka:{KAFKA_VERSION}").with_bind_ports(9092, port)
        for key, value in {
            **KAFKA_CONTAINER_ENV,
            "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{port}",
        }.items():
            container = container.with_env(key, value)
        with container:
            wait_for_logs(container, "Kafka Server started", timeout=120)
            yield f"127.0.0.1:{port}"
        return
    broker = LocalKafka.from_env()
    started_here = broker.pid() is None
    bootstrap = broker.start()
    yield bootstrap
    if started_here:
        broker.stop()


@pytest.fixture(scope="session")
def onceflow_registry(onceflow_kafka: str) -> Iterator[str]:
    """A Confluent-compatible schema registry's URL for the test session."""
    if url := os.environ.get("SCHEMA_REGISTRY_URL"):
        yield url
        return
    if docker_engine_answers():
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.waiting_utils import wait_for_logs

        port = free_port()
        image = f"apicurio/apicurio-registry:{REGISTRY_VERSION}"
        container = DockerContainer(image).with_bind_ports(8080, port)
        for key, value in environment().items():  # schemas in memory: the container's life
            container = container.with_env(key, value)
        with container:
            wait_for_logs(container, "Installed features", timeout=120)
            yield f"http://127.0.0.1:{port}{API_PATH}"
        return
    registry = dataclasses.replace(LocalRegistry.from_env(), kafka_bootstrap=onceflow_kafka)
    started_here = registry.pid() is None
    url = registry.start()
    yield url
    if started_here:
        registry.stop()


@pytest.fixture
def onceflow_run(onceflow_kafka: str, tmp_path: Path, request) -> Callable[..., Published]:
    """`onceflow_run(pipeline, records, partitions=1)`: run the pipeline file (or a dict of
    its settings) on `records` (a list, or a mapping of input name to list for a pipeline
    with `sources:`) and return what it published. A pipeline that reads or writes
    avro-confluent gets the session's registry."""

    def run(pipeline: str | Path | dict, records: InputRecords, partitions: int = 1):
        registry = None
        if "avro-confluent" in json.dumps(_raw(pipeline)):
            registry = request.getfixturevalue("onceflow_registry")
        runs = len(list(tmp_path.glob("run-*")))
        return run_pipeline(
            pipeline,
            records,
            bootstrap=onceflow_kafka,
            workdir=tmp_path / f"run-{runs}",
            registry_url=registry,
            partitions=partitions,
        )

    return run


# -- running a pipeline on given records -------------------------------------------------------


def run_pipeline(
    pipeline: str | Path | dict,
    records: InputRecords,
    *,
    bootstrap: str,
    workdir: Path,
    registry_url: str | None = None,
    partitions: int = 1,
) -> Published:
    """Run `pipeline` on `records` with `--available-now` in this process, on topics and a
    checkpoint of its own, and read back what it published.

    The file's topics, app id, checkpoint, Kafka settings and metrics port are replaced for
    the test (Kafka settings by `bootstrap` alone: a production file's credentials do not
    apply to the test broker); what it computes is unchanged.
    """
    from onceflow.config import parse, resolve_references
    from onceflow.connectors.topics import create_topic
    from onceflow.runner import run

    raw = _raw(pipeline)
    base_dir = Path(pipeline).resolve().parent if not isinstance(pipeline, dict) else Path.cwd()
    suffix = uuid.uuid4().hex[:8]
    sink = raw.setdefault("sink", {})
    blocks = raw["sources"].values() if "sources" in raw else [raw.setdefault("source", {})]
    for source in blocks:
        topics = source.get("topics")
        topics = [topics] if isinstance(topics, str) else topics
        source["topics"] = [f"{t}-{suffix}" for t in topics]
        source["starting_offsets"] = "earliest"
    for name in ("topic", "dead_letter_topic", "late_topic"):
        if sink.get(name):
            sink[name] = f"{sink[name]}-{suffix}"
    raw["app_id"] = f"{raw.get('app_id', 'test')}-{suffix}"
    raw["kafka"] = {"bootstrap_servers": bootstrap}
    raw["checkpoint"] = {**(raw.get("checkpoint") or {}), "location": str(workdir / "checkpoint")}
    raw["metrics"] = {**(raw.get("metrics") or {}), "port": 0}
    raw["spark"] = {**(raw.get("spark") or {}), "master": "local[2]"}
    if registry_url:
        raw["registry"] = {"url": registry_url}
    config = parse(resolve_references(raw, os.environ), base_dir=base_dir)  # ${NAME}s left
    inputs = [t for source in config.sources for t in source.topics]
    for topic in {*inputs, sink["topic"]}:
        create_topic(bootstrap, topic, partitions)
    for name in ("dead_letter_topic", "late_topic"):
        if sink.get(name):
            create_topic(bootstrap, sink[name], 1)
    sources = {source.name: source for source in config.sources}
    if not isinstance(records, Mapping) and len(sources) > 1:
        raise ValueError(
            f"the pipeline has inputs {sorted(sources)}: pass the records as a mapping of "
            "input name to records, e.g. {'clicks': [...], 'users': [...]}"
        )
    by_input = records if isinstance(records, Mapping) else {config.source.name: records}
    unknown = sorted(set(by_input) - set(sources))
    if unknown:
        raise ValueError(f"records for {unknown}; the pipeline's inputs are {sorted(sources)}")
    for name, given in by_input.items():
        source = sources[name]
        encode = _input_encoder(config, source)
        _produce(bootstrap, source.topics[0], given, encode, partitions)
    run(config, available_now=True)
    return _published(config, bootstrap)


def _raw(pipeline: str | Path | dict) -> dict:
    if isinstance(pipeline, dict):
        return copy.deepcopy(pipeline)
    return yaml.safe_load(Path(pipeline).read_text())


def _input_encoder(config, source) -> Callable[[Any], bytes | None]:
    """How a dict value becomes the bytes the input `source` reads, in its format."""
    fmt = source.format
    if fmt == "json" or fmt == "raw":
        return lambda record: json.dumps(record).encode()
    from fastavro import parse_schema, schemaless_writer

    from onceflow.config import load_avro_schema
    from onceflow.connectors import registry

    schema = load_avro_schema(config, source)
    parsed = parse_schema(schema)
    schema_id = None
    if fmt == "avro-confluent":
        subject = f"{source.topics[0]}-value"
        schema_id = registry.client_for(config.registry).register(subject, schema)

    def encode(record: dict) -> bytes:
        body = io.BytesIO()
        schemaless_writer(body, parsed, record)
        return body.getvalue() if schema_id is None else registry.frame(schema_id, body.getvalue())

    return encode


def _produce(bootstrap: str, topic: str, records: Iterable, encode, partitions: int) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for i, record in enumerate(records):
        key, value, partition = None, record, i % partitions
        if isinstance(record, tuple):
            key, value, *rest = record
            partition = rest[0] if rest else partition
        if isinstance(value, dict):
            value = encode(value)
        elif isinstance(value, str):
            value = value.encode()
        key = key.encode() if isinstance(key, str) else key
        producer.produce(topic, key=key, value=value, partition=partition)
    if producer.flush(30) != 0:
        raise RuntimeError(f"could not produce the input records to {topic} within 30 s")


def _published(config, bootstrap: str) -> Published:
    from onceflow.connectors.topics import read_committed

    sink = config.sink
    decode_result = _result_decoder(config)
    results = [decode_result(m.value()) for m in read_committed(bootstrap, sink.topic)]
    dead = []
    if sink.dead_letter_topic:
        for m in read_committed(bootstrap, sink.dead_letter_topic):
            headers = {k: (v or b"").decode() for k, v in m.headers() or []}
            reason, source = headers.get(HEADER_ERROR, ""), headers.get(HEADER_SOURCE, "")
            dead.append(DeadLetter(m.value(), reason, source))
    late = []
    if sink.late_topic:
        late = [_maybe_json(m.value()) for m in read_committed(bootstrap, sink.late_topic)]
    return Published(results, dead, late)


def _result_decoder(config) -> Callable[[bytes | None], Any]:
    if config.sink.format == "avro-confluent":
        from fastavro import schemaless_reader

        from onceflow.connectors import registry
        from onceflow.formats import parsed_with_references

        client = registry.client_for(config.registry)

        def decode(value: bytes | None):
            schema_id, body = registry.unframe(value or b"")
            schemas = json.dumps(client.schema_by_id(schema_id), sort_keys=True)
            return schemaless_reader(io.BytesIO(body), parsed_with_references(schemas), None)

        return decode
    if config.sink.format == "avro":
        return lambda value: value
    return _maybe_json


def _maybe_json(value: bytes | None):
    try:
        return json.loads(value) if value is not None else None
    except ValueError:
        return value


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- comparing ---------------------------------------------------------------------------------


def multiset(records: Iterable) -> Counter:
    """Records as a multiset: dicts by their canonical JSON, so that order does not matter
    but a record published twice counts twice."""
    return Counter(_canonical(r) for r in records)


def assert_published(
    published: Iterable, expected: Iterable, key: str | Callable[[Any], Any] | None = "key"
) -> None:
    """Fail unless `published` and `expected` hold the same records the same number of
    times; the message names, by key, each record published too often, missing, or not
    expected at all."""
    got, want = multiset(published), multiset(expected)
    if got == want:
        return
    key_of = key if callable(key) else (lambda r: r.get(key) if isinstance(r, dict) else None)
    problems = []
    for item, extra in sorted((got - want).items()):
        record = json.loads(item)
        kind = f"published {extra} more time(s) than expected" if item in want else "not expected"
        problems.append(f"  key {key_of(record)!r}: {kind}: {item}")
    for item, short in sorted((want - got).items()):
        record = json.loads(item)
        problems.append(f"  key {key_of(record)!r}: missing ({short} of {want[item]}): {item}")
    raise AssertionError(
        f"published records differ from the expected ones ({sum(got.values())} published, "
        f"{sum(want.values())} expected):\n" + "\n".join(problems)
    )


def _canonical(record: Any) -> str:
    if isinstance(record, bytes | bytearray):
        return json.dumps({"bytes": bytes(record).hex()})
    if dataclasses.is_dataclass(record):
        record = dataclasses.asdict(record)
    return json.dumps(record, sort_keys=True, default=_plain)


def _plain(value: Any) -> str:
    return value.hex() if isinstance(value, bytes) else str(value)
