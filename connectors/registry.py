"""A Confluent-compatible Schema Registry: the wire format and the few calls onceflow makes.

A value in the Confluent wire format is a magic byte 0, the writer schema's id (4 bytes, big
endian), then the Avro body written with that schema. Readers fetch the writer schema by id
(ids never change meaning, so it is cached for the life of the process), with the schemas it
references, and resolve it to their own reader schema, which is how producers evolve a
schema mid-stream. An id the registry does not know is asked again for a few seconds before
the record is given up as a dead letter: a registry with several replicas can answer 404 for
an id another replica gave a producer a moment ago.

The client is urllib with timeouts: a registry that does not answer is retried with backoff
and then raises RegistryUnreachableError naming the URL, which fails the epoch (and the run)
rather than dropping a record. Credentials never appear in a message or a repr.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from functools import cache
from http.client import HTTPException
from typing import Any, ClassVar

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from .errors import RegistryRefusedError, RegistryUnreachableError

MAGIC_BYTE = 0
HEADER_BYTES = 5  # the magic byte and the schema id
REQUEST_TIMEOUT_S = 10.0
RETRY_BUDGET_S = 30.0
UNKNOWN_ID_GRACE_S = 5.0  # how long 404s for ids are asked again, per batch of records
UNKNOWN_IDS_ASKED = 20  # unknown ids asked about per batch; the others are dead letters
UNKNOWN_ID_REMEMBERED_S = 60.0  # then records with that id are dead letters without asking
UNKNOWN_IDS_KEPT = 10_000  # at most, in that memory
CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class WriterSchemaError(LookupError):
    """The record's writer schema cannot be had (an id the registry does not know, a schema
    that is not Avro): the record is a dead letter, with this message as its reason."""


@dataclass
class UnknownIdBudget:
    """What one batch of records may spend on ids the registry does not know. Values that
    only look framed (plain Avro starting with a 0 byte: a null, a 0, an empty string) carry
    a different "id" each; without a budget each would cost seconds of asking.

    Once UNKNOWN_IDS_ASKED ids of the batch were found unknown, every id the batch has not
    read yet is refused, even one this process has cached: what a batch decodes must not
    depend on what the process had cached, since a replayed epoch whose results were
    published already must rebuild the same state."""

    grace_s: float = field(default_factory=lambda: UNKNOWN_ID_GRACE_S)
    unknown: set[int] = field(default_factory=set)  # ids of this batch the registry lacks
    known: set[int] = field(default_factory=set)  # ids this batch has read

    @property
    def spent(self) -> bool:
        return len(self.unknown) >= UNKNOWN_IDS_ASKED


class _Retriable(Exception):
    """No answer, a 5xx, a timeout (408) or too many requests (429): worth another attempt."""


# A 404 whose error code says the id (or, in Apicurio's legacy id mode, its subject) is
# unknown; any other 404 means the URL is not a registry's API.
UNKNOWN_ID_CODES = (40403, 40401)
RETRIED_STATUSES = (408, 429)


@dataclass(frozen=True)
class RegistrySettings:
    """Where the registry is and how to authenticate; pickled to executors, never printed."""

    url: str = field(repr=False)  # shown as `public_url`
    basic_auth_user_info: str | None = field(default=None, repr=False)  # "user:password"
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None
    ssl_key_password: str | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"RegistrySettings({self.public_url!r})"

    @property
    def public_url(self) -> str:
        """The URL without any user:password in it, for messages."""
        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc)).rstrip("/")


@cache
def client_for(settings: RegistrySettings) -> RegistryClient:
    """One client per settings and process (its TLS context is loaded once)."""
    return RegistryClient(settings)


def frame(schema_id: int, body: bytes) -> bytes:
    """A value in the Confluent wire format."""
    return bytes([MAGIC_BYTE]) + schema_id.to_bytes(4, "big") + body


def unframe(value: bytes) -> tuple[int, bytes]:
    """(schema id, Avro body) of a framed value; ValueError saying what is wrong otherwise."""
    if len(value) < HEADER_BYTES or value[0] != MAGIC_BYTE:
        first = f"0x{value[0]:02x}" if value else "nothing"
        raise ValueError(
            f"value is not in the Confluent wire format: it starts with {first} and is "
            f"{len(value)} bytes long (expected a magic byte 0x00, a 4-byte schema id, then Avro)"
        )
    return int.from_bytes(value[1:HEADER_BYTES], "big"), value[HEADER_BYTES:]


class RegistryClient:
    """Schemas by id (cached), a subject's latest version, and registration."""

    # Per process: an id's schemas never change meaning; an unknown id is remembered a while.
    _by_id: ClassVar[dict[tuple[str, int], list[dict]]] = {}
    _unknown_until: ClassVar[dict[tuple[str, int], float]] = {}
    _lock = threading.Lock()

    def __init__(self, settings: RegistrySettings, retry_budget_s: float = RETRY_BUDGET_S) -> None:
        self.settings = settings
        self.retry_budget_s = retry_budget_s
        self._base = settings.url.rstrip("/")
        self._context = self._ssl_context()

    def schema_by_id(self, schema_id: int, budget: UnknownIdBudget | None = None) -> list[dict]:
        """The writer schema with this id, last, after the schemas it references (each before
        the ones that use it); WriterSchemaError if there is no Avro schema with this id.
        `budget` bounds what ids the registry does not know may cost (one per call if None)."""
        key = (self._base, schema_id)
        budget = budget or UnknownIdBudget()
        missing = f"schema id {schema_id} is not in the registry at {self.settings.public_url}"
        if budget.spent and schema_id not in budget.known:
            raise WriterSchemaError(
                f"{missing} (not asked: {UNKNOWN_IDS_ASKED} ids of this batch are not in the "
                "registry; are its values in the Confluent wire format?)"
            )
        with self._lock:
            schemas = self._by_id.get(key)
            unknown = self._unknown_until.get(key, 0.0) > time.monotonic()
        if schemas is None and unknown:
            budget.unknown.add(schema_id)
            raise WriterSchemaError(missing)
        if schemas is None:
            answer = self._schema_answer(schema_id, budget)
            if answer is None:
                budget.unknown.add(schema_id)
                self._remember_unknown(key)
                raise WriterSchemaError(missing)
            schemas = [*self._referenced(answer, set()), self._avro(answer, f"id {schema_id}")]
            with self._lock:
                self._by_id[key] = schemas
        budget.known.add(schema_id)
        return schemas

    def _schema_answer(self, schema_id: int, budget: UnknownIdBudget) -> dict | None:
        """The registry's answer for an id, or None when it says 404 until the budget's grace
        is spent (another replica may not have applied an id a producer was just given)."""
        pause = 0.2
        while True:
            status, answer = self._call("GET", f"/schemas/ids/{schema_id}")
            code = answer.get("error_code") if isinstance(answer, dict) else None
            if status != 404 or code not in UNKNOWN_ID_CODES:
                self._refused_unless_ok(status, answer, f"reading schema id {schema_id}")
                return answer
            if pause > budget.grace_s:
                return None
            time.sleep(pause)
            budget.grace_s -= pause
            pause *= 2

    def _remember_unknown(self, key: tuple[str, int]) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._unknown_until) >= UNKNOWN_IDS_KEPT:
                for old in [k for k, until in self._unknown_until.items() if until <= now]:
                    del self._unknown_until[old]
                if len(self._unknown_until) >= UNKNOWN_IDS_KEPT:
                    self._unknown_until.clear()
            self._unknown_until[key] = now + UNKNOWN_ID_REMEMBERED_S

    def _referenced(self, answer: dict, seen: set[tuple[str, int]]) -> list[dict]:
        """The schemas `answer` references, recursively, each before the ones that use it."""
        schemas: list[dict] = []
        for reference in answer.get("references") or []:
            subject, version = reference["subject"], int(reference["version"])
            if (subject, version) in seen:
                continue
            seen.add((subject, version))
            quoted = urllib.parse.quote(subject, safe="")
            # A soft-deleted version still resolves the records written with it (as
            # Confluent's own client asks).
            path = f"/subjects/{quoted}/versions/{version}?deleted=true"
            status, found = self._call("GET", path)
            what = f"version {version} of {subject!r}, referenced by a writer schema"
            self._refused_unless_ok(status, found, f"reading {what}")
            schemas += [*self._referenced(found, seen), self._avro(found, what)]
        return schemas

    def _avro(self, answer: Any, what: str) -> dict:
        if not isinstance(answer, dict) or not isinstance(answer.get("schema"), str):
            raise RegistryRefusedError(
                f"the schema registry at {self.settings.public_url} answered for schema {what} "
                f"without a schema ({str(answer)[:200]}); check that registry.url is a "
                "Confluent-compatible API (Apicurio's ends with /apis/ccompat/v7)"
            )
        kind = answer.get("schemaType") or "AVRO"  # Confluent leaves it out for Avro
        if kind != "AVRO":
            raise WriterSchemaError(f"schema {what} is a {kind} schema, not Avro")
        try:
            return json.loads(answer["schema"])
        except ValueError as exc:
            raise WriterSchemaError(f"schema {what} is not JSON: {exc}") from None

    def check(self) -> None:
        """Ask the registry for its subjects: RegistryRefusedError when the URL answers but is
        not a registry's API (a wrong path would turn every record into a dead letter)."""
        status, answer = self._call("GET", "/subjects")
        if status in (401, 403):
            self._refused_unless_ok(status, answer, "listing its subjects")
        if status == 200 and isinstance(answer, list):
            return
        raise RegistryRefusedError(
            f"{self.settings.public_url} is not a Confluent-compatible schema registry API "
            f"(GET /subjects answered HTTP {status}); check registry.url (Apicurio's ends with "
            "/apis/ccompat/v7)"
        )

    def latest(self, subject: str) -> tuple[int, dict] | None:
        """The latest (id, schema) registered under `subject`, or None if it has none."""
        path = f"/subjects/{urllib.parse.quote(subject, safe='')}/versions/latest"
        status, answer = self._call("GET", path)
        if status == 404:
            return None
        self._refused_unless_ok(status, answer, f"reading the latest schema of {subject!r}")
        return int(answer["id"]), json.loads(answer["schema"])

    def register(self, subject: str, schema: dict) -> int:
        """Register `schema` under `subject` (or find it there); its id. RegistryRefusedError
        with the registry's message when it is incompatible with the subject's versions."""
        path = f"/subjects/{urllib.parse.quote(subject, safe='')}/versions"
        status, answer = self._call("POST", path, {"schema": json.dumps(schema)})
        self._refused_unless_ok(status, answer, f"registering a schema under {subject!r}")
        return int(answer["id"])

    # -- HTTP ------------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(HTTP status, JSON answer); no answer or a 5xx is retried with backoff."""
        attempts = Retrying(
            retry=retry_if_exception_type(_Retriable),
            stop=stop_after_delay(self.retry_budget_s),
            wait=wait_exponential(multiplier=0.2, max=5),
            reraise=True,
        )
        try:
            return attempts(self._attempt, method, path, body)
        except _Retriable as exc:
            raise RegistryUnreachableError(
                f"the schema registry at {self.settings.public_url} did not answer within "
                f"{self.retry_budget_s:g}s ({exc}); check that it runs and that this host can "
                "reach it (registry.url, and registry.ssl_* for TLS)"
            ) from None

    def _attempt(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self._base + path, data=data, method=method)
        request.add_header("Accept", CONTENT_TYPE)
        if data is not None:
            request.add_header("Content-Type", CONTENT_TYPE)
        if self.settings.basic_auth_user_info:
            token = base64.b64encode(self.settings.basic_auth_user_info.encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(
                request, timeout=REQUEST_TIMEOUT_S, context=self._context
            ) as response:
                return response.status, self._json(response.read(), path)
        except urllib.error.HTTPError as exc:
            if exc.code >= 500 or exc.code in RETRIED_STATUSES:
                raise _Retriable(f"HTTP {exc.code}") from None
            try:
                answer = json.loads(exc.read() or b"null")
            except ValueError:
                answer = None  # an error page: the status says enough
            return exc.code, answer
        except (urllib.error.URLError, TimeoutError, ConnectionError, HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise _Retriable(str(reason) or type(reason).__name__) from None

    def _json(self, body: bytes, path: str) -> Any:
        """A 200's JSON; an HTML page (a login page, a proxy, the wrong port) is a refusal."""
        try:
            return json.loads(body or b"null")
        except ValueError:
            raise RegistryRefusedError(
                f"{self.settings.public_url}{path} answered with something that is not JSON "
                f"({body[:80]!r}); check that registry.url is a Confluent-compatible API "
                "(Apicurio's ends with /apis/ccompat/v7)"
            ) from None

    def _refused_unless_ok(self, status: int, answer: Any, doing: str) -> None:
        if status < 300:
            return
        message = answer.get("message") if isinstance(answer, dict) else None
        hint = {
            401: "check registry.basic_auth_user_info",
            403: "the credentials may not do this",
            404: "check registry.url (Apicurio's ends with /apis/ccompat/v7)",
            409: "the schema is incompatible with the versions already registered",
            422: "the registry cannot parse the schema",
        }.get(status, "see the registry's log")
        raise RegistryRefusedError(
            f"the schema registry at {self.settings.public_url} refused {doing}: "
            f"HTTP {status}{f' ({message})' if message else ''}; {hint}"
        )

    def _ssl_context(self) -> ssl.SSLContext | None:
        s = self.settings
        if not s.url.startswith("https"):
            return None
        context = ssl.create_default_context(cafile=s.ssl_ca_location)
        if s.ssl_certificate_location:
            context.load_cert_chain(
                s.ssl_certificate_location, s.ssl_key_location, password=s.ssl_key_password
            )
        return context
