"""From a pipeline file to a running Spark streaming query: source -> route -> process -> sink.

The processing itself is Spark's: `withWatermark`, `window` / `session_window` and the
RocksDB state store, a user's `transform` function (which may use transformWithState), or a
Spark SQL query over the named inputs (joins included).
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from py4j.protocol import Py4JError, Py4JJavaError
from pyspark import Accumulator
from pyspark.errors import AnalysisException, ParseException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import StructField, StructType, TimestampType

from onceflow.connectors.records import HEADER_SOURCE, POSITION_SEPARATOR
from onceflow.connectors.registry import client_for
from onceflow.connectors.sink import ForeachBatchSink

from . import formats
from .config import (
    AVRO_FORMATS,
    DEFAULT_SOURCE,
    ConfigError,
    EventTimeConfig,
    PipelineConfig,
    SourceConfig,
    load_avro_schema,
)
from .formats import avro_field_types
from .routing import CORRUPT, EVENT_TIME, SOURCE_META, RoutePlan, route
from .table_lookup import can_look_up_by, looked_up

log = logging.getLogger("onceflow.pipeline")
T = TypeVar("T")

FORMAT = "onceflow-kafka"

# Spark's words when a Python process it started did not connect back within 10 s (fixed in
# PythonWorkerFactory.createSimpleWorker, not a setting).
SOURCE_WORKER_LATE = "Python worker failed to connect back"
START_ATTEMPTS = 3
SQL_RESULT = "SqlResult"  # the Avro record name of a sql pipeline's results
AVRO_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def source_stream(spark: SparkSession, config: PipelineConfig, source: SourceConfig) -> DataFrame:
    reader = spark.readStream.format(FORMAT)
    for key, value in config.kafka.items():
        reader = reader.option(f"kafka.{key}", value)
    reader = (
        reader.option("subscribe", ",".join(source.topics))
        .option("startingOffsets", source.starting_offsets)
        .option("maxOffsetsPerTrigger", str(source.max_records_per_batch))
        .option("failOnDataLoss", str(source.fail_on_data_loss).lower())
        .option("group.id", f"onceflow-{config.app_id}")
        .option("checkpointLocation", config.checkpoint_location)
    )
    if source.path != "source":  # a named input of `sources:` (see KafkaStreamReader)
        reader = reader.option("inputName", source.name)
    parallelism = source.parallelism or spark.sparkContext.defaultParallelism
    return reader.option("parallelism", str(parallelism)).load()


def routed_stream(
    spark: SparkSession,
    config: PipelineConfig,
    source: SourceConfig,
    input_bytes: Accumulator | None = None,
) -> DataFrame:
    """Decoded, on-time records of one input; dead letters and late records are staged for the
    sink.

    `input_bytes` sums the key and value bytes read, for the metrics endpoint.
    """
    raw = source_stream(spark, config, source)
    # A record without headers has null headers (as in Spark's Kafka source). Handing a list
    # column of nulls to Python costs Spark's Arrow writer time in ListVector.setValueCount
    # that grows with the nulls in the batch: 1.9 s per 200k rows against 0.2 s for empty
    # lists, and 42% of the JVM's samples in the benchmark's Q1. So: empty lists. Windows
    # leave the column out altogether: aggregates never read it.
    no_headers = F.array().cast(raw.schema["headers"].dataType)
    columns = {
        "_key": F.col("key"),
        "_value": F.col("value"),
        "_topic": F.col("topic"),
        "_partition": F.col("partition"),
        "_offset": F.col("offset"),
        "_timestamp": F.col("timestamp"),
        "_headers": F.coalesce("headers", no_headers),
    }
    carried = tuple(m for m in SOURCE_META if config.window is None or m != "_headers")
    staged = raw.select(*[columns[m].alias(m) for m in carried])
    if source.format == "json":
        ddl = f"{source.schema}, {CORRUPT} STRING"
        staged = staged.withColumn(
            "_data",
            F.from_json(
                F.col("_value").cast("string"),
                ddl,
                {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT},
            ),
        )
        fields = [f for f in staged.schema["_data"].dataType.fields if f.name != CORRUPT]
    elif source.format in AVRO_FORMATS:
        avro_schema = load_avro_schema(config, source)
        types = avro_field_types(avro_schema)
        fields = list(StructType.fromDDL(", ".join(f"`{n}` {t}" for n, t in types.items())).fields)
    else:
        fields = []
    window = config.window
    event_time = source.event_time or EventTimeConfig()
    late_rule = window.type if window else EVENT_TIME if config.sql and source.event_time else None
    plan = RoutePlan(
        checkpoint=config.checkpoint_location,
        source=source.name,
        format=source.format,
        fields=tuple(f.name for f in fields),
        required=tuple(window.key) if window else (),
        event_time_field=event_time.field,
        dead_letter_topic=config.sink.dead_letter_topic,
        late_topic=config.sink.late_topic,
        window_type=late_rule,
        window_size_ms=window.size_ms if window else 0,
        window_slide_ms=(window.slide_ms or window.size_ms) if window else 0,
        session_gap_ms=(window.gap_ms or 0) if window else 0,
        avro_schema_json=json.dumps(avro_schema) if source.format in AVRO_FORMATS else None,
        json_schema_ddl=source.schema if source.format == "json" else None,
        registry=config.registry if source.format == "avro-confluent" else None,
        meta=carried,
        table=source.table,
    )
    meta = [f for f in staged.schema.fields if f.name in carried]
    schema = StructType(
        [StructField(f.name, f.dataType, True) for f in fields]
        + [StructField("event_time", TimestampType(), True)]
        + meta
    )
    return staged.mapInArrow(partial(route, plan, input_bytes), schema)


def windowed(routed: DataFrame, config: PipelineConfig) -> DataFrame:
    """Window results as key/value records (value: JSON or Avro, see formats.py)."""
    window = config.window
    assert window is not None
    delay = f"{config.event_time.watermark_delay_ms} milliseconds"
    stream = routed.withWatermark("event_time", delay)
    if window.type == "session":
        bucket = F.session_window("event_time", f"{window.gap_ms} milliseconds")
    else:
        slide = f"{window.slide_ms} milliseconds" if window.slide_ms else None
        bucket = F.window("event_time", f"{window.size_ms} milliseconds", slide)
    aggregates = [_aggregate(a.function, a.column).alias(a.name) for a in window.aggregations]
    grouped = stream.groupBy(bucket.alias("window"), *window.key).agg(*aggregates)
    key = F.col(window.key[0]) if len(window.key) == 1 else F.struct(*window.key)
    result = grouped.select(
        key.alias("key"),
        F.unix_millis(F.col("window.start")).alias("window_start"),
        F.unix_millis(F.col("window.end")).alias("window_end"),
        *[F.col(a.name) for a in window.aggregations],
    )
    return formats.encode(result, config.sink.format, partial(_register_results, config))


def transformed(routed: DataFrame, config: PipelineConfig) -> DataFrame:
    """The user's `transform` function: DataFrame -> DataFrame with a `value` column."""
    assert config.transform is not None
    module_name, function_name = config.transform.split(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("transform", f"cannot load {config.transform!r}: {exc}") from None
    stream = routed
    if config.event_time.watermark_delay_ms or config.event_time.field:
        stream = routed.withWatermark(
            "event_time", f"{config.event_time.watermark_delay_ms} milliseconds"
        )
    result = function(stream)
    if not isinstance(result, DataFrame) or "value" not in result.columns:
        columns = result.columns if isinstance(result, DataFrame) else type(result).__name__
        raise ConfigError(
            "transform",
            f"{config.transform} must return a DataFrame with a 'value' column (and optionally "
            f"key, topic, partition, headers); it returned {columns}",
        )
    return result


def passed_through(routed: DataFrame) -> DataFrame:
    """Input records unchanged, with their source position in an `onceflow.source` header
    (`records.position`, built by Spark)."""
    position = F.concat_ws(POSITION_SEPARATOR, "_topic", "_partition", "_offset").cast("binary")
    source_header = F.struct(F.lit(HEADER_SOURCE).alias("key"), position.alias("value"))
    headers = F.concat("_headers", F.array(source_header))
    return routed.select(
        F.col("_key").alias("key"), F.col("_value").alias("value"), headers.alias("headers")
    )


def sql_result(
    spark: SparkSession, config: PipelineConfig, input_bytes: Accumulator | None = None
) -> DataFrame:
    """The `sql:` query over a view of each input by name, analysed by Spark.

    A view holds the input's decoded fields, `event_time` and the Kafka record's `_key`,
    `_value`, `_topic`, `_partition`, `_offset`, `_timestamp` and `_headers`; an input with
    an event time has a watermark, which Spark's stream-stream joins and windows need.
    Spark's refusal of the query (its message names the line and position) is a ConfigError
    of `sql`.
    """
    assert config.sql is not None
    views = [source for source in config.sources if not source.table]
    inputs = {source.name: source for source in config.sources}
    routed = {source.name: routed_stream(spark, config, source, input_bytes) for source in views}
    for source in views:  # before any view exists: a refusal leaves none behind
        for lookup in source.lookups:
            key_type = routed[source.name].schema[lookup.field].dataType
            if not can_look_up_by(key_type):
                raise ConfigError(
                    f"{source.path}.lookup.{lookup.table}",
                    f"field {lookup.field!r} is {key_type.simpleString()}; a table is looked "
                    "up by a field whose text is the key (a string, an integral number, a "
                    "whole decimal, a boolean or a date), so cast it in the schema",
                )
    for source in views:
        view = routed[source.name]
        if source.event_time is not None:
            delay = f"{source.event_time.watermark_delay_ms} milliseconds"
            view = view.withWatermark("event_time", delay)
        for lookup in source.lookups:
            table = routed_stream(spark, config, inputs[lookup.table], input_bytes)
            has_event_time = source.event_time is not None
            view = looked_up(view, table, lookup.table, lookup.field, has_event_time)
        view.createOrReplaceTempView(source.name)
    try:
        result = spark.sql(config.sql)
        plan = _analysed_plan(result)
        if plan is not None:
            _check_streaming(result, plan)
    except (AnalysisException, ParseException) as exc:
        message = f"Spark refuses the query: {str(exc).strip()}"
        for source in views:
            for lookup in source.lookups:
                if "TABLE_OR_VIEW_NOT_FOUND" in message and f"`{lookup.table}`" in message:
                    message += (
                        f"\n{lookup.table!r} is a table, looked up by {source.name!r}: read it "
                        f"as the column {source.name}.{lookup.table}"
                    )
        raise ConfigError("sql", message) from None
    finally:  # the query keeps its plan; a later run in this session must not find the views
        for source in views:
            spark.catalog.dropTempView(source.name)
    if not result.isStreaming:
        raise ConfigError("sql", "reads none of the inputs: a pipeline's query reads its streams")
    if plan is not None:
        inlined = _ctes_inlined(result, plan)  # as the query will run: unused CTEs gone
        _check_each_input_read_once(config, inlined)
        _check_watermarks(config, inlined)
    columns = result.columns
    lowered = [c.lower() for c in columns]  # Spark resolves names ignoring case
    repeated = sorted({c for c in columns if lowered.count(c.lower()) > 1})
    if repeated:
        raise ConfigError(
            "sql", f"the result has several columns named {repeated}; give each its own (AS)"
        )
    if config.key is not None and config.key not in columns:
        raise ConfigError("key", f"{config.key!r} is not a column of the query's result {columns}")
    if config.sink.format in AVRO_FORMATS:
        unnamed = [c for c in columns if not AVRO_NAME.match(c)]
        if unnamed:
            raise ConfigError(
                "sql", f"result columns {unnamed} are not Avro field names; name them with AS"
            )
        try:
            formats.avro_schema(result.schema)
        except ValueError as exc:
            raise ConfigError("sql", f"{exc}; cast it in the query (sink.format is Avro)") from None
    return result


def _spark_internal(call: Callable[[], T]) -> T | None:
    """`call()`, which reaches Spark's internal API through py4j; None where this Spark does
    not offer what it calls (the check that asked is then skipped, and the query start makes
    Spark's own). Spark's own errors (Py4JJavaError) go through."""
    try:
        return call()
    except Py4JJavaError:
        raise
    except Py4JError:
        return None


def _analysed_plan(result: DataFrame):
    """The query's analysed plan (a JVM object) for the checks below, which read Spark's
    internal plan classes."""
    return _spark_internal(lambda: result._jdf.queryExecution().analyzed())


def _ctes_inlined(result: DataFrame, plan):
    """`plan` with its common table expressions inlined wherever they are read, as Spark's
    optimiser does when the query starts (its InlineCTE rule, always inlining): one read
    twice is then two scans, one never read is gone. `plan` itself where this Spark's rule
    is not what this calls, or refuses the plan (the query start then decides)."""
    rule = result.sparkSession._jvm.org.apache.spark.sql.catalyst.optimizer.InlineCTE
    for arguments in ((True, False, False), (True, False)):  # Spark 4.3; 4.2
        try:
            return rule(*arguments).apply(plan)
        except Py4JJavaError as exc:
            log.warning("could not inline the query's CTEs (%s); checking it as written", exc)
            return plan
        except Py4JError:  # no such constructor: try the next
            continue
    return plan


def _check_streaming(result: DataFrame, plan) -> None:
    """What Spark checks only when a streaming query starts (append mode, watermarks on the
    sides of an outer join, aggregations it cannot emit once), checked now: `validate` runs
    this without starting anything. The checker is Spark's internal API; without it the
    query start does the same check."""
    jvm = result.sparkSession._jvm
    checker = jvm.org.apache.spark.sql.catalyst.analysis.UnsupportedOperationChecker
    # Its refusals are AnalysisException, through pyspark's conversion of Spark's errors.
    _spark_internal(
        lambda: checker.checkForStreaming(
            plan, jvm.org.apache.spark.sql.streaming.OutputMode.Append()
        )
    )


def _check_each_input_read_once(config: PipelineConfig, plan) -> None:
    """Every input is read by exactly one scan of the query. A view named twice (a self-join)
    is two scans that plan their batches apart, so a record could be routed, and its dead
    letter published, in two epochs; an input never named would hold its offsets forever."""
    scans = _input_scans(plan)
    if scans is None:
        return
    names = {source.name for source in config.sources}
    foreign = sorted({str(scan) for scan in scans if scan not in names})
    if foreign:
        raise ConfigError(
            "sql", f"reads streams that are not inputs of this pipeline ({foreign}); read inputs"
        )
    read = Counter(scans)
    twice = sorted(name for name, n in read.items() if n > 1)
    if twice:
        raise ConfigError(
            "sql",
            f"reads input(s) {twice} more than once; a self-join is not supported yet (each "
            "reference would be a scan of its own, with dead letters published once per scan)",
        )
    for source in config.sources:
        if not read[source.name]:
            raise ConfigError(
                f"sources.{source.name}", "is not read by the sql query; remove it or use it"
            )


def _input_scans(plan) -> list[str | None] | None:
    """The input of every streaming scan in the query's analysed plan: its `inputName`, or
    `input` for a pipeline's one `source:`, or None for a stream that is not onceflow's. None
    where Spark's internal plan classes are not what this reads (the check is then skipped).
    A common table expression read twice is one scan unless the plan has them inlined
    (`_ctes_inlined`)."""

    def scans() -> list[str | None]:
        leaves = plan.collectLeaves()
        found: list[str | None] = []
        for i in range(leaves.size()):
            leaf = leaves.apply(i)
            if leaf.getClass().getSimpleName() == "StreamingRelationV2":
                ours = leaf.sourceName() == FORMAT
                name = leaf.extraOptions().get("inputName") if ours else None
                found.append((name or DEFAULT_SOURCE) if ours else None)
        return found

    return _spark_internal(scans) or None


def _check_watermarks(config: PipelineConfig, plan) -> None:
    """The watermarks are the inputs' own (`event_time:`): one the query sets itself (SQL's
    WATERMARK clause) would make Spark drop rows the router never routed as late."""
    # A table lookup's UpdateEventTimeWatermarkColumn carries the input's own over.
    found = _spark_internal(lambda: len(re.findall(r"\bEventTimeWatermark\b", plan.toString())))
    if found is None:
        return
    own = sum(1 for source in config.sources if source.event_time is not None)
    if found > own:
        raise ConfigError(
            "sql",
            "sets a watermark of its own (WATERMARK); give the input an event_time: with a "
            "watermark_delay instead, so that its late records go to the late topic",
        )


def queried(
    spark: SparkSession, config: PipelineConfig, input_bytes: Accumulator | None = None
) -> DataFrame:
    """The `sql:` query's results as key/value records (key: the column `key:` names)."""
    result = sql_result(spark, config, input_bytes)
    register = partial(_register_results, config)
    return formats.encode(result, config.sink.format, register, config.key, SQL_RESULT)


def output_of(
    spark: SparkSession, config: PipelineConfig, input_bytes: Accumulator | None = None
) -> tuple[DataFrame, str]:
    """The query's output (key, value and maybe headers, topic, partition) and output mode."""
    if config.sql is not None:
        return queried(spark, config, input_bytes), "append"
    routed = routed_stream(spark, config, config.source, input_bytes)
    if config.window is not None:
        return windowed(routed, config), config.window.output_mode
    if config.transform is not None:
        return transformed(routed, config), "append"
    return passed_through(routed), "append"


def start(
    spark: SparkSession,
    config: PipelineConfig,
    available_now: bool = False,
    input_bytes: Accumulator | None = None,
) -> StreamingQuery:
    for source in config.sources:  # a wrong registry URL fails here, not record by record
        if source.format == "avro-confluent":
            assert config.registry is not None
            client_for(config.registry).check()
    output, mode = output_of(spark, config, input_bytes)
    options = {f"kafka.{key}": value for key, value in config.kafka.items()}
    options |= {
        "topic": config.sink.topic,
        "appId": config.app_id,
        "sinkName": config.sink.topic,
        "checkpointLocation": config.checkpoint_location,
        "guarantee": config.sink.guarantee,
        "transactionTimeoutMs": str(config.sink.transaction_timeout_ms),
    }
    if config.sink.marker_topic:
        options["markerTopic"] = config.sink.marker_topic
    if config.sink.dead_letter_topic:
        options["deadLetterTopic"] = config.sink.dead_letter_topic
    writer = output.writeStream.outputMode(mode).queryName(config.app_id)
    if mode == "update":  # Spark's Python sinks take append mode only
        writer = writer.foreachBatch(ForeachBatchSink(options))
    else:
        writer = writer.format(FORMAT)
    writer = writer.options(**options)
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{config.trigger_interval_ms} milliseconds")
    return writer.start()


def _register_results(config: PipelineConfig, schema: dict) -> int:
    """Register the results' schema under the sink's subject; its id."""
    assert config.registry is not None
    return client_for(config.registry).register(config.sink.value_subject, schema)


def _aggregate(function: str, column: str):
    if function == "count":
        return F.count(F.lit(1)) if column == "*" else F.count(column)
    return getattr(F, function)(column)


def missed_its_start(query: StreamingQuery) -> bool:
    """True when the query ended before its first epoch because one of Spark's Python
    processes missed its deadline to connect back.

    Spark gives the process behind a Python source (started with the query) and the one that
    checks transformWithState's schema (first epoch) 10 s to start Python and connect; on a
    machine short of CPU they can miss it. Starting again replays from the checkpoint, as
    any restart does, and no epoch of this run had completed.
    """
    error = query.exception()
    return (
        not query.isActive
        and query.lastProgress is None
        and error is not None
        and SOURCE_WORKER_LATE in str(error)
    )
