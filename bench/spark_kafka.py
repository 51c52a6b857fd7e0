"""Peer: Spark's own JVM Kafka source and sink (spark-sql-kafka-0-10, at-least-once) running
the same four queries, in a process of its own.

    python -m bench.spark_kafka --query q5 --bootstrap B --source T --sink S --checkpoint DIR

Prints one JSON line: records read and the processing seconds from the query's progress
reports, the first (JVM warm-up) epoch left out, as for onceflow. The connector jars come
from Maven Central through `mvn`, like the local broker's (Ivy cannot use this machine's
proxy).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from datetime import datetime
from pathlib import Path

from onceflow.local_kafka import LocalKafka

# Spark 4.3's connector is not on Maven Central (as this machine reaches it) yet; 4.2's runs
# on the 4.3 runtime. Its token-provider 4.2.0 is missing there too; 4.0.0's serves.
CONNECTOR = "org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0"
TOKEN_PROVIDER = "org.apache.spark:spark-token-provider-kafka-0-10_2.13:4.0.0"


def connector_jars() -> list[str]:
    """The connector and its runtime dependencies that pyspark does not ship."""
    import pyspark

    target = LocalKafka.from_env().home / "spark-kafka-jars"
    if not any(target.glob("spark-sql-kafka*.jar")):
        group, artifact, version = CONNECTOR.split(":")
        _, token_artifact, token_version = TOKEN_PROVIDER.split(":")
        target.mkdir(parents=True, exist_ok=True)
        (target / "pom.xml").write_text(
            f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>onceflow</groupId><artifactId>spark-kafka-jars</artifactId><version>1</version>
  <dependencies>
    <dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId>
      <version>{version}</version>
      <exclusions><exclusion><groupId>{group}</groupId><artifactId>{token_artifact}</artifactId>
      </exclusion></exclusions></dependency>
    <dependency><groupId>{group}</groupId><artifactId>{token_artifact}</artifactId>
      <version>{token_version}</version></dependency>
  </dependencies>
</project>"""
        )
        # Spark's parent pom names a Google mirror of Central; send that to Central itself.
        (target / "settings.xml").write_text(
            """<settings><mirrors><mirror><id>central-for-gcs</id>
  <mirrorOf>gcs-maven-central-mirror</mirrorOf>
  <url>https://repo.maven.apache.org/maven2</url></mirror></mirrors></settings>"""
        )
        print(f"fetching {CONNECTOR} with mvn ...", flush=True)
        subprocess.run(
            [
                "mvn",
                "-q",
                "-s",
                str(target / "settings.xml"),
                "-f",
                str(target / "pom.xml"),
                "dependency:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={target}",
            ],
            check=True,
        )
    shipped = {_artifact(j.name) for j in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    return sorted(str(j) for j in target.glob("*.jar") if _artifact(j.name) not in shipped)


def _artifact(jar: str) -> str:
    """`kafka-clients-3.9.2.jar` -> `kafka-clients`."""
    parts = jar.removesuffix(".jar").split("-")
    return "-".join(p for p in parts if not p[:1].isdigit())


def _read(spark, bootstrap: str, topic: str, schema: str, per_trigger: int):
    """`topic`'s JSON records as columns of `schema`."""
    from pyspark.sql import functions as F

    raw = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("kafka.isolation.level", "read_committed")
        .option("maxOffsetsPerTrigger", per_trigger)
        .load()
    )
    return raw.select(F.from_json(F.col("value").cast("string"), schema).alias("r")).select("r.*")


def q8(spark, bootstrap: str, source: str):
    """bench/joins.py's join: `source` is the people's topic, a comma, the auctions' topic."""
    from pyspark.sql import functions as F

    from bench import joins

    watermark = f"{joins.BOUND_S} seconds"
    for name, topic, schema in zip(
        ("persons", "auctions"),
        source.split(","),
        (joins.PERSON_SCHEMA, joins.AUCTION_SCHEMA),
        strict=True,
    ):
        records = _read(spark, bootstrap, topic, schema, joins.PER_BATCH)
        records = records.withColumn("event_time", F.timestamp_millis("dateTime"))
        records.withWatermark("event_time", watermark).createOrReplaceTempView(name)
    result = spark.sql(joins.SQL_JOIN)
    value = F.to_json(F.struct("seller", "name", "auction"))
    return result.select(F.col("seller").cast("string").alias("key"), value.alias("value"))


def q3(spark, bootstrap: str, source: str):
    """bench/joins.py's Q3 as Spark streams express it: a stream-stream inner join without
    watermarks (each side kept in state for ever). `source`: people's topic, auctions'."""
    from pyspark.sql import functions as F

    from bench import joins

    persons_topic, auctions_topic = source.split(",")
    persons = _read(spark, bootstrap, persons_topic, joins.Q3_PERSON_SCHEMA, joins.PER_BATCH)
    auctions = _read(spark, bootstrap, auctions_topic, joins.Q3_AUCTION_SCHEMA, joins.PER_BATCH)
    persons.createOrReplaceTempView("persons")
    auctions.createOrReplaceTempView("auctions")
    result = spark.sql(
        f"""
        SELECT a.seller, p.name, p.state, a.id AS auction
        FROM auctions a JOIN persons p ON a.seller = p.id
        WHERE a.category = {joins.Q3_CATEGORY} AND p.state IN {joins.Q3_STATES}
        """
    )
    value = F.to_json(F.struct("seller", "name", "state", "auction"))
    return result.select(F.col("seller").cast("string").alias("key"), value.alias("value"))


def build_query(spark, query: str, bootstrap: str, source: str):
    from pyspark.sql import functions as F

    from bench.nexmark import BID_SCHEMA, EPOCH_RECORDS, WINDOWS

    if query == "q8":
        return q8(spark, bootstrap, source)
    if query == "q3":
        return q3(spark, bootstrap, source)
    bids = _read(spark, bootstrap, source, BID_SCHEMA, EPOCH_RECORDS)
    if query == "q1":
        value = F.to_json(
            F.struct(
                "auction",
                "bidder",
                (F.col("price") * 0.908).cast("bigint").alias("price"),
                "dateTime",
            )
        )
        return bids.select(F.col("auction").cast("string").alias("key"), value.alias("value"))
    window = WINDOWS[query]
    events = bids.withColumn("event_time", F.timestamp_millis("dateTime")).withWatermark(
        "event_time", "1 second"
    )
    if window["type"] == "session":
        bucket = F.session_window("event_time", window["gap"].replace("s", " seconds"))
    else:
        size = window["size"].replace("s", " seconds")
        slide = window.get("slide", window["size"]).replace("s", " seconds")
        bucket = F.window("event_time", size, slide)
    ((name, expr),) = window["aggregations"].items()
    function, column = expr.rstrip(")").split("(")
    aggregate = F.count(F.lit(1)) if column == "*" else getattr(F, function)(column)
    result = events.groupBy(bucket.alias("w"), window["key"]).agg(aggregate.alias(name))
    value = F.to_json(
        F.struct(
            F.col(window["key"]).alias("key"),
            F.unix_millis("w.start").alias("window_start"),
            F.unix_millis("w.end").alias("window_end"),
            name,
        )
    )
    return result.select(F.col(window["key"]).cast("string").alias("key"), value.alias("value"))


def _seconds(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("query", "bootstrap", "source", "sink", "checkpoint"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    from onceflow.spark_session import DEFAULT_CONF, state_partitions

    builder = SparkSession.builder.master(args.master).config(
        "spark.jars", ",".join(connector_jars())
    )
    for key, value in DEFAULT_CONF.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    cores = spark.sparkContext.defaultParallelism
    spark.conf.set("spark.sql.shuffle.partitions", str(state_partitions(args.master, cores)))
    spark.sparkContext.setLogLevel("WARN")
    query = (
        build_query(spark, args.query, args.bootstrap, args.source)
        .writeStream.format("kafka")
        .option("kafka.bootstrap.servers", args.bootstrap)
        .option("topic", args.sink)
        .option("checkpointLocation", args.checkpoint)
        .outputMode("append")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    steady = progress[1:] or progress  # the first epoch warms the JVM up
    first = _seconds(steady[0]["timestamp"])
    end = _seconds(steady[-1]["timestamp"]) + steady[-1]["batchDuration"] / 1000
    records = sum(p["numInputRows"] for p in steady)
    print(json.dumps({"records": records, "seconds": end - first}))


if __name__ == "__main__":
    main()
