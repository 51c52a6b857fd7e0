"""The pipeline file's validation: every error names its field."""

import copy

import pytest
import yaml

from onceflow.config import ConfigError, apply_env_overrides, load, parse, parse_duration_ms

BASE = {
    "app_id": "clicks",
    "kafka": {"bootstrap_servers": "b:9092", "compression.type": "lz4"},
    "source": {"topics": ["in"], "schema": "user STRING, bytes LONG, ts LONG"},
    "event_time": {"field": "ts", "watermark_delay": "5s"},
    "window": {
        "type": "tumbling",
        "size": "10s",
        "key": "user",
        "aggregations": {"n": "count(*)", "b": "sum(bytes)"},
    },
    "sink": {"topic": "out"},
    "checkpoint": {"location": "/ck"},
}


def with_(**sections):
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for section, values in sections.items():
        if values is None:
            raw.pop(section)
        else:
            raw[section] = {**raw.get(section, {}), **values}
    return raw


@pytest.mark.parametrize(
    "text, ms", [("500ms", 500), ("10s", 10_000), ("1.5 minutes", 90_000), ("2h", 7_200_000)]
)
def test_durations(text, ms):
    assert parse_duration_ms(text, "x") == ms


def test_a_valid_file_parses_with_passthrough_kafka_settings():
    config = parse(with_())
    assert config.kafka == {"bootstrap.servers": "b:9092", "compression.type": "lz4"}
    assert config.window.size_ms == 10_000 and config.event_time.watermark_delay_ms == 5_000
    assert [(a.name, a.function, a.column) for a in config.window.aggregations] == [
        ("n", "count", "*"),
        ("b", "sum", "bytes"),
    ]


def test_environment_overrides_nested_fields_with_yaml_types():
    raw = with_()
    apply_env_overrides(
        raw,
        {
            "ONCEFLOW_KAFKA__BOOTSTRAP_SERVERS": "kafka:9092",
            "ONCEFLOW_METRICS__PORT": "9200",
            "ONCEFLOW_HOME": "/not/an/override",
        },
    )
    config = parse(raw)
    assert config.bootstrap_servers == "kafka:9092" and config.metrics_port == 9200


def test_kafka_settings_from_the_environment_stay_strings():
    """A password that YAML would read as a boolean or an octal number stays what it is."""
    raw = with_()
    apply_env_overrides(
        raw,
        {
            "ONCEFLOW_KAFKA__SASL_PASSWORD": "0123",
            "ONCEFLOW_KAFKA__SASL_USERNAME": "on",
            "ONCEFLOW_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
            "ONCEFLOW_KAFKA__SASL_MECHANISM": "PLAIN",
        },
    )
    kafka = parse(raw).kafka
    assert (kafka["sasl.password"], kafka["sasl.username"]) == ("0123", "on")


def test_registry_settings_from_the_environment_stay_strings():
    raw = with_()
    apply_env_overrides(
        raw,
        {
            "ONCEFLOW_REGISTRY__URL": "https://registry:8081/apis/ccompat/v7",
            "ONCEFLOW_REGISTRY__BASIC_AUTH_USER_INFO": "on",
            "ONCEFLOW_REGISTRY__SSL_KEY_PASSWORD": "0123",
        },
    )
    registry = parse(raw).registry
    assert registry.url == "https://registry:8081/apis/ccompat/v7"
    assert (registry.basic_auth_user_info, registry.ssl_key_password) == ("on", "0123")


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"window": {"typ": "x"}}, "window.typ: unknown field (did you mean 'type'?)"),
        ({"window": {"type": "sliding"}}, "window.slide: is required"),
        ({"window": {"type": "sliding", "slide": "20s"}}, "window.slide: must not exceed"),
        ({"window": {"gap": "5s"}}, "window.gap: does not apply to tumbling windows"),
        ({"window": {"aggregations": {"n": "median(bytes)"}}}, "window.aggregations.n:"),
        ({"window": {"aggregations": {"key": "count(*)"}}}, "'key' is a reserved output field"),
        ({"event_time": {"field": "tss"}}, "event_time.field: field 'tss' is not in the input"),
        ({"source": {"format": "avro"}}, "source.schema_file: is required for format avro"),
        (
            {"source": {"format": "avro-confluent", "schema_file": "click.avsc"}},
            "registry.url: is required for source.format avro-confluent",
        ),
        ({"registry": {"url": "registry:8081"}}, "registry.url: must be an http:// or https://"),
        ({"registry": {"url": "http://r", "password": "x"}}, "registry.password: unknown field"),
        ({"registry": {"url": "https://me:pw@r:8081"}}, "registry.url: must not hold user:pass"),
        ({"sink": None}, "sink: is required"),
        ({"app_id": None, "checkpoint": {"location": "/ck"}}, "app_id: is required"),
    ],
)
def test_errors_name_the_field(sections, message):
    raw = with_(**{k: v for k, v in sections.items() if k != "app_id"})
    if "app_id" in sections:
        raw.pop("app_id")
    with pytest.raises(ConfigError) as info:
        parse(raw)
    assert message in str(info.value)


def test_every_kafka_setting_can_come_from_the_environment(tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(BASE))
    config = load(
        path,
        environ={
            "ONCEFLOW_KAFKA__SASL_USERNAME": "svc",
            "ONCEFLOW_KAFKA__SASL_PASSWORD": "pw",
            "ONCEFLOW_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
            "ONCEFLOW_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
        },
    )
    assert config.kafka["sasl.username"] == "svc"
    assert config.kafka["sasl.mechanism"] == "SCRAM-SHA-512"
    assert config.kafka["security.protocol"] == "SASL_SSL"


def test_librdkafkas_one_underscored_setting_keeps_its_name():
    raw = {**BASE, "kafka": {"bootstrap_servers": "b:9092", "log_level": "3"}}
    assert parse(raw).kafka["log_level"] == "3"


def test_secrets_are_referenced_from_the_environment_or_a_file(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    raw = {
        **BASE,
        "kafka": {
            "bootstrap_servers": "${BROKERS}",
            "sasl.username": "svc",
            "sasl.password": f"${{file:{secret}}}",
        },
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load(path, environ={"BROKERS": "b1:9092,b2:9092"})
    assert config.kafka["bootstrap.servers"] == "b1:9092,b2:9092"
    assert config.kafka["sasl.password"] == "s3cret"
    with pytest.raises(ConfigError, match="kafka.bootstrap_servers: refers to environment"):
        load(path, environ={})


def test_a_misspelled_kafka_setting_is_refused_naming_it():
    raw = {**BASE, "kafka": {"bootstrap_servers": "b:9092", "sasl.usrname": "x"}}
    with pytest.raises(ConfigError, match="kafka.sasl.usrname: No such configuration property"):
        parse(raw)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("socket_timeout_ms", "90000"), ("message_timeout_ms", "120000"), ("acks", "1")],
)
def test_a_setting_the_sinks_transactional_producer_would_refuse_is_refused_here(setting, value):
    """librdkafka checks these against the transaction timeout or idempotence only for the
    producer the sink makes at its first commit."""
    kafka = {"bootstrap_servers": "b:9092", setting: value}
    with pytest.raises(ConfigError, match=rf"kafka\.{setting.replace('_', '.')}: .*librdkafka"):
        parse(with_(kafka=kafka))


def test_a_socket_timeout_within_the_transaction_timeout_is_accepted():
    kafka = {"bootstrap_servers": "b:9092", "socket_timeout_ms": "90000"}
    raised = parse(with_(kafka=kafka, sink={"transaction_timeout": "90s"}))
    assert raised.kafka["socket.timeout.ms"] == "90000"
    assert parse(with_(kafka={**kafka, "socket_timeout_ms": "30s"}))  # librdkafka reads 30
    assert parse(with_(kafka=kafka, sink={"guarantee": "at_least_once"}))


# -- named inputs and sql ----------------------------------------------------------------------

JOIN = {
    "app_id": "join",
    "kafka": {"bootstrap_servers": "b:9092"},
    "sources": {
        "persons": {
            "topics": ["persons"],
            "schema": "id LONG, dateTime LONG",
            "event_time": {"field": "dateTime", "watermark_delay": "5s"},
        },
        "auctions": {"topics": "auctions", "schema": "id LONG, seller LONG"},
    },
    "sql": "SELECT * FROM persons JOIN auctions ON id = seller",
    "key": "seller",
    "sink": {"topic": "out"},
    "checkpoint": {"location": "/ck"},
}


def join_with(**changes):
    raw = copy.deepcopy(JOIN)
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return raw


def test_named_inputs_keep_their_own_event_time_and_a_single_source_is_named_input():
    config = parse(join_with())
    persons, auctions = config.sources
    assert (persons.name, persons.event_time.field, persons.event_time.watermark_delay_ms) == (
        "persons",
        "dateTime",
        5_000,
    )
    assert (auctions.name, auctions.topics, auctions.event_time) == ("auctions", ["auctions"], None)
    assert (config.kind, config.key) == ("sql", "seller")
    single = parse(BASE)
    assert [s.name for s in single.sources] == ["input"]
    assert single.event_time.field == "ts"


@pytest.mark.parametrize(
    ("changes", "path", "words"),
    [
        ({"sql": None, "key": None}, "sources", "several inputs need sql"),
        ({"source": {"topics": ["x"]}}, "sources", "either source"),
        ({"event_time": {"field": "dateTime"}}, "event_time", "each input has its own"),
        ({"sql": "  "}, "sql", "must be a Spark SQL query"),
        ({"window": BASE["window"]}, "window", "set one of window, transform and sql"),
        ({"transform": "m:f"}, "transform", "set one of window, transform and sql"),
        ({"sources": {"my-input": {"topics": ["x"]}}}, "sources.my-input", "view in sql"),
        ({"sources": {}}, "sources", "at least one input"),
        ({"sources": {"Persons": {"topics": ["x"]}}}, "sources.Persons", "lower-case"),
        (
            {
                "sources": {
                    "a": {"topics": ["x"], "format": "raw"},
                    "b": {"topics": ["y", "x"], "format": "raw"},
                }
            },
            "sources.b.topics",
            "['x'] already read by input 'a'",
        ),
        (
            {
                "sources": {
                    "a": {"topics": "x", "format": "raw"},
                    "b": {"topics": "y,x", "format": "raw"},  # as Spark's `subscribe` reads it
                }
            },
            "sources.b.topics",
            "['x'] already read by input 'a'",
        ),
    ],
)
def test_named_inputs_and_sql_errors_name_their_field(changes, path, words):
    with pytest.raises(ConfigError) as caught:
        parse(join_with(**changes))
    assert caught.value.path == path and words in str(caught.value), str(caught.value)


def test_an_input_error_names_the_input():
    sources = join_with()["sources"]
    sources["auctions"].pop("schema")
    with pytest.raises(ConfigError, match=r"^sources.auctions.schema: is required"):
        parse(join_with(sources=sources))
    sources = join_with()["sources"]
    sources["persons"]["event_time"]["field"] = "datetime"
    with pytest.raises(ConfigError, match=r"^sources.persons.event_time.field: .*'dateTime'"):
        parse(join_with(sources=sources))


def test_key_applies_to_sql_only():
    with pytest.raises(ConfigError, match="^key: applies to sql pipelines"):
        parse({**BASE, "key": "user"})


def test_a_sql_pipeline_keeps_sparks_watermark_for_late_rows():
    conf = {"conf": {"spark.sql.streaming.statefulOperator.allowMultiple": "false"}}
    with pytest.raises(ConfigError, match="allowMultiple: must stay true"):
        parse(join_with(spark=conf))


def lookup_with(**changes) -> dict:
    """auctions looks up persons (a table): persons keyed by id, auctions by seller."""
    sources = {
        "persons": {"topics": ["persons"], "schema": "id LONG, name STRING"},
        "auctions": {
            "topics": ["auctions"],
            "schema": "id LONG, seller LONG",
            "lookup": {"persons": "seller"},
        },
    }
    for name, block in changes.items():
        sources[name] = {**sources[name], **block}
        sources[name] = {k: v for k, v in sources[name].items() if v is not None}
    return join_with(sources=sources, sql="SELECT id, persons.name FROM auctions")


def test_an_input_another_looks_up_is_a_table_read_from_the_earliest_offset():
    persons, auctions = parse(lookup_with()).sources
    assert (persons.table, persons.starting_offsets, persons.lookups) == (True, "earliest", ())
    assert (auctions.table, auctions.starting_offsets) == (False, "latest")
    assert [(x.table, x.field) for x in auctions.lookups] == [("persons", "seller")]
    given = parse(lookup_with(persons={"starting_offsets": "latest"})).sources[0]
    assert given.starting_offsets == "latest"


@pytest.mark.parametrize(
    ("changes", "path", "words"),
    [
        (
            {"auctions": {"lookup": {"people": "seller"}}},
            "sources.auctions.lookup.people",
            "persons",
        ),
        (
            {"auctions": {"lookup": {"auctions": "seller"}}},
            "sources.auctions.lookup.auctions",
            "no other",
        ),
        (
            {"auctions": {"lookup": {"persons": "buyer"}}},
            "sources.auctions.lookup.persons",
            "'buyer'",
        ),
        ({"auctions": {"lookup": {"persons": 3}}}, "sources.auctions.lookup.persons", "must name"),
        (
            {"persons": {"event_time": {"field": "id"}}},
            "sources.persons.event_time",
            "a table has no event time",
        ),
        ({"persons": {"format": "raw", "schema": None}}, "sources.persons.format", "json or avro"),
        (
            {"persons": {"lookup": {"auctions": "id"}}},  # each the other's table
            "sources.auctions.lookup",
            "looks nothing up",
        ),
        (
            {"auctions": {"schema": "id LONG, seller LONG, Persons STRING"}},  # Spark: one name
            "sources.auctions.lookup.persons",
            "has a column 'persons' already",
        ),
        ({"persons": {"topics": ["a", "b"]}}, "sources.persons.topics", "a table reads one topic"),
        ({"persons": {"topics": "a, b"}}, "sources.persons.topics", "a table reads one topic"),
        ({"persons": {"topics": ["a,b"]}}, "sources.persons.topics", "a table reads one topic"),
        ({"persons": {"topics": " , "}}, "sources.persons.topics", "list of topic names"),
    ],
)
def test_lookup_errors_name_their_field(changes, path, words):
    with pytest.raises(ConfigError) as caught:
        parse(lookup_with(**changes))
    assert caught.value.path == path and words in str(caught.value), str(caught.value)


def test_a_looked_up_column_may_differ_from_a_field_by_case_only_where_spark_tells_case_apart():
    raw = lookup_with(auctions={"schema": "id LONG, seller LONG, Persons STRING"})
    raw["spark"] = {"conf": {"spark.sql.caseSensitive": "true"}}
    (auctions,) = [s for s in parse(raw).sources if s.name == "auctions"]
    assert [x.table for x in auctions.lookups] == ["persons"]


def test_a_table_serves_one_stream():
    raw = lookup_with()
    raw["sources"]["bids"] = {
        "topics": ["bids"],
        "schema": "auction LONG, bidder LONG",
        "lookup": {"persons": "bidder"},
    }
    with pytest.raises(ConfigError, match="already looked up by 'auctions'"):
        parse(raw)


def test_topic_names_are_read_as_sparks_subscribe_reads_them():
    raw = lookup_with()
    raw["sources"]["auctions"]["topics"] = [" auctions , bids,", "asks"]
    (auctions,) = [s for s in parse(raw).sources if s.name == "auctions"]
    assert auctions.topics == ["auctions", "bids", "asks"]
