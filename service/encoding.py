"""Result rows to Kafka records: the group key as the record key, the row as JSON or Avro.

JSON values look like {"key": ..., "window_start": <ms>, "window_end": <ms>, "<agg>": ...}.
Avro values are schemaless Avro (no registry framing) of the record schema `avro_schema`
derives from the result columns; `onceflow validate --print-avro-schema` could print it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from functools import partial

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    StringType,
    StructType,
)

AVRO_OF_SPARK = {
    LongType: "long",
    IntegerType: "int",
    DoubleType: "double",
    FloatType: "float",
    StringType: "string",
    BooleanType: "boolean",
    BinaryType: "bytes",
}


def encode(result: DataFrame, fmt: str) -> DataFrame:
    key_type = result.schema["key"].dataType
    key = F.to_json("key") if isinstance(key_type, StructType) else F.col("key").cast("string")
    if fmt == "json":
        return result.select(key.alias("key"), F.to_json(F.struct(*result.columns)).alias("value"))
    schema = avro_schema(result.schema)
    keyed = result.select(key.alias("_record_key"), F.struct(*result.columns).alias("_row"))
    out = StructType.fromDDL("key STRING, value BINARY")
    return keyed.mapInArrow(partial(_encode_avro, json.dumps(schema)), out)


def avro_schema(schema: StructType, name: str = "WindowResult") -> dict:
    """An Avro record schema for a Spark struct of flat fields (every field nullable)."""
    fields = []
    for field in schema.fields:
        fields.append(
            {"name": field.name, "type": ["null", _avro_type(field.dataType, field.name)]}
        )
    return {"type": "record", "name": name, "namespace": "dev.onceflow", "fields": fields}


def _avro_type(data_type: DataType, name: str):
    if isinstance(data_type, StructType):
        return avro_schema(data_type, name=f"{name.capitalize()}Record")
    for spark_type, avro in AVRO_OF_SPARK.items():
        if isinstance(data_type, spark_type):
            return avro
    raise ValueError(
        f"result column {name!r} of type {data_type.simpleString()} has no Avro mapping"
    )


def _encode_avro(schema_json: str, batches: Iterator) -> Iterator:
    import pyarrow as pa
    from fastavro import parse_schema, schemaless_writer

    schema = parse_schema(json.loads(schema_json))
    for batch in batches:
        values = []
        for row in batch.column("_row").to_pylist():
            buffer = io.BytesIO()
            schemaless_writer(buffer, schema, row)
            values.append(buffer.getvalue())
        yield pa.RecordBatch.from_arrays(
            [batch.column("_record_key"), pa.array(values, pa.binary())], names=["key", "value"]
        )
