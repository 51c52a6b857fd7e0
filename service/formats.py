"""The record formats, each with its decoding and its encoding: json, avro, avro-confluent, raw.

Input records are decoded in the router (`routing.py`): a value that does not decode becomes a
dead letter whose `onceflow.error` header says why. Window results are encoded for the sink:
JSON values look like {"key": ..., "window_start": <ms>, "window_end": <ms>, "<agg>": ...};
Avro values are schemaless Avro of the record schema `avro_schema` derives from the result
columns; avro-confluent values are the same bodies in the Confluent wire format, the schema
registered in a schema registry. One table maps Avro types to Spark and Arrow types.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from functools import cache, partial

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StructType

from onceflow.connectors import registry as registry_wire
from onceflow.connectors.registry import RegistryClient, RegistrySettings, WriterSchemaError

# Avro type -> (Spark SQL type, pyarrow type factory): flat records of these, nullable or not.
AVRO_TYPES = {
    "string": ("STRING", "string"),
    "long": ("BIGINT", "int64"),
    "int": ("INT", "int32"),
    "double": ("DOUBLE", "float64"),
    "float": ("FLOAT", "float32"),
    "boolean": ("BOOLEAN", "bool_"),
    "bytes": ("BINARY", "binary"),
}
# Avro's timestamp logical types (a long) -> microseconds per unit: they are read as Spark
# TIMESTAMPs (microseconds, UTC; a local timestamp is taken as UTC), and a date (an int of
# days) as a DATE. Every other logical type is read as its underlying type: a uuid as STRING,
# a decimal as its BINARY two's-complement bytes, a timestamp-nanos as a BIGINT.
AVRO_TIMESTAMP_MICROS = {
    "timestamp-millis": 1000,
    "timestamp-micros": 1,
    "local-timestamp-millis": 1000,
    "local-timestamp-micros": 1,
}
INT64_RANGE = range(-(2**63), 2**63)


# How much of a decoder's message a dead letter's reason keeps (fastavro's can hold whole
# parsed schemas).
REASON_DETAIL_CHARS = 300

# -- json ----------------------------------------------------------------------------------


def json_error(value: bytes, ddl: str) -> str:
    """Why a value does not decode as a JSON object of the schema: the first problem found."""
    try:
        parsed = json.loads(value)
    except UnicodeDecodeError as exc:
        return f"value is not UTF-8 text (byte {exc.start})"
    except json.JSONDecodeError as exc:
        return f"value is not valid JSON: {exc.msg} at character {exc.pos}"
    if not isinstance(parsed, dict):
        return f"value is JSON {type(parsed).__name__}, not an object"
    integer, number = int, (int, float)
    expected = {
        "BIGINT": integer,
        "LONG": integer,
        "INT": integer,
        "INTEGER": integer,
        "SMALLINT": integer,
        "DOUBLE": number,
        "FLOAT": number,
        "BOOLEAN": bool,
        "STRING": str,
    }
    for part in ddl.split(","):
        words = part.split()
        if len(words) >= 2 and parsed.get(words[0]) is not None:
            kind, got = expected.get(words[1].upper()), parsed[words[0]]
            if kind and (not isinstance(got, kind) or (kind is int and isinstance(got, bool))):
                return f"field {words[0]!r} is {json.dumps(got)[:80]}, not {words[1].upper()}"
    return f"value does not match the schema {ddl!r}"


# -- avro ----------------------------------------------------------------------------------


def decode_avro(
    schema_json: str | None,
    fields: tuple[str, ...],
    values: list,
    registry: RegistrySettings | None = None,
) -> tuple[dict, list[str | None]]:
    """Decoded fields as Arrow arrays, and a reason for every value that does not decode.

    Without `registry` a value is a schemaless Avro body of the schema. With it, a value is
    in the Confluent wire format: its writer schema comes from the registry by id and is
    resolved to the schema (the reader's). A registry that does not answer raises: the
    epoch fails rather than dead-lettering records that are fine.
    """
    import pyarrow as pa
    from fastavro import schemaless_reader

    reader = parsed_avro_schema(schema_json)
    timestamps = avro_timestamp_fields(json.loads(schema_json or "{}"))
    client = registry_wire.client_for(registry) if registry is not None else None
    budget = registry_wire.UnknownIdBudget()
    writers: dict[int, dict] = {}  # parsed writer schemas of this batch, by id
    columns: dict[str, list] = {f: [] for f in fields}
    reasons: list[str | None] = []
    for value in values:
        record, reason = None, None
        if value is None:
            reason = "record value is null"
        elif client is None:
            record, reason = _read_avro(schemaless_reader, value, reader, None, "schema")
        else:
            record, reason = _read_framed(client, budget, writers, value, reader)
        if record:
            reason = timestamps_as_micros(record, timestamps)
            record = None if reason else record
        reasons.append(reason)
        for f in fields:
            columns[f].append(record.get(f) if record else None)
    types = avro_arrow_types(json.loads(schema_json or "{}"))
    return {f: pa.array(columns[f], types[f]) for f in fields}, reasons


def timestamps_as_micros(record: dict, timestamps: dict[str, int]) -> str | None:
    """Turn the record's timestamp fields (read as their longs) into microseconds, in place;
    why not, for a value no timestamp can hold."""
    for name, micros_per_unit in timestamps.items():
        value = record.get(name)
        if value is None:
            continue
        if value * micros_per_unit not in INT64_RANGE:
            return f"field {name!r} is {value}, too large for a timestamp"
        record[name] = value * micros_per_unit
    return None


def _read_framed(
    client: RegistryClient,
    budget: registry_wire.UnknownIdBudget,
    writers: dict[int, dict],
    value: bytes,
    reader: dict,
):
    """(record, None) of a value in the Confluent wire format resolved to `reader`, or (None,
    why not). `writers` keeps the batch's parsed writer schemas by id."""
    from fastavro import schemaless_reader

    try:
        schema_id, body = registry_wire.unframe(value)
    except ValueError as exc:
        return None, str(exc)
    if schema_id not in writers:
        try:
            writers[schema_id] = _writer_schema(client, schema_id, budget)
        except WriterSchemaError as exc:  # the registry's own failures fail the epoch
            return None, str(exc)
    what = f"writer schema id {schema_id}"
    return _read_avro(schemaless_reader, body, writers[schema_id], reader, what)


def _read_avro(read, body: bytes, writer: dict, reader: dict | None, what: str):
    """(record, None), or (None, why the body is not Avro of `writer` resolved to `reader`)."""
    try:
        buffer = io.BytesIO(body)
        record = read(buffer, writer, reader)
        if buffer.tell() != len(body):
            raise ValueError(f"{len(body) - buffer.tell()} bytes left over")
    except Exception as exc:  # fastavro raises many kinds for corrupt bytes
        detail = str(exc)[:REASON_DETAIL_CHARS]
        if type(exc).__name__ == "SchemaResolutionError":
            name = _schema_name(reader or writer)
            return None, f"{what} does not resolve to the reader schema {name!r}: {detail}"
        return None, f"value is not Avro of {what} {_schema_name(writer)!r}: {detail}"
    return record, None


def _schema_name(schema) -> str:
    """A record's name, or the type of any other schema (a union is a list)."""
    if isinstance(schema, dict):
        return str(schema.get("name") or schema.get("type"))
    return "union" if isinstance(schema, list) else str(schema)


def _writer_schema(
    client: RegistryClient, schema_id: int, budget: registry_wire.UnknownIdBudget
) -> dict:
    """The parsed writer schema of an id, its references parsed into the same names."""
    schemas = json.dumps(client.schema_by_id(schema_id, budget), sort_keys=True)
    try:
        return parsed_with_references(schemas)
    except WriterSchemaError as exc:
        raise WriterSchemaError(f"writer schema id {schema_id}: {exc}") from None


@cache
def parsed_with_references(schemas_json: str) -> dict:
    from fastavro import parse_schema

    try:
        named: dict = {}
        *referenced, root = json.loads(schemas_json)
        for schema in referenced:
            parse_schema(without_logical_types(schema), named_schemas=named)
        return parse_schema(without_logical_types(root), named_schemas=named)
    except Exception as exc:  # fastavro's kinds for a schema it cannot parse
        raise WriterSchemaError(f"the writer schema does not parse: {exc}") from None


@cache
def parsed_avro_schema(schema_json: str | None) -> dict:
    from fastavro import parse_schema

    return parse_schema(without_logical_types(json.loads(schema_json or "{}")))


def without_logical_types(schema):
    """The schema with its logical types left out: fastavro then reads each as the type
    under it (a timestamp as its long) instead of as a Python datetime, date, UUID or
    Decimal, which the Arrow types of `avro_arrow_types` do not take."""
    if isinstance(schema, list):
        return [without_logical_types(s) for s in schema]
    if isinstance(schema, dict):
        return {k: without_logical_types(v) for k, v in schema.items() if k != "logicalType"}
    return schema


def avro_field_types(schema: dict) -> dict[str, str]:
    """Spark SQL type per top-level field of a flat Avro record schema (nullable unions ok)."""
    result = {}
    for field in schema.get("fields", []):
        kind = field["type"]
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"]
            kind = kinds[0] if len(kinds) == 1 else None
        if isinstance(kind, dict):
            if kind.get("logicalType") in AVRO_TIMESTAMP_MICROS:
                result[field["name"]] = "TIMESTAMP"
                continue
            if kind.get("logicalType") == "date":
                result[field["name"]] = "DATE"
                continue
            kind = kind.get("type") if kind.get("logicalType") else None
        if kind not in AVRO_TYPES:
            raise ValueError(
                f"Avro field {field['name']!r} has type {field['type']!r}; onceflow reads flat "
                f"records of {', '.join(AVRO_TYPES)} (optionally nullable)"
            )
        result[field["name"]] = AVRO_TYPES[kind][0]
    return result


def avro_arrow_types(schema: dict) -> dict:
    import pyarrow as pa

    arrow = {sql: getattr(pa, name)() for sql, name in AVRO_TYPES.values()}
    arrow["TIMESTAMP"] = pa.timestamp("us", tz="UTC")
    arrow["DATE"] = pa.date32()
    return {name: arrow[sql] for name, sql in avro_field_types(schema).items()}


def avro_timestamp_fields(schema: dict) -> dict[str, int]:
    """Microseconds per unit of each top-level field of a timestamp logical type."""
    found = {}
    for field in schema.get("fields", []):
        kinds = field["type"] if isinstance(field["type"], list) else [field["type"]]
        for kind in kinds:
            if isinstance(kind, dict) and kind.get("logicalType") in AVRO_TIMESTAMP_MICROS:
                found[field["name"]] = AVRO_TIMESTAMP_MICROS[kind["logicalType"]]
    return found


# -- encoding results ----------------------------------------------------------------------


def encode(
    result: DataFrame,
    fmt: str,
    registered: Callable[[dict], int] | None = None,
    key: str | None = "key",
    record: str = "WindowResult",
):
    """Key and value columns of the results: the value holds every column, the record key is
    column `key` (None: no key). Avro values are records named `record`; avro-confluent
    values carry the id that `registered` gives the results' schema (it registers it: a
    refusal stops the run here, before the query starts and anything is produced)."""
    if key is None:
        key = F.lit(None).cast("string")
    elif isinstance(result.schema[key].dataType, StructType):
        key = F.to_json(_column(key))
    else:
        key = _column(key).cast("string")
    columns = [_column(c) for c in result.columns]
    if fmt == "json":
        return result.select(key.alias("key"), F.to_json(F.struct(*columns)).alias("value"))
    schema = avro_schema(result.schema, record)
    schema_id = None
    if fmt == "avro-confluent":
        assert registered is not None
        schema_id = registered(schema)
    keyed = result.select(key.alias("_record_key"), F.struct(*columns).alias("_row"))
    out = StructType.fromDDL("key STRING, value BINARY")
    return keyed.mapInArrow(partial(_encode_avro, json.dumps(schema), schema_id), out)


def _column(name: str) -> Column:
    """A result column by its name as written: a SQL result's may hold a dot (`window.start`)."""
    return F.col("`" + name.replace("`", "``") + "`")


def avro_schema(schema: StructType, name: str = "WindowResult") -> dict:
    """An Avro record schema for a Spark struct of flat fields (every field nullable, with a
    null default: a pipeline that gains or loses an aggregation stays compatible both ways)."""
    fields = []
    for field in schema.fields:
        kind = ["null", _avro_type(field.dataType, field.name)]
        fields.append({"name": field.name, "type": kind, "default": None})
    return {"type": "record", "name": name, "namespace": "dev.onceflow", "fields": fields}


def _avro_type(data_type: DataType, name: str):
    if isinstance(data_type, StructType):
        return avro_schema(data_type, name=f"{name.capitalize()}Record")
    for avro, (sql, _arrow) in AVRO_TYPES.items():
        if data_type.simpleString() == sql.lower():
            return avro
    raise ValueError(
        f"result column {name!r} of type {data_type.simpleString()} has no Avro mapping"
    )


def _encode_avro(schema_json: str, schema_id: int | None, batches: Iterator) -> Iterator:
    import pyarrow as pa
    from fastavro import parse_schema, schemaless_writer

    schema = parse_schema(json.loads(schema_json))
    for batch in batches:
        values = []
        for row in batch.column("_row").to_pylist():
            buffer = io.BytesIO()
            schemaless_writer(buffer, schema, row)
            body = buffer.getvalue()
            values.append(body if schema_id is None else registry_wire.frame(schema_id, body))
        yield pa.RecordBatch.from_arrays(
            [batch.column("_record_key"), pa.array(values, pa.binary())], names=["key", "value"]
        )
