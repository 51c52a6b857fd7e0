"""The `onceflow-kafka` data source: one name for the Kafka source and the transactional sink."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import StructType

from .records import SOURCE_SCHEMA
from .sink import KafkaStreamWriter
from .source import KafkaStreamReader


class KafkaDataSource(DataSource):
    """`spark.readStream.format("onceflow-kafka")` and `writeStream.format("onceflow-kafka")`."""

    @classmethod
    def name(cls) -> str:
        return "onceflow-kafka"

    def schema(self) -> str:
        return SOURCE_SCHEMA

    def streamReader(self, schema: StructType) -> KafkaStreamReader:
        return KafkaStreamReader(self.options)

    def streamWriter(self, schema: StructType, overwrite: bool) -> KafkaStreamWriter:
        return KafkaStreamWriter(self.options, schema)
