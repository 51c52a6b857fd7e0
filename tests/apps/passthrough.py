"""A pass-through query (source -> transactional sink), run as its own process by crash tests.

Drains the input with Trigger.AvailableNow and exits 0, or 1 if the query failed.
"""

from __future__ import annotations

import argparse
import sys

from onceflow.spark_session import build_session
from tests.helpers import started


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("--bootstrap", "--source", "--sink", "--checkpoint", "--app"):
        parser.add_argument(name, required=True)
    parser.add_argument("--max-per-batch", default="500")
    args = parser.parse_args()

    spark = build_session("local[2]", "passthrough")
    source = (
        spark.readStream.format("onceflow-kafka")
        .option("kafka.bootstrap.servers", args.bootstrap)
        .option("subscribe", args.source)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", args.max_per_batch)
        .load()
    )
    query = started(
        source.selectExpr("key", "value")
        .writeStream.format("onceflow-kafka")
        .option("kafka.bootstrap.servers", args.bootstrap)
        .option("topic", args.sink)
        .option("appId", args.app)
        .option("checkpointLocation", args.checkpoint)
        .trigger(availableNow=True)
    )
    query.awaitTermination()
    if query.exception() is not None:
        print(f"query failed: {query.exception()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
