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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

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
class SourceConfig:
    topics: list[str]
    starting_offsets: str = "latest"
    format: str = "json"
    schema: str | None = None
    schema_file: str | None = None
    max_records_per_batch: int = 100_000
    fail_on_data_loss: bool = True
    parallelism: int | None = None  # tasks that read each batch; None: Spark's cores


@dataclass(frozen=True)
class EventTimeConfig:
    field: str | None = None  # None: the Kafka record timestamp
    watermark_delay_ms: int = 0


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
    source: SourceConfig
    sink: SinkConfig
    checkpoint_location: str
    trigger_interval_ms: int = 1000
    event_time: EventTimeConfig = field(default_factory=EventTimeConfig)
    window: WindowConfig | None = None
    transform: str | None = None
    spark_master: str = "local[*]"
    spark_conf: dict[str, str] = field(default_factory=dict)
    metrics_port: int | None = 9108
    stall_timeout_ms: int = 300_000
    registry: RegistrySettings | None = None
    base_dir: Path = Path(".")

    @property
    def bootstrap_servers(self) -> str:
        return self.kafka["bootstrap.servers"]

    def source_field_names(self) -> list[str]:
        """Top-level fields of the decoded input record, from the DDL or the Avro schema."""
        if self.source.format == "json":
            return ddl_field_names(self.source.schema or "")
        if self.source.format in AVRO_FORMATS:
            return [f["name"] for f in load_avro_schema(self, "source.schema_file")["fields"]]
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
        "event_time",
        "window",
        "transform",
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

    source = _source(_Section(top.mapping("source", required=True), "source"))
    sink = _sink(_Section(top.mapping("sink", required=True), "sink"))
    registry = None
    if "registry" in raw:
        registry = _registry(_Section(top.mapping("registry"), "registry"))
    for section, fmt in (("source", source.format), ("sink", sink.format)):
        if fmt == "avro-confluent" and registry is None:
            raise ConfigError(
                "registry.url",
                f"is required for {section}.format avro-confluent: the schema registry's URL, "
                "e.g. http://127.0.0.1:8081/apis/ccompat/v7",
            )

    event = _Section(top.mapping("event_time"), "event_time")
    event.only("field", "watermark_delay")
    event_time = EventTimeConfig(
        field=event.string("field"),
        watermark_delay_ms=event.duration("watermark_delay", default="0s"),
    )

    if "window" in raw and "transform" in raw:
        raise ConfigError("transform", "set either window or transform, not both")
    window = _window(_Section(top.mapping("window"), "window")) if "window" in raw else None
    transform = top.string("transform")
    if transform is not None and not re.match(r"^[\w.]+:\w+$", transform):
        raise ConfigError(
            "transform", f"must look like 'package.module:function', got {transform!r}"
        )

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
        source=source,
        sink=sink,
        checkpoint_location=str((base_dir / location).resolve())
        if "://" not in location
        else location,
        trigger_interval_ms=checkpoint.duration("interval", default="1s"),
        event_time=event_time,
        window=window,
        transform=transform,
        spark_master=spark.string("master") or "local[*]",
        spark_conf={str(k): str(v) for k, v in spark.mapping("conf").items()},
        metrics_port=metrics.integer("port", default=9108, minimum=0),
        stall_timeout_ms=metrics.duration("stall_timeout", default="5m"),
        registry=registry,
        base_dir=base_dir,
    )
    _check_fields(config)
    _check_sink_producer(config)
    return config


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


def _source(s: _Section) -> SourceConfig:
    s.only(
        "topics",
        "starting_offsets",
        "format",
        "schema",
        "schema_file",
        "max_records_per_batch",
        "fail_on_data_loss",
        "parallelism",
    )
    topics = s.value("topics", required=True)
    if isinstance(topics, str):
        topics = [topics]
    if not isinstance(topics, list) or not topics or not all(isinstance(t, str) for t in topics):
        raise ConfigError("source.topics", "must be a non-empty list of topic names")
    fmt = s.choice("format", ("json", *AVRO_FORMATS, "raw"), default="json")
    schema = s.string("schema")
    if fmt == "json" and not schema:
        raise ConfigError(
            "source.schema",
            "is required for format json: a Spark DDL string such as "
            '"user STRING, bytes LONG, ts LONG"',
        )
    schema_file = s.string("schema_file")
    if fmt in AVRO_FORMATS and not schema_file:
        raise ConfigError(
            "source.schema_file",
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
    """Fields named by event_time and window must exist in the input record."""
    names = config.source_field_names()
    if not names:
        if config.window is not None or config.event_time.field:
            raise ConfigError("source.format", "raw input has no fields; windows need json or avro")
        return
    known = set(names)
    wanted = [("event_time.field", config.event_time.field)]
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


def load_avro_schema(config: PipelineConfig, path_name: str) -> dict:
    file = config.base_dir / (config.source.schema_file or "")
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
