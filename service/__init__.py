"""onceflow: exactly-once stream processing on Kafka, with PySpark as the engine."""

__version__ = "0.1.0"
