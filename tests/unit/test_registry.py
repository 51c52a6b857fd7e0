"""The Confluent wire format, the registry client's answers and failures, and decoding
framed values against writer schemas (a registry served over real HTTP on loopback)."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastavro import parse_schema, schemaless_writer

from onceflow.connectors import registry
from onceflow.connectors.errors import RegistryRefusedError, RegistryUnreachableError
from onceflow.connectors.registry import RegistryClient, RegistrySettings
from onceflow.formats import decode_avro

CLICK_V1 = {
    "type": "record",
    "name": "Click",
    "fields": [{"name": "user", "type": "string"}, {"name": "ts", "type": "long"}],
}
# v2 adds a field with a default: BACKWARD compatible, readers of v1 skip it.
CLICK_V2 = {
    **CLICK_V1,
    "fields": [*CLICK_V1["fields"], {"name": "page", "type": "string", "default": "/"}],
}
OTHER = {"type": "record", "name": "Other", "fields": [{"name": "n", "type": "int"}]}


def avro(schema: dict, record: dict) -> bytes:
    out = io.BytesIO()
    schemaless_writer(out, parse_schema(schema), record)
    return out.getvalue()


class FakeRegistryServer(ThreadingHTTPServer):
    """A registry over real HTTP: schemas by id, and a queue of failures to answer first."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.schemas: dict[int, dict] = {}
        self.extra: dict[int, dict] = {}  # more of an id's answer: schemaType, references
        self.versions: dict[tuple[str, int], dict] = {}  # (subject, version) -> schema
        self.fail_next: list[int] = []  # HTTP statuses to answer before the real answer
        self.html = 0  # answer every request with an HTML page and this status
        self.requests: list[tuple[str, str, str | None]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeRegistryServer

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", registry.CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.requests.append(("GET", self.path, self.headers.get("Authorization")))
        if self.server.fail_next:
            status = self.server.fail_next.pop(0)
            self._answer(status, {"message": "busy", "error_code": status * 100 + 3})
            return
        if self.server.html:  # not a registry: a login page, a proxy, another service
            body = b"<html>sign in</html>"
            self.send_response(self.server.html)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        parts = self.path.split("?")[0].strip("/").split("/")
        if parts[:2] == ["schemas", "ids"] and int(parts[2]) in self.server.schemas:
            schema_id = int(parts[2])
            schema = json.dumps(self.server.schemas[schema_id])
            self._answer(200, {"schema": schema, **self.server.extra.get(schema_id, {})})
        elif parts[0] == "subjects" and (parts[1], int(parts[3])) in self.server.versions:
            self._answer(200, {"schema": json.dumps(self.server.versions[parts[1], int(parts[3])])})
        else:
            self._answer(404, {"error_code": 40403, "message": "Schema not found"})

    def do_POST(self) -> None:
        self.server.requests.append(("POST", self.path, self.headers.get("Authorization")))
        self._answer(409, {"error_code": 409, "message": "Schema being registered is incompatible"})


@pytest.fixture
def server() -> Iterator[FakeRegistryServer]:
    server = FakeRegistryServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def empty_schema_cache(monkeypatch) -> Iterator[None]:
    monkeypatch.setattr(registry, "UNKNOWN_ID_GRACE_S", 1.5)
    RegistryClient._by_id.clear()
    RegistryClient._unknown_until.clear()
    yield
    RegistryClient._by_id.clear()
    RegistryClient._unknown_until.clear()


def test_a_framed_value_is_magic_byte_schema_id_then_the_body():
    value = registry.frame(258, b"body")
    assert value == b"\x00\x00\x00\x01\x02body"
    assert registry.unframe(value) == (258, b"body")


@pytest.mark.parametrize("value", [b'{"user": "a"}', b"\x00\x00\x01", b""])
def test_a_value_without_the_frame_is_refused_saying_what_it_starts_with(value):
    with pytest.raises(ValueError, match="not in the Confluent wire format") as caught:
        registry.unframe(value)
    assert (f"0x{value[0]:02x}" if value else "nothing") in str(caught.value)


def test_credentials_never_show_in_the_url_or_the_repr():
    settings = RegistrySettings(
        url="https://alice:s3cret@registry.example:8081/apis/ccompat/v7",
        basic_auth_user_info="bob:hunter2",
    )
    assert settings.public_url == "https://registry.example:8081/apis/ccompat/v7"
    shown = repr(settings)
    assert "hunter2" not in shown and "s3cret" not in shown and "s3cret" not in settings.public_url


def test_schemas_by_id_are_fetched_once_and_unknown_ids_are_named(server):
    server.schemas[7] = CLICK_V1
    client = RegistryClient(RegistrySettings(url=server.url, basic_auth_user_info="u:p"))
    assert client.schema_by_id(7) == [CLICK_V1]
    assert client.schema_by_id(7) == [CLICK_V1]
    assert [r[1] for r in server.requests] == ["/schemas/ids/7"]
    assert server.requests[0][2] == "Basic dTpw"  # base64 of u:p
    with pytest.raises(registry.WriterSchemaError, match=f"schema id 8 .* at {server.url}"):
        client.schema_by_id(8)
    asked = len(server.requests)
    assert asked > 2, "a 404 is asked again during the grace"
    with pytest.raises(registry.WriterSchemaError):
        client.schema_by_id(8)
    assert len(server.requests) == asked, "an unknown id is remembered, not asked again"


def test_an_id_another_replica_has_not_applied_yet_is_read_not_dead_lettered(server):
    """A registry with several replicas can answer 404 for an id a producer was just given."""
    server.schemas[7] = CLICK_V1
    server.fail_next = [404, 404]
    value = registry.frame(7, avro(CLICK_V1, {"user": "a", "ts": 1}))
    settings = RegistrySettings(url=server.url)
    fields, reasons = decode_avro(json.dumps(CLICK_V1), ("user",), [value], settings)
    assert reasons == [None] and fields["user"].to_pylist() == ["a"]


def test_values_that_only_look_framed_cost_a_bounded_time_each_batch(server):
    """Plain Avro starting with a 0 byte reads as the wire format with a different "id" per
    record: each is a dead letter, without seconds of asking per record."""
    settings = RegistrySettings(url=server.url)
    values = [registry.frame(1000 + i, b"\x02a") for i in range(60)]
    started = time.monotonic()
    _, reasons = decode_avro(json.dumps(CLICK_V1), ("user",), values, settings)
    assert time.monotonic() - started < 10
    asked = [r for r in reasons if "not asked" not in r]
    assert len(asked) == registry.UNKNOWN_IDS_ASKED
    assert all("is not in the registry at" in r for r in reasons)
    assert "are its values in the Confluent wire format?" in reasons[-1]
    assert len(server.requests) < registry.UNKNOWN_IDS_ASKED + 5  # the grace is spent once


def test_a_writer_schema_with_references_is_read_with_them(server):
    address = {
        "type": "record",
        "name": "Address",
        "namespace": "dev.test",
        "fields": [{"name": "city", "type": "string"}],
    }
    order = {
        "type": "record",
        "name": "Order",
        "namespace": "dev.test",
        "fields": [{"name": "id", "type": "long"}, {"name": "to", "type": "dev.test.Address"}],
    }
    server.schemas[9] = order
    server.extra[9] = {
        "references": [{"name": "dev.test.Address", "subject": "address", "version": 1}]
    }
    server.versions["address", 1] = address
    body = io.BytesIO()
    named: dict = {}
    parse_schema(address, named_schemas=named)
    schemaless_writer(
        body, parse_schema(order, named_schemas=named), {"id": 3, "to": {"city": "Oslo"}}
    )
    reader = {**order, "fields": [order["fields"][0]]}  # reads the id only
    settings = RegistrySettings(url=server.url)
    fields, reasons = decode_avro(
        json.dumps(reader), ("id",), [registry.frame(9, body.getvalue())], settings
    )
    assert reasons == [None] and fields["id"].to_pylist() == [3]


def test_a_schema_that_is_not_avro_makes_a_dead_letter_saying_so(server):
    server.schemas[4] = {"syntax": "proto3"}
    server.extra[4] = {"schemaType": "PROTOBUF"}
    value = registry.frame(4, b"\x08\x01")
    settings = RegistrySettings(url=server.url)
    _, reasons = decode_avro(json.dumps(CLICK_V1), ("user",), [value], settings)
    assert reasons == ["schema id 4 is a PROTOBUF schema, not Avro"]


def test_a_registry_error_is_retried_until_it_answers(server):
    server.schemas[7] = CLICK_V1
    server.fail_next = [503, 429, 500]
    client = RegistryClient(RegistrySettings(url=server.url), retry_budget_s=10)
    assert client.schema_by_id(7) == [CLICK_V1]
    assert len(server.requests) == 4


@pytest.mark.parametrize("status", [200, 404])
def test_a_url_that_is_not_a_registry_fails_the_run_instead_of_dead_lettering(server, status):
    """An HTML page, or a 404 without the registry's error code, is the wrong URL: every
    record would otherwise become a dead letter."""
    server.html = status
    value = registry.frame(7, avro(CLICK_V1, {"user": "a", "ts": 1}))
    settings = RegistrySettings(url=server.url)
    with pytest.raises(RegistryRefusedError, match="/apis/ccompat/v7"):
        decode_avro(json.dumps(CLICK_V1), ("user",), [value], settings)
    with pytest.raises(RegistryRefusedError, match="Confluent-compatible"):
        RegistryClient(settings).check()


def test_a_registry_that_does_not_answer_fails_naming_its_url_without_credentials(server):
    port = server.server_address[1]
    server.shutdown()
    server.server_close()  # nothing listens there any more
    settings = RegistrySettings(url=f"http://me:s3cret@127.0.0.1:{port}")
    client = RegistryClient(settings, retry_budget_s=0.5)
    with pytest.raises(RegistryUnreachableError) as caught:
        client.schema_by_id(1)
    message = str(caught.value)
    assert f"http://127.0.0.1:{port} did not answer within 0.5s" in message
    assert "s3cret" not in message


def test_an_incompatible_schema_is_refused_with_the_registrys_words(server):
    client = RegistryClient(RegistrySettings(url=server.url))
    with pytest.raises(RegistryRefusedError, match="HTTP 409 .*incompatible"):
        client.register("clicks-value", CLICK_V2)


def test_framed_values_resolve_from_their_writer_schema_to_the_readers(server):
    """Producers switch to v2 mid-stream: a v1 reader reads both; a v2 reader fills the
    default into v1 records. Foreign bytes, unknown ids and bad bodies get a reason each."""
    server.schemas |= {1: CLICK_V1, 2: CLICK_V2, 3: OTHER}
    settings = RegistrySettings(url=server.url)
    values = [
        registry.frame(1, avro(CLICK_V1, {"user": "a", "ts": 1})),
        registry.frame(2, avro(CLICK_V2, {"user": "b", "ts": 2, "page": "/x"})),
        b'{"user": "c"}',  # JSON, not framed
        registry.frame(99, avro(CLICK_V1, {"user": "d", "ts": 4})),  # id not in the registry
        registry.frame(1, b"\x02"),  # a body cut short
        registry.frame(3, avro(OTHER, {"n": 5})),  # a schema that does not resolve to Click
        None,
    ]
    fields, reasons = decode_avro(json.dumps(CLICK_V1), ("user", "ts"), values, settings)
    assert fields["user"].to_pylist() == ["a", "b", None, None, None, None, None]
    assert fields["ts"].to_pylist() == [1, 2, None, None, None, None, None]
    assert reasons[:2] == [None, None]
    assert "not in the Confluent wire format" in reasons[2]
    assert f"schema id 99 is not in the registry at {server.url}" in reasons[3]
    assert reasons[4].startswith("value is not Avro of writer schema id 1 'Click'")
    assert reasons[5].startswith("writer schema id 3 does not resolve to the reader schema")
    assert reasons[6] == "record value is null"

    fields, reasons = decode_avro(json.dumps(CLICK_V2), ("user", "page"), values[:2], settings)
    assert fields["page"].to_pylist() == ["/", "/x"] and reasons == [None, None]


def test_decoding_fails_the_epoch_when_the_registry_does_not_answer(server):
    """A record whose writer schema cannot be fetched is not a dead letter: it may be fine."""
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    settings = RegistrySettings(url=f"http://127.0.0.1:{port}")
    value = registry.frame(1, avro(CLICK_V1, {"user": "a", "ts": 1}))
    original = RegistryClient.__init__

    def short_budget(self, settings, retry_budget_s=0.3):
        original(self, settings, retry_budget_s)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RegistryClient, "__init__", short_budget)
        with pytest.raises(RegistryUnreachableError):
            decode_avro(json.dumps(CLICK_V1), ("user",), [value], settings)


def test_a_restart_discards_what_a_failed_attempt_staged_before_the_replay(
    server, tmp_path, monkeypatch
):
    """Attempt 1 staged a record as a dead letter (its id was not found yet), then the run
    died before the epoch committed; the replay decodes it, maybe in another task (another
    parallelism). What attempt 1 staged must be gone before the query starts again, or the
    record would be published twice: as a dead letter and in the query's results."""
    import types

    import pyarrow as pa
    from pyspark import TaskContext

    from onceflow import runner
    from onceflow.connectors import staging
    from onceflow.connectors.checkpoint import CheckpointDir
    from onceflow.routing import RoutePlan, route

    checkpoint = tmp_path / "ck"
    (checkpoint / "offsets").mkdir(parents=True)
    (checkpoint / "offsets" / "0").write_text(
        'v1\n{"batchWatermarkMs":0,"batchTimestampMs":0}\n{"in":{"0":1}}'
    )

    class Task:  # what route asks of Spark's TaskContext
        def getLocalProperty(self, name):
            return "0" if name == "streaming.sql.batchId" else None

        def partitionId(self):
            return 0

    monkeypatch.setattr(TaskContext, "get", staticmethod(lambda: Task()))
    plan = RoutePlan(
        checkpoint=str(checkpoint),
        source="input",
        format="avro-confluent",
        fields=("user", "ts"),
        required=(),
        event_time_field="ts",
        dead_letter_topic="dlq",
        late_topic=None,
        avro_schema_json=json.dumps(CLICK_V1),
        registry=RegistrySettings(url=server.url),
    )
    value = registry.frame(7, avro(CLICK_V1, {"user": "a", "ts": 1}))
    batch = pa.RecordBatch.from_pydict(
        {
            "_key": pa.array([b"a"]),
            "_value": pa.array([value]),
            "_topic": pa.array(["in"]),
            "_partition": pa.array([0], pa.int32()),
            "_offset": pa.array([0], pa.int64()),
            "_timestamp": pa.array([1000], pa.timestamp("us")),
            "_headers": pa.array(
                [[]], pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
            ),
        }
    )
    staged = lambda: [  # noqa: E731
        t.num_rows
        for t in staging.staged_tables(
            CheckpointDir(checkpoint), CheckpointDir(checkpoint).batch_plan(0)
        )
    ]

    assert list(route(plan, None, iter([batch]))) == []  # id 7 not in the registry yet
    assert staged() == [1]

    class Started(Exception):
        pass

    def start(*args):
        raise Started

    monkeypatch.setattr(runner.pipeline, "start", start)  # the restart, up to its query's start
    config = types.SimpleNamespace(checkpoint_location=str(checkpoint), app_id="app")
    with pytest.raises(Started):
        runner._run_query(None, config, True, None, None, None)
    assert staged() == [], "the failed attempt's dead letter is still staged"

    server.schemas[7] = CLICK_V1  # the replay, in a new process, finds the id
    RegistryClient._unknown_until.clear()
    assert [b.num_rows for b in route(plan, None, iter([batch]))] == [1]
    assert staged() == []


def test_a_batch_decodes_alike_whether_or_not_the_process_had_its_ids_cached(server):
    """An epoch whose results were published and which is replayed (a crash before Spark's
    commit log) rebuilds its state from what the batch decodes: a valid record that came after
    20 unknown ids decoded in the process that had its id cached and was a dead letter in a
    fresh one (lost from the window, or counted there and published as a dead letter)."""
    server.schemas[7] = CLICK_V1
    settings = RegistrySettings(url=server.url)
    valid = registry.frame(7, avro(CLICK_V1, {"user": "a", "ts": 1}))
    garbage = [registry.frame(1000 + i, b"\x02a") for i in range(registry.UNKNOWN_IDS_ASKED)]
    batch = [valid, *garbage, valid, registry.frame(8, b"")]
    schema = json.dumps(CLICK_V1)
    RegistryClient(settings).schema_by_id(7)  # cached by an earlier batch of this process
    _, warm = decode_avro(schema, ("user",), [*garbage, valid], settings)
    RegistryClient._by_id.clear()  # a fresh process, the replay's
    RegistryClient._unknown_until.clear()
    _, cold = decode_avro(schema, ("user",), [*garbage, valid], settings)
    assert warm == cold
    assert "not asked" in cold[-1]
    _, reasons = decode_avro(schema, ("user",), batch, settings)
    assert reasons[0] is None and reasons[-2] is None, "an id the batch read stays readable"
    assert "not asked" in reasons[-1]
