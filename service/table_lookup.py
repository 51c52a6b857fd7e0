"""A stream joined to a table: each stream record gets the table's latest entry for its key.

A table is an input of `sources:` that another input looks up (`lookup: {persons: seller}`):
a topic read as the latest value per Kafka key, a record with a null value deleting its key
(a compacted topic, Kafka Streams' KTable). The stream's view gains a column named after the
table: the entry whose key equals the stream record's field written as text (a string or an
integral field; `42` finds the key `42`), or null. Keys are compared as bytes, so a key that is
not text (a serialized long, say) is kept but found by no stream record.

"As of its epoch": in every epoch the table's records are applied first, in offset order,
then the stream's records are joined. Both inputs' ranges are fixed in the offset log before
the epoch runs and the table lives in Spark's state store, checkpointed with the epoch, so a
replayed epoch joins exactly as it did the first time.

The join is one `transformWithState` over the union of both inputs, keyed by the key: the
only state is the table, one entry per key, in the RocksDB state store.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC

from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from .config import VIEW_COLUMNS

# Stream fields that are written as text one way only (a DOUBLE 1.0 would be "1.0"; a
# DECIMAL with a scale "1.00").
KEY_TYPES = (StringType, ByteType, ShortType, IntegerType, LongType, BooleanType, DateType)
KEY = "_lookup_key"
NO_KEY = "_lookup_key_missing"  # a stream record whose field is null joins nothing
IS_TABLE = "_lookup_is_table"
DELETED = "_lookup_deleted"
POSITION = ("_lookup_topic", "_lookup_partition", "_lookup_offset")
ENTRY = "_lookup_entry_"  # prefix of the table's fields in the union


class LatestEntry(StatefulProcessor):
    """Per key: apply the epoch's table records (the last one by offset wins; a null value
    deletes), then yield the epoch's stream records with the entry."""

    def __init__(self, entry: StructType, stream_columns: list[str], column: str) -> None:
        self.entry_schema = entry
        self.stream_columns = stream_columns
        self.column = column

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.entry = handle.getValueState("entry", self.entry_schema)

    def handleInputRows(self, key, rows: Iterator[Row], timerValues) -> Iterator[Row]:
        stream = []
        last_change = None
        for row in rows:
            if not row[IS_TABLE]:
                stream.append(row)
            elif last_change is None or _position(row) > _position(last_change):
                last_change = row
        if last_change is not None:
            if last_change[DELETED]:
                self.entry.clear()
            else:
                fields = self.entry_schema.fieldNames()
                self.entry.update(tuple(last_change[ENTRY + name] for name in fields))
        if not stream:
            return
        entry = None
        stored = None if key[0] else self.entry.get()  # key[0]: the stream's field is null
        if stored is not None:
            entry = _aware(self.entry_schema, stored)  # a Row, as the output takes it
        for row in stream:
            values = {name: row[name] for name in self.stream_columns}
            yield Row(**values, **{self.column: entry})

    def close(self) -> None:
        pass


def _aware(data_type: DataType, value):
    """`value` of `data_type` as the state store handed it back, with every TimestampType
    value in it made aware again: the store returns naive datetimes in the worker's local
    time, which the output would read as UTC."""
    if value is None:
        return None
    if isinstance(data_type, TimestampType):
        return value.astimezone(UTC)  # a naive datetime is local time
    if isinstance(data_type, StructType):
        fields = zip(data_type.fields, value, strict=True)
        return Row(**{field.name: _aware(field.dataType, item) for field, item in fields})
    if isinstance(data_type, ArrayType):
        return [_aware(data_type.elementType, item) for item in value]
    if isinstance(data_type, MapType):
        return {
            _aware(data_type.keyType, k): _aware(data_type.valueType, v) for k, v in value.items()
        }
    return value


def _position(row: Row) -> tuple:
    return tuple(row[name] for name in POSITION)


def can_look_up_by(data_type: DataType) -> bool:
    whole = isinstance(data_type, DecimalType) and data_type.scale == 0
    return whole or isinstance(data_type, KEY_TYPES)


def looked_up(
    stream: DataFrame, table: DataFrame, column: str, field: str, event_time: bool
) -> DataFrame:
    """`stream` with a column `column`: `table`'s latest entry whose Kafka key equals the
    stream record's `field` as UTF-8 text, as of the record's epoch; null if none.

    `stream` and `table` are routed inputs (decoded fields, `event_time`, the Kafka
    record's columns); with `event_time`, the stream's watermark carries over to the result.
    """
    entry = StructType([f for f in table.schema.fields if f.name not in VIEW_COLUMNS])
    stream_fields = list(stream.schema.fields)
    nothing = {f.name: F.lit(None).cast(f.dataType) for f in stream_fields}
    no_entry = {ENTRY + f.name: F.lit(None).cast(f.dataType) for f in entry.fields}
    text = F.encode(F.col(field).cast("string"), "UTF-8")
    stream_side = stream.select(
        F.coalesce(text, F.lit("").cast("binary")).alias(KEY),
        F.col(field).isNull().alias(NO_KEY),
        F.lit(False).alias(IS_TABLE),
        F.lit(False).alias(DELETED),
        F.lit(None).cast("string").alias(POSITION[0]),
        F.lit(None).cast("int").alias(POSITION[1]),
        F.lit(None).cast("long").alias(POSITION[2]),
        *[F.col(f.name) for f in stream_fields],
        *[value.alias(name) for name, value in no_entry.items()],
    )
    table_side = table.select(
        F.col("_key").alias(KEY),  # bytes: a key that is not UTF-8 never reaches Python as text
        F.lit(False).alias(NO_KEY),
        F.lit(True).alias(IS_TABLE),
        F.col("_value").isNull().alias(DELETED),
        F.col("_topic").alias(POSITION[0]),
        F.col("_partition").alias(POSITION[1]),
        F.col("_offset").alias(POSITION[2]),
        *[value.alias(name) for name, value in nothing.items()],
        *[F.col(f.name).alias(ENTRY + f.name) for f in entry.fields],
    )
    output = StructType(
        [StructField(f.name, f.dataType, True) for f in stream_fields]
        + [StructField(column, entry, True)]
    )
    return (
        stream_side.unionByName(table_side)
        .groupBy(NO_KEY, KEY)
        .transformWithState(
            statefulProcessor=LatestEntry(entry, [f.name for f in stream_fields], column),
            outputStructType=output,
            outputMode="Append",
            timeMode="None",
            eventTimeColumnName="event_time" if event_time else "",
        )
    )
