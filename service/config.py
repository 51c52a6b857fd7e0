"""The pipeline file: loading, environment overrides, and validation with errors by field path.

`onceflow validate` runs all of this without starting Spark. Any problem raises ConfigError
naming the field (`source.schema`, `window.size`, ...); the CLI turns it into exit code 2.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from onceflow.connectors.checkpoint import DEFAULT_SOURCE
from onceflow.connectors.errors import EXIT_BAD_CONFIG, OnceflowError
from onceflow.connectors.registry import RegistrySettings

ENV_PREFIX = "ONCEFLOW_"
AGGREGATE_FUNCTIONS = ("count", "sum", "min", "max", "avg", "approx_count_distinct")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")
_UNIT_MS = {
    **dict.fromkeys(("ms", "millis", "millisecond", "milliseconds"), 1),
    **dict.fromkeys(("s", "sec", "second", "seconds"), 1000),
    **dict.fromkeys(("m", "min", "minute", "minutes"), 60_000),
    **dict.fromkeys(("h", "hour", "hours"), 3_600_000),
    **dict.fromkeys(("d", "day", "days"), 86_400_000),
}
_AGGREGATION = re.compile(r"^\s*([a-z_]+)\s*\(\s*(\*|[A-Za-z_][A-Za-z0-9_.]*)\s*\)\s*$")
_REFERENCE = re.compile(r"\$\{([^}]+)\}")
_APP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# An input's name is its view's name in `sql:`: a plain SQL identifier, in lower case as Spark
# compares view names and environment overrides spell keys.
_INPUT_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
# The Kafka record's columns the router carries, and what a sql input's view has besides the
# record's fields (pipeline.routed_stream adds them).
SOURCE_META = ("_key", "_value", "_topic", "_partition", "_offset", "_timestamp", "_headers")
VIEW_COLUMNS = ("event_time", *SOURCE_META)
# Avro records: schemaless bodies (the reader knows the schema), or the Confluent wire format
# (a schema id in front of each value, the writer schema in a registry), as Flink names them.
AVRO_FORMATS = ("avro", "avro-confluent")
# Sections whose values are strings as written: a password `on` or `0123` stays a string.
VERBATIM_SECTIONS = ("kafka", "registry")


class ConfigError(OnceflowError, ValueError):
    """The pipeline file is invalid; `path` names the field, the message says how to fix it."""

    exit_code = EXIT_BAD_CONFIG

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


@dataclass(frozen=True)
class Aggregation:
    name: str
    function: str
    column: str  # "*" for count(*)


@dataclass(frozen=True)
class EventTimeConfig:
    field: str | None = None  # None: the Kafka record timestamp
    watermark_delay_ms: int = 0


@dataclass(frozen=True)
class Lookup:
    """A stream input's column named after a table input: the table's latest entry whose
    Kafka key equals the stream record's `field`, as of the record's epoch."""

    table: str
    field: str


@dataclass(frozen=True)
class SourceConfig:
    """One named input. `event_time` is None for an input of `sources:` without one: its
    records get no watermark, and none of them is late."""

    topics: list[str]
    starting_offsets: str = "latest"
    format: str = "json"
    schema: str | None = None
    schema_file: str | None = None
    max_records_per_batch: int = 100_000
    fail_on_data_loss: bool = True
    parallelism: int | None = None  # tasks that read each batch; None: Spark's cores
    name: str = DEFAULT_SOURCE
    event_time: EventTimeConfig | None = None
    # Where the fields named in the error messages live: `source`, or `sources.<name>`.
    path: str = "source"
    lookups: tuple[Lookup, ...] = ()
    # Looked up by another input: read as a table (latest value per key), with no view.
    table: bool = False


@dataclass(frozen=True)
class WindowConfig:
    type: str
    size_ms: int
    slide_ms: int | None
    gap_ms: int | None
    key: list[str]
    aggregations: list[Aggregation]
    output_mode: str = "append"


@dataclass(frozen=True)
class SinkConfig:
    topic: str
    format: str = "json"
    dead_letter_topic: str | None = None
    late_topic: str | None = None
    marker_topic: str | None = None
    guarantee: str = "exactly_once"  # at_least_once: no transaction (duplicates on a crash)
    # How long an epoch's transaction may stay open before the broker aborts it; at most the
    # broker's transaction.max.timeout.ms (15 min by default).
    transaction_timeout_ms: int = 60_000
    subject: str | None = None  # avro-confluent: where the result schema is registered

    @property
    def value_subject(self) -> str:
        """The registry subject of the results' schema: Confluent's `<topic>-value` default."""
        return self.subject or f"{self.topic}-value"


@dataclass(frozen=True)
class PipelineConfig:
    app_id: str
    kafka: dict[str, str]
    sources: tuple[SourceConfig, ...]  # one, unless `sql` joins several
    sink: SinkConfig
    checkpoint_location: str
    trigger_interval_ms: int = 1000
    window: WindowConfig | None = None
    transform: str | None = None
    sql: str | None = None  # a Spark SQL query over the inputs, each a view of its name
    key: str | None = None  # sql: the result column that is the record key (None: no key)
    spark_master: str = "local[*]"
    spark_conf: dict[str, str] = field(default_factory=dict)
    metrics_port: int | None = 9108
    stall_timeout_ms: int = 300_000
    registry: RegistrySettings | None = None
    base_dir: Path = Path(".")

    @property
    def bootstrap_servers(self) -> str:
        return self.kafka["bootstrap.servers"]

    @property
    def source(self) -> SourceConfig:
        """The input of a pipeline with one (windows, transforms and pass-through have one)."""
        if len(self.sources) != 1:
            names = ", ".join(s.name for s in self.sources)
            raise ConfigError("sources", f"this needs one input, the pipeline has {names}")
        return self.sources[0]

    @property
    def event_time(self) -> EventTimeConfig:
        return self.source.event_time or EventTimeConfig()

    @property
    def kind(self) -> str:
        if self.window is not None:
            return "windowed"
        if self.transform is not None:
            return "transform"
        return "sql" if self.sql is not None else "pass-through"

    def source_field_names(self, source: SourceConfig | None = None) -> list[str]:
        """Top-level fields of an input's decoded record, from the DDL or the Avro schema."""
        source = source or self.source
        if source.format == "json":
            return ddl_field_names(source.schema or "")
        if source.format in AVRO_FORMATS:
            return [f["name"] for f in load_avro_schema(self, source)["fields"]]
        return []


# -- loading ---------------------------------------------------------------------------------


def load(path: str | Path, environ: Mapping[str, str] | None = None) -> PipelineConfig:
    """Read a pipeline file, apply ONCEFLOW_<SECTION>__<FIELD> overrides, validate it."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError("", f"pipeline file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path} must hold a mapping of settings at the top level")
    environ = os.environ if environ is None else environ
    apply_env_overrides(raw, environ)
    return parse(resolve_references(raw, environ), base_dir=path.resolve().parent)


def resolve_references(node: Any, environ: Mapping[str, str], path: str = "") -> Any:
    """`${NAME}` in a value is the environment variable NAME, `${file:/run/secrets/x}` the
    file's content (trailing newline dropped): secrets need not sit in the pipeline file."""
    if isinstance(node, dict):
        return {
            k: resolve_references(v, environ, f"{path}.{k}" if path else str(k))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [resolve_references(v, environ, f"{path}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, str):
        return node

    def value_of(match: re.Match) -> str:
        name = match.group(1)
        if name.startswith("file:"):
            try:
                return Path(name[5:]).read_text().rstrip("\n")
            except OSError as exc:
                raise ConfigError(path, f"cannot read {name[5:]} ({exc.strerror})") from None
        if name not in environ:
            raise ConfigError(path, f"refers to environment variable {name}, which is not set")
        return environ[name]

    return _REFERENCE.sub(value_of, node)


def apply_env_overrides(raw: dict, environ: Mapping[str, str]) -> None:
    """`ONCEFLOW_KAFKA__BOOTSTRAP_SERVERS=b:9092` sets kafka.bootstrap_servers, and so on.

    Only names with a double underscore are overrides (ONCEFLOW_HOME and friends are not).
    Values are read as YAML scalars, so numbers and booleans keep their types; except in the
    `kafka` and `registry` sections, whose settings are strings: a password `on` or `0123`
    must not become `True` or `83`.
    """
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        keys = name[len(ENV_PREFIX) :].lower().split("__")
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(keys), f"environment variable {name} cannot apply")
        verbatim = keys[0] in VERBATIM_SECTIONS or not value
        node[keys[-1]] = value if verbatim else yaml.safe_load(value)


def parse(raw: dict, base_dir: Path = Path(".")) -> PipelineConfig:
    top = _Section(raw, "")
    top.only(
        "app_id",
        "kafka",
        "source",
        "sources",
        "event_time",
        "window",
        "transform",
        "sql",
        "key",
        "sink",
        "checkpoint",
        "spark",
        "metrics",
        "registry",
    )
    app_id = top.string("app_id", required=True)
    if not _APP_ID.match(app_id):
        raise ConfigError("app_id", f"{app_id!r} may use letters, digits, '.', '_' and '-' only")

    kafka = _kafka_settings(top.mapping("kafka", required=True))

    sources = _inputs(top, raw)
    sink = _sink(_Section(top.mapping("sink", required=True), "sink"))
    registry = None
    if "registry" in raw:
        registry = _registry(_Section(top.mapping("registry"), "registry"))
    formats = [(f"{s.path}.format", s.format) for s in sources] + [("sink.format", sink.format)]
    for path, fmt in formats:
        if fmt == "avro-confluent" and registry is None:
            raise ConfigError(
                "registry.url",
                f"is required for {path} avro-confluent: the schema registry's URL, "
                "e.g. http://127.0.0.1:8081/apis/ccompat/v7",
            )

    processing = [k for k in ("window", "transform", "sql") if k in raw]
    if len(processing) > 1:
        raise ConfigError(processing[0], f"set one of window, transform and sql, not {processing}")
    if len(sources) > 1 and "sql" not in raw:
        raise ConfigError(
            "sources", "several inputs need sql: a query that joins or unions them by name"
        )
    window = _window(_Section(top.mapping("window"), "window")) if "window" in raw else None
    transform = top.string("transform")
    if transform is not None and not re.match(r"^[\w.]+:\w+$", transform):
        raise ConfigError(
            "transform", f"must look like 'package.module:function', got {transform!r}"
        )
    sql = top.string("sql")
    if "sql" in raw and not (sql or "").strip():
        raise ConfigError("sql", "must be a Spark SQL query, e.g. SELECT * FROM input")
    key = top.string("key")
    if key is not None and sql is None:
        raise ConfigError("key", "applies to sql pipelines (windows key by window.key)")

    checkpoint = _Section(top.mapping("checkpoint", required=True), "checkpoint")
    checkpoint.only("location", "interval")
    location = checkpoint.string("location", required=True)
    spark = _Section(top.mapping("spark"), "spark")
    spark.only("master", "conf")
    metrics = _Section(top.mapping("metrics"), "metrics")
    metrics.only("port", "stall_timeout")

    config = PipelineConfig(
        app_id=app_id,
        kafka=kafka,
        sources=sources,
        sink=sink,
        checkpoint_location=str((base_dir / location).resolve())
        if "://" not in location
        else location,
        trigger_interval_ms=checkpoint.duration("interval", default="1s"),
        window=window,
        transform=transform,
        sql=sql,
        key=key,
        spark_master=spark.string("master") or "local[*]",
        spark_conf={str(k): str(v) for k, v in spark.mapping("conf").items()},
        metrics_port=metrics.integer("port", default=9108, minimum=0),
        stall_timeout_ms=metrics.duration("stall_timeout", default="5m"),
        registry=registry,
        base_dir=base_dir,
    )
    _check_fields(config)
    _check_sql_settings(config)
    _check_sink_producer(config)
    return config


def _check_sql_settings(config: PipelineConfig) -> None:
    """The router of a sql input routes late rows at the previous epoch's watermark, the one
    Spark drops them at with several stateful operators allowed (its default); with one
    allowed, Spark drops at the epoch's own watermark, so rows in between would vanish."""
    setting = "spark.sql.streaming.statefulOperator.allowMultiple"
    if config.sql is not None and config.spark_conf.get(setting, "true").lower() == "false":
        raise ConfigError(
            f"spark.conf.{setting}",
            "must stay true (Spark's default) in a sql pipeline: onceflow routes late records "
            "at the watermark Spark drops them at with it",
        )


def _check_sink_producer(config: PipelineConfig) -> None:
    """librdkafka checks some settings against each other only for the producer the sink
    makes at its first commit (a transactional one, for exactly-once: socket.timeout.ms and
    message.timeout.ms against the transaction timeout, acks, max.in.flight): build one that
    never connects, here, so that a refusal names the field before anything runs."""
    settings = {"enable.idempotence": True}
    if config.sink.guarantee == "exactly_once":
        timeout_ms = config.sink.transaction_timeout_ms
        settings |= {"transactional.id": "onceflow-check", "transaction.timeout.ms": timeout_ms}
    _check_with_librdkafka(
        config.kafka,
        settings,
        re.compile(r"`([^`]+)`"),
        "librdkafka, for the sink's producer; its transaction.timeout.ms is "
        f"sink.transaction_timeout, {config.sink.transaction_timeout_ms} ms",
    )


def _check_with_librdkafka(
    kafka: dict[str, str], extra: dict, names: re.Pattern[str], source: str
) -> None:
    """Build a producer of `kafka` (and `extra`) that never connects; librdkafka's refusal
    becomes a ConfigError naming the first of `kafka`'s settings its message names."""
    from confluent_kafka import KafkaException, Producer

    settings = {k: v for k, v in kafka.items() if k != "bootstrap.servers"}  # never connect
    try:
        Producer({**settings, **extra, "log_level": 0})
    except KafkaException as exc:
        message = exc.args[0].str()
        named = [name for name in names.findall(message) if name in kafka]
        field = f"kafka.{named[0]}" if named else "kafka"
        raise ConfigError(field, f"{message} ({source})") from None


def _kafka_settings(raw: dict) -> dict[str, str]:
    """librdkafka settings: `sasl_username` (as environment overrides must spell it) is
    `sasl.username` (librdkafka's names have no underscores but `log_level`). They are
    checked by building a client that never connects, so a misspelled one fails here, naming
    it."""
    kafka = {_librdkafka_name(str(k)): str(v) for k, v in raw.items()}
    if not kafka.get("bootstrap.servers"):
        raise ConfigError("kafka.bootstrap_servers", "is required, e.g. 127.0.0.1:9092")
    _check_with_librdkafka(kafka, {}, re.compile(r'property:? "([^"]+)"'), "librdkafka")
    return kafka


def _librdkafka_name(key: str) -> str:
    return key if key == "log_level" else key.replace("_", ".")


def _inputs(top: _Section, raw: dict) -> tuple[SourceConfig, ...]:
    """`source:` and the top-level `event_time:` (one input, named `input`), or `sources:`,
    named inputs with an `event_time:` each."""
    if "source" in raw and "sources" in raw:
        raise ConfigError("sources", "set either source (one input) or sources, not both")
    if "sources" not in raw:
        given = raw.get("event_time") is not None  # as in a `sources:` block
        event = _Section(top.mapping("event_time"), "event_time") if given else None
        source = _source(_Section(top.mapping("source", required=True), "source"), event)
        return (source,)
    if "event_time" in raw:
        raise ConfigError("event_time", "with sources, each input has its own event_time")
    named = top.mapping("sources", required=True)
    if not named:
        raise ConfigError("sources", "needs at least one input, e.g. clicks: {topics: [clicks]}")
    sources: list[SourceConfig] = []
    for name, block in named.items():
        path = f"sources.{name}"
        if not isinstance(name, str) or not _INPUT_NAME.match(name):
            raise ConfigError(
                path,
                "an input's name is its view in sql: lower-case letters, digits and '_' (a "
                "digit not first), e.g. clicks or user_events",
            )
        section = _Section(block, path)
        given = section.value("event_time") is not None
        event = _Section(section.mapping("event_time"), f"{path}.event_time") if given else None
        source = _source(section, event, name)
        for other in sources:
            shared = sorted(set(other.topics) & set(source.topics))
            if shared:
                raise ConfigError(
                    f"{path}.topics",
                    f"{shared} already read by input {other.name!r}: each topic is read by one "
                    "input (its dead letters and lag are counted per position); refer to that "
                    "input in the query instead",
                )
        sources.append(source)
    return _tables_resolved(named, sources)


def _source(s: _Section, event: _Section | None, name: str = DEFAULT_SOURCE) -> SourceConfig:
    s.only(
        "topics",
        "starting_offsets",
        "format",
        "schema",
        "schema_file",
        "max_records_per_batch",
        "fail_on_data_loss",
        "parallelism",
        *(["event_time", "lookup"] if s.path != "source" else []),
    )
    topics = s.value("topics", required=True)
    if isinstance(topics, str):
        topics = [topics]
    if not isinstance(topics, list) or not all(isinstance(t, str) for t in topics):
        raise ConfigError(f"{s.path}.topics", "must be a non-empty list of topic names")
    # "a,b" names two topics, as Spark's `subscribe` reads it (no topic name has a comma).
    topics = [name.strip() for entry in topics for name in entry.split(",") if name.strip()]
    if not topics:
        raise ConfigError(f"{s.path}.topics", "must be a non-empty list of topic names")
    fmt = s.choice("format", ("json", *AVRO_FORMATS, "raw"), default="json")
    schema = s.string("schema")
    if fmt == "json" and not schema:
        raise ConfigError(
            f"{s.path}.schema",
            "is required for format json: a Spark DDL string such as "
            '"user STRING, bytes LONG, ts LONG"',
        )
    schema_file = s.string("schema_file")
    if fmt in AVRO_FORMATS and not schema_file:
        raise ConfigError(
            f"{s.path}.schema_file",
            f"is required for format {fmt}: a path to an .avsc"
            + (" (the reader schema writer schemas resolve to)" if fmt != "avro" else ""),
        )
    return SourceConfig(
        topics=topics,
        starting_offsets=s.choice("starting_offsets", ("earliest", "latest"), default="latest"),
        format=fmt,
        schema=schema,
        schema_file=schema_file,
        max_records_per_batch=s.integer("max_records_per_batch", default=100_000, minimum=1),
        fail_on_data_loss=s.boolean("fail_on_data_loss", default=True),
        parallelism=s.integer("parallelism", default=None, minimum=1),
        name=name,
        event_time=_event_time(event) if event is not None else None,
        path=s.path,
        lookups=_lookups(s),
    )


def _lookups(s: _Section) -> tuple[Lookup, ...]:
    lookups = []
    for table, field_name in s.mapping("lookup").items():
        if not isinstance(field_name, str) or not field_name:
            raise ConfigError(
                f"{s.path}.lookup.{table}",
                "must name this input's field whose value is the table's key, e.g. "
                "lookup: {persons: seller}",
            )
        lookups.append(Lookup(str(table), field_name))
    return tuple(lookups)


def _tables_resolved(named: dict, sources: list[SourceConfig]) -> tuple[SourceConfig, ...]:
    """Inputs looked up by another are tables: read from the earliest offset unless told
    otherwise, with no view, no event time and no lookups of their own."""
    by_name = {source.name: source for source in sources}
    looked_up: dict[str, str] = {}
    for source in sources:
        for lookup in source.lookups:
            path = f"{source.path}.lookup.{lookup.table}"
            table = by_name.get(lookup.table)
            if table is None or table is source:
                names = sorted(by_name)
                raise ConfigError(
                    path, f"names no other input; inputs: {names}{_hint(lookup.table, names)}"
                )
            if lookup.table in looked_up:
                raise ConfigError(
                    path,
                    f"table {lookup.table!r} is already looked up by {looked_up[lookup.table]!r}; "
                    "an input is read once, so a table serves one stream",
                )
            looked_up[lookup.table] = source.name
            if table.lookups:
                raise ConfigError(f"{table.path}.lookup", "a table looks nothing up itself")
            if table.event_time is not None:
                raise ConfigError(
                    f"{table.path}.event_time",
                    "a table has no event time: its entries are current as of each epoch",
                )
            if table.format == "raw":
                raise ConfigError(f"{table.path}.format", "a table's entries are json or avro")
            if len(table.topics) > 1:
                raise ConfigError(
                    f"{table.path}.topics",
                    "a table reads one topic: the latest value of a key is the last in its "
                    "partition, and two topics have no order between them",
                )
    resolved = []
    for source in sources:
        if source.name in looked_up:
            given = _Section(named[source.name], source.path).value("starting_offsets")
            source = replace(
                source,
                table=True,
                starting_offsets=source.starting_offsets if given else "earliest",
            )
        resolved.append(source)
    return tuple(resolved)


def _event_time(s: _Section) -> EventTimeConfig:
    s.only("field", "watermark_delay")
    return EventTimeConfig(
        field=s.string("field"),
        watermark_delay_ms=s.duration("watermark_delay", default="0s"),
    )


def _sink(s: _Section) -> SinkConfig:
    s.only(
        "topic",
        "format",
        "dead_letter_topic",
        "late_topic",
        "marker_topic",
        "guarantee",
        "transaction_timeout",
        "subject",
    )
    timeout_ms = s.duration("transaction_timeout", default="60s")
    if timeout_ms < 1_000:
        raise ConfigError(
            "sink.transaction_timeout",
            f"must be at least 1s (librdkafka's minimum), got {timeout_ms} ms",
        )
    return SinkConfig(
        topic=s.string("topic", required=True),
        format=s.choice("format", ("json", *AVRO_FORMATS), default="json"),
        subject=s.string("subject"),
        dead_letter_topic=s.string("dead_letter_topic"),
        late_topic=s.string("late_topic"),
        marker_topic=s.string("marker_topic"),
        guarantee=s.choice("guarantee", ("exactly_once", "at_least_once"), default="exactly_once"),
        transaction_timeout_ms=timeout_ms,
    )


def _registry(s: _Section) -> RegistrySettings:
    s.only(
        "url",
        "basic_auth_user_info",
        "ssl_ca_location",
        "ssl_certificate_location",
        "ssl_key_location",
        "ssl_key_password",
    )
    url = s.string("url", required=True)
    if not re.match(r"^https?://[^/]", url):
        raise ConfigError("registry.url", "must be an http:// or https:// URL")
    if "@" in url.split("/")[2]:
        raise ConfigError(
            "registry.url",
            "must not hold user:password (it would be sent as part of the host name); put "
            "them in registry.basic_auth_user_info, e.g. ${REGISTRY_USER_INFO}",
        )
    return RegistrySettings(
        url=url,
        basic_auth_user_info=s.string("basic_auth_user_info"),
        ssl_ca_location=s.string("ssl_ca_location"),
        ssl_certificate_location=s.string("ssl_certificate_location"),
        ssl_key_location=s.string("ssl_key_location"),
        ssl_key_password=s.string("ssl_key_password"),
    )


def _window(s: _Section) -> WindowConfig:
    s.only("type", "size", "slide", "gap", "key", "aggregations", "output_mode")
    kind = s.choice("type", ("tumbling", "sliding", "session"), required=True)
    size = s.duration("size", required=kind != "session")
    slide = s.duration("slide", required=kind == "sliding")
    gap = s.duration("gap", required=kind == "session")
    for name, given in (("size", size), ("slide", slide), ("gap", gap)):
        allowed = {"tumbling": ("size",), "sliding": ("size", "slide"), "session": ("gap",)}[kind]
        if given is not None and name not in allowed:
            raise ConfigError(f"window.{name}", f"does not apply to {kind} windows")
    if kind == "sliding" and slide > size:
        raise ConfigError("window.slide", f"must not exceed window.size ({size} ms)")
    key = s.value("key", required=True)
    key = [key] if isinstance(key, str) else key
    if not isinstance(key, list) or not key or not all(isinstance(k, str) for k in key):
        raise ConfigError("window.key", "must be a field name or a list of field names")
    aggs_raw = s.mapping("aggregations", required=True)
    if not aggs_raw:
        raise ConfigError("window.aggregations", "needs at least one aggregation")
    aggregations = []
    for name, expr in aggs_raw.items():
        m = _AGGREGATION.match(str(expr))
        path = f"window.aggregations.{name}"
        if not m or m.group(1) not in AGGREGATE_FUNCTIONS:
            raise ConfigError(
                path,
                f"{expr!r} is not one of {', '.join(f + '(field)' for f in AGGREGATE_FUNCTIONS)}",
            )
        if m.group(2) == "*" and m.group(1) != "count":
            raise ConfigError(path, f"only count takes '*', not {m.group(1)}")
        if name in ("key", "window_start", "window_end"):
            raise ConfigError(path, f"'{name}' is a reserved output field; rename the aggregation")
        aggregations.append(Aggregation(str(name), m.group(1), m.group(2)))
    return WindowConfig(
        type=kind,
        size_ms=size or 0,
        slide_ms=slide,
        gap_ms=gap,
        key=key,
        aggregations=aggregations,
        output_mode=s.choice("output_mode", ("append", "update"), default="append"),
    )


def _check_fields(config: PipelineConfig) -> None:
    """Fields named by event_time and window must exist in the input records."""
    if config.sql is not None:  # the query's own fields are checked by Spark (validate)
        for source in config.sources:
            _check_event_time_field(config, source)
            taken = sorted(set(config.source_field_names(source)) & set(VIEW_COLUMNS))
            if taken:
                raise ConfigError(
                    f"{source.path}.schema",
                    f"field(s) {taken} clash with the columns onceflow adds to the input's "
                    f"view ({', '.join(VIEW_COLUMNS)}); rename them in the schema",
                )
            _check_lookups(config, source)
        return
    source = config.source
    names = config.source_field_names()
    if not names:
        if config.window is not None or config.event_time.field:
            raise ConfigError(
                f"{source.path}.format", "raw input has no fields; windows need json or avro"
            )
        return
    known = set(names)
    wanted = [(_event_time_path(source), config.event_time.field)]
    if config.window is not None:
        wanted += [("window.key", k) for k in config.window.key]
        wanted += [
            (f"window.aggregations.{a.name}", a.column)
            for a in config.window.aggregations
            if a.column != "*"
        ]
    for path, name in wanted:
        if name is not None and name not in known:
            raise ConfigError(
                path, f"field {name!r} is not in the input schema {names}{_hint(name, names)}"
            )


def _check_lookups(config: PipelineConfig, source: SourceConfig) -> None:
    """A lookup's field is one of the stream's, and its column (the table's name) is new,
    to Spark: which ignores case in column names unless spark.sql.caseSensitive is set."""
    names = config.source_field_names(source)
    case_sensitive = config.spark_conf.get("spark.sql.caseSensitive", "false").lower() == "true"
    fold = str if case_sensitive else str.lower
    for lookup in source.lookups:
        path = f"{source.path}.lookup.{lookup.table}"
        if lookup.field not in names:
            raise ConfigError(
                path,
                f"field {lookup.field!r} is not in the input schema {names}"
                f"{_hint(lookup.field, names)}",
            )
        taken = {fold(name) for name in [*names, *VIEW_COLUMNS]}
        if fold(lookup.table) in taken:
            raise ConfigError(
                path,
                f"the view of {source.name!r} has a column {lookup.table!r} already, and the "
                "looked-up entry would be another; rename the table input",
            )


def _check_event_time_field(config: PipelineConfig, source: SourceConfig) -> None:
    field = source.event_time.field if source.event_time else None
    if field is None:
        return
    names = config.source_field_names(source)
    if field not in names:
        raise ConfigError(
            _event_time_path(source),
            f"field {field!r} is not in the input schema {names}{_hint(field, names)}",
        )


def _event_time_path(source: SourceConfig) -> str:
    """One `source:` has its event time at the top level, each of `sources:` in its block."""
    return "event_time.field" if source.path == "source" else f"{source.path}.event_time.field"


def ddl_field_names(ddl: str) -> list[str]:
    """Top-level field names of a Spark DDL string like "a STRING, b STRUCT<x: INT>"."""
    names, depth, current = [], 0, ""
    for char in ddl + ",":
        if char in "<(":
            depth += 1
        elif char in ">)":
            depth -= 1
        if char == "," and depth == 0:
            part = current.strip()
            if part:
                names.append(part.split()[0].strip("`"))
            current = ""
        else:
            current += char
    return names


def load_avro_schema(config: PipelineConfig, source: SourceConfig) -> dict:
    """The reader schema of an Avro input (its `schema_file`)."""
    path_name = f"{source.path}.schema_file"
    file = config.base_dir / (source.schema_file or "")
    try:
        schema = json.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(path_name, f"cannot read {file}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(path_name, f"{file} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise ConfigError(path_name, f"{file} must hold an Avro record schema")
    return schema


def parse_duration_ms(text: Any, path: str) -> int:
    m = _DURATION.match(str(text).lower())
    if not m or m.group(2) not in _UNIT_MS:
        raise ConfigError(path, f"{text!r} is not a duration; use e.g. 500ms, 10s, 5m, 1h")
    return int(float(m.group(1)) * _UNIT_MS[m.group(2)])


def _hint(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class _Section:
    """Typed access to one mapping of the file, with errors that name the field path."""

    def __init__(self, raw: Any, path: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(path, "must be a mapping of settings")
        self.raw, self.path = raw, path

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def only(self, *allowed: str) -> None:
        for key in self.raw:
            if key not in allowed:
                raise ConfigError(
                    self._name(str(key)), f"unknown field{_hint(str(key), list(allowed))}"
                )

    def value(self, key: str, required: bool = False) -> Any:
        if self.raw.get(key) is None:
            if required:
                raise ConfigError(self._name(key), "is required")
            return None
        return self.raw[key]

    def string(self, key: str, required: bool = False) -> str | None:
        value = self.value(key, required)
        if value is not None and not isinstance(value, str | int | float):
            raise ConfigError(self._name(key), f"must be a string, got {value!r}")
        return None if value is None else str(value)

    def mapping(self, key: str, required: bool = False) -> dict:
        value = self.value(key, required)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(self._name(key), f"must be a mapping, got {value!r}")
        return value

    def choice(
        self, key: str, options: tuple[str, ...], default: str | None = None, required: bool = False
    ) -> str:
        value = self.string(key, required) or default
        if value not in options:
            raise ConfigError(
                self._name(key), f"must be one of {', '.join(options)}, got {value!r}"
            )
        return value

    def integer(self, key: str, default: int | None, minimum: int) -> int | None:
        value = self.value(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(self._name(key), f"must be an integer >= {minimum}, got {value!r}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.value(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(self._name(key), f"must be true or false, got {value!r}")
        return value

    def duration(self, key: str, default: str | None = None, required: bool = False) -> int | None:
        value = self.value(key, required)
        if value is None:
            return None if default is None else parse_duration_ms(default, self._name(key))
        return parse_duration_ms(value, self._name(key))
