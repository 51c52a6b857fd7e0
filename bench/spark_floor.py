"""Spark's own cost of a tiny job on this machine: the floor under an onceflow epoch.

    .venv/bin/python -m bench.spark_floor     # prints JSON; bench.recovery runs it

Times, in a warm onceflow SparkSession (`local[2]`), a two-task job over ten rows that stays
in the JVM, and the same job through one `mapInArrow` (one Python stage, as a Python data
source's read or write is): the median of 15 runs after 5 warm-up runs each.
"""

from __future__ import annotations

import json
import statistics
import time

WARM_UP, RUNS = 5, 15


def _identity(batches):
    yield from batches


def _median_ms(job) -> float:
    for _ in range(WARM_UP):
        job()
    runs = []
    for _ in range(RUNS):
        start = time.perf_counter()
        job()
        runs.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(runs), 1)


def main() -> None:
    from onceflow.spark_session import build_session

    spark = build_session("local[2]", "onceflow-spark-floor")
    rows = spark.range(0, 10, 1, 2)
    print(
        json.dumps(
            {
                "jvm_job_ms": _median_ms(lambda: rows.selectExpr("id + 1").collect()),
                "one_python_stage_job_ms": _median_ms(
                    lambda: rows.mapInArrow(_identity, rows.schema).collect()
                ),
            }
        )
    )
    spark.stop()


if __name__ == "__main__":
    main()
