"""From a pipeline file to a running Spark streaming query: source -> route -> process -> sink.

The processing itself is Spark's: `withWatermark`, `window` / `session_window` and the
RocksDB state store, or a user's `transform` function (which may use transformWithState).
"""

from __future__ import annotations

import importlib
import json
from functools import partial

from pyspark import Accumulator
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import StructField, StructType, TimestampType

from onceflow.connectors.registry import client_for
from onceflow.connectors.sink import ForeachBatchSink

from . import formats
from .config import AVRO_FORMATS, ConfigError, PipelineConfig, load_avro_schema
from .formats import avro_field_types
from .routing import CORRUPT, HEADER_SOURCE, SOURCE_META, RoutePlan, route

FORMAT = "onceflow-kafka"

# Spark's words when a Python process it started did not connect back within 10 s (fixed in
# PythonWorkerFactory.createSimpleWorker, not a setting).
SOURCE_WORKER_LATE = "Python worker failed to connect back"
START_ATTEMPTS = 3


def source_stream(spark: SparkSession, config: PipelineConfig) -> DataFrame:
    reader = spark.readStream.format(FORMAT)
    for key, value in config.kafka.items():
        reader = reader.option(f"kafka.{key}", value)
    source = config.source
    reader = (
        reader.option("subscribe", ",".join(source.topics))
        .option("startingOffsets", source.starting_offsets)
        .option("maxOffsetsPerTrigger", str(source.max_records_per_batch))
        .option("failOnDataLoss", str(source.fail_on_data_loss).lower())
        .option("group.id", f"onceflow-{config.app_id}")
        .option("checkpointLocation", config.checkpoint_location)
    )
    parallelism = source.parallelism or spark.sparkContext.defaultParallelism
    return reader.option("parallelism", str(parallelism)).load()


def routed_stream(
    spark: SparkSession, config: PipelineConfig, input_bytes: Accumulator | None = None
) -> DataFrame:
    """Decoded, on-time input records; dead letters and late records are staged for the sink.

    `input_bytes` sums the key and value bytes read, for the metrics endpoint.
    """
    raw = source_stream(spark, config)
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
    source = config.source
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
        if source.format == "avro-confluent":  # a wrong URL fails here, not record by record
            assert config.registry is not None
            client_for(config.registry).check()
        avro_schema = load_avro_schema(config, "source.schema_file")
        types = avro_field_types(avro_schema)
        fields = list(StructType.fromDDL(", ".join(f"`{n}` {t}" for n, t in types.items())).fields)
    else:
        fields = []
    window = config.window
    plan = RoutePlan(
        checkpoint=config.checkpoint_location,
        format=source.format,
        fields=tuple(f.name for f in fields),
        required=tuple(window.key) if window else (),
        event_time_field=config.event_time.field,
        dead_letter_topic=config.sink.dead_letter_topic,
        late_topic=config.sink.late_topic,
        window_type=window.type if window else None,
        window_size_ms=window.size_ms if window else 0,
        window_slide_ms=(window.slide_ms or window.size_ms) if window else 0,
        session_gap_ms=(window.gap_ms or 0) if window else 0,
        avro_schema_json=json.dumps(avro_schema) if source.format in AVRO_FORMATS else None,
        json_schema_ddl=source.schema if source.format == "json" else None,
        registry=config.registry if source.format == "avro-confluent" else None,
        meta=carried,
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
    """Input records unchanged, with their source position in an `onceflow.source` header."""
    position = F.concat_ws("/", "_topic", "_partition", "_offset").cast("binary")
    source_header = F.struct(F.lit(HEADER_SOURCE).alias("key"), position.alias("value"))
    headers = F.concat("_headers", F.array(source_header))
    return routed.select(
        F.col("_key").alias("key"), F.col("_value").alias("value"), headers.alias("headers")
    )


def start(
    spark: SparkSession,
    config: PipelineConfig,
    available_now: bool = False,
    input_bytes: Accumulator | None = None,
) -> StreamingQuery:
    routed = routed_stream(spark, config, input_bytes)
    if config.window is not None:
        output, mode = windowed(routed, config), config.window.output_mode
    elif config.transform is not None:
        output, mode = transformed(routed, config), "append"
    else:
        output, mode = passed_through(routed), "append"
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
