import time
from datetime import UTC, datetime

from pyspark.sql.types import (
    ArrayType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from onceflow.table_lookup import _aware


def test_a_stored_timestamp_comes_back_as_the_same_instant_whatever_the_workers_time_zone(
    monkeypatch,
):
    """The state store returns a TimestampType value as a naive datetime in the worker's
    local time; the output would read a naive datetime as UTC, shifting it."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        instant = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
        naive_local = datetime.fromtimestamp(instant.timestamp())  # as the store returns it
        inner = StructType([StructField("since", TimestampType())])
        schema = StructType(
            [
                StructField("id", LongType()),
                StructField("joined", TimestampType()),
                StructField("account", inner),
                StructField("visits", ArrayType(inner)),
                StructField("last_seen", MapType(StringType(), TimestampType())),
                StructField("local", TimestampNTZType()),  # naive by design: left as it is
            ]
        )
        values = (7, naive_local, (naive_local,), [(naive_local,)], {"web": naive_local})
        row = _aware(schema, (*values, naive_local))
        assert row.id == 7
        assert row.joined == instant and row.joined.utcoffset().total_seconds() == 0
        assert row.account.since == instant
        assert row.visits[0].since == instant and row.last_seen == {"web": instant}
        assert row.local == naive_local
        assert _aware(schema, (None,) * 6).joined is None
    finally:
        monkeypatch.undo()
        time.tzset()
