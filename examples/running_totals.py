"""A `transform:` pipeline with keyed state: a running total of bytes per user.

Use it with `transform: examples.running_totals:running_totals` in a pipeline file whose
input has `user` and `bytes` fields. The state lives in Spark's RocksDB state store and is
checkpointed with each epoch, so totals survive restarts exactly once. A user unseen for
a day is forgotten (state TTL).
"""

from __future__ import annotations

from collections.abc import Iterator

import pandas as pd
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle

ONE_DAY_MS = 24 * 3600 * 1000


class RunningTotal(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        self.total = handle.getValueState("total", "total LONG", ttlDurationMs=ONE_DAY_MS)

    def handleInputRows(
        self, key, rows: Iterator[pd.DataFrame], timerValues
    ) -> Iterator[pd.DataFrame]:
        total = self.total.get()[0] if self.total.exists() else 0
        for batch in rows:
            total += int(batch["bytes"].fillna(0).sum())
        self.total.update((total,))
        yield pd.DataFrame({"user": [key[0]], "total_bytes": [total]})

    def close(self) -> None:
        pass


def running_totals(clicks: DataFrame) -> DataFrame:
    """DataFrame of clicks -> one record per user and epoch with the user's total so far."""
    totals = clicks.groupBy("user").transformWithStateInPandas(
        statefulProcessor=RunningTotal(),
        outputStructType="user STRING, total_bytes LONG",
        outputMode="Update",
        timeMode="ProcessingTime",  # state TTL counts processing time
    )
    return totals.select(
        F.col("user").alias("key"), F.to_json(F.struct("user", "total_bytes")).alias("value")
    )
