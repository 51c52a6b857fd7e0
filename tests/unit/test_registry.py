"""The Confluent wire format, the registry client's answers and failures, and decoding
framed values against writer schemas (a registry served over real HTTP on loopback)."""

from __future__ import annotations

import io
import json
import threading
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
        self.fail_next: list[int] = []  # HTTP statuses to answer before the real answer
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
            self._answer(self.server.fail_next.pop(0), {"message": "busy"})
            return
        schema_id = int(self.path.rsplit("/", 1)[-1]) if "/schemas/ids/" in self.path else -1
        if schema_id in self.server.schemas:
            self._answer(200, {"schema": json.dumps(self.server.schemas[schema_id])})
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
def empty_schema_cache() -> Iterator[None]:
    RegistryClient._by_id.clear()
    yield
    RegistryClient._by_id.clear()


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
    assert "hunter2" not in repr(settings) and "s3cret" not in settings.public_url


def test_schemas_by_id_are_fetched_once_and_unknown_ids_are_named(server):
    server.schemas[7] = CLICK_V1
    client = RegistryClient(RegistrySettings(url=server.url, basic_auth_user_info="u:p"))
    assert client.schema_by_id(7) == CLICK_V1
    assert client.schema_by_id(7) == CLICK_V1
    assert [r[1] for r in server.requests] == ["/schemas/ids/7"]
    assert server.requests[0][2] == "Basic dTpw"  # base64 of u:p
    with pytest.raises(registry.UnknownSchemaId, match=f"schema id 8 .* at {server.url}"):
        client.schema_by_id(8)


def test_a_registry_error_is_retried_until_it_answers(server):
    server.schemas[7] = CLICK_V1
    server.fail_next = [503, 500]
    client = RegistryClient(RegistrySettings(url=server.url), retry_budget_s=10)
    assert client.schema_by_id(7) == CLICK_V1
    assert len(server.requests) == 3


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
