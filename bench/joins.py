"""Nexmark Q8's and Q3's joins, side by side with peers: people and the auctions they open.

    make bench-joins   # = .venv/bin/python -m bench.joins [--people 100000] [--query q3]

Q8 asks for the people who opened an auction within 10 s of joining. Here it is the
stream-stream interval join that each system can express: every auction with its seller's
person record when the auction opened within 10 s after the person joined
(`examples/new-sellers.yaml`):
- onceflow exactly-once: a `sources:` + `sql:` pipeline (SQL_JOIN);
- Spark's JVM Kafka source and sink, at-least-once (bench/spark_kafka.py, the same SQL);
- Quix Streams exactly-once: `join_interval` (bench/quix_app.py), which needs both topics
  keyed and partitioned by the join key, as they are here.
Each drains the same preloaded backlog in a process of its own, and its output topic is then
read with read_committed and compared, as a multiset of (seller, auction) pairs, with the
join computed here from the records themselves: a system that loses or doubles a pair is
reported, not ranked. Throughput is input records / processing seconds, as in bench/run.py.
Writes bench/results/joins.json and joins.md (Q8), joins-q3.json and joins-q3.md (Q3).

Q3 asks which auctions of category 10 are sold by people in Oregon, Idaho or California: an
auction joined with its seller's person record, which came before it. Each system expresses
it as it best can:
- onceflow: persons as a table the auctions look up (`lookup:`, Q3_SQL);
- Spark's JVM connector: a stream-stream inner join without watermarks (the same join; both
  sides' state kept for ever, as Nexmark's Q3 is defined);
- Quix Streams: `join_asof`, each auction with its seller's latest record at or before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path

import yaml
from confluent_kafka import Producer

from bench.run import QUIX_VENV, RESULTS, Measured, _last_json, ensure_quix, onceflow_processing
from onceflow.connectors.topics import create_topic, read_committed
from onceflow.local_kafka import LocalKafka

PARTITIONS = 3
BOUND_S = 10  # an auction joins its seller when it opens within 10 s after the seller joined
PERSON_EVERY_MS = 5  # Nexmark: a person per 50 events, 10 events a millisecond
AUCTIONS_PER_PERSON = 3  # Nexmark: three auctions per person
SELLER_BACK = 4_000  # a seller is one of the 4,000 newest people: 20 s back, half within 10 s
PER_BATCH = 50_000  # records per input per epoch (onceflow, Spark)
PERSON_SCHEMA = "id LONG, name STRING, dateTime LONG"
AUCTION_SCHEMA = "id LONG, seller LONG, reserve LONG, dateTime LONG"
STATES = ("AZ", "CA", "ID", "OR", "WA", "WY")  # Nexmark's US states
Q3_STATES = ("OR", "ID", "CA")
Q3_CATEGORY = 10  # of 10-14
Q3_PERSON_SCHEMA = "id LONG, name STRING, state STRING, dateTime LONG"
Q3_AUCTION_SCHEMA = "id LONG, seller LONG, category LONG, reserve LONG, dateTime LONG"
Q3_SQL = f"""
SELECT seller, persons.name AS name, persons.state AS state, id AS auction
FROM auctions
WHERE category = {Q3_CATEGORY} AND persons.state IN {Q3_STATES}
"""
SQL_JOIN = f"""
SELECT a.seller, p.name, a.id AS auction
FROM persons p JOIN auctions a
  ON p.id = a.seller
 AND a.event_time BETWEEN p.event_time AND p.event_time + INTERVAL {BOUND_S} SECONDS
"""


def people_and_auctions(people: int, first_ms: int, seed: int = 8) -> tuple[list[dict], list[dict]]:
    """Nexmark-like records in event-time order from `first_ms`: a person every 5 ms, three
    auctions in the same 5 ms, each sold by one of the SELLER_BACK newest people."""
    rng = random.Random(seed)
    persons = [
        {"id": i, "name": f"person-{i}", "dateTime": first_ms + PERSON_EVERY_MS * i}
        for i in range(people)
    ]
    auctions = []
    for j in range(AUCTIONS_PER_PERSON * people):
        newest = j // AUCTIONS_PER_PERSON
        auctions.append(
            {
                "id": j,
                "seller": newest - rng.randrange(min(SELLER_BACK, newest + 1)),
                "reserve": rng.randrange(100, 100_000),
                "dateTime": first_ms + PERSON_EVERY_MS * newest + j % AUCTIONS_PER_PERSON,
            }
        )
    return persons, auctions


def with_states_and_categories(persons: list[dict], auctions: list[dict], seed: int = 3) -> None:
    """Q3's fields: a state per person, a category (10-14) per auction, as Nexmark draws them."""
    rng = random.Random(seed)
    for person in persons:
        person["state"] = rng.choice(STATES)
    for auction in auctions:
        auction["category"] = 10 + rng.randrange(5)


def expected_q3_pairs(persons: list[dict], auctions: list[dict]) -> Counter:
    """Q3 computed from the records: (seller, auction) for each auction of the category whose
    seller lives in one of the states."""
    state = {p["id"]: p["state"] for p in persons}
    return Counter(
        (a["seller"], a["id"])
        for a in auctions
        if a["category"] == Q3_CATEGORY and state[a["seller"]] in Q3_STATES
    )


def expected_pairs(persons: list[dict], auctions: list[dict]) -> Counter:
    """The join, computed from the records: (seller, auction) once per matching auction."""
    joined = {p["id"]: p["dateTime"] for p in persons}
    return Counter(
        (a["seller"], a["id"])
        for a in auctions
        if joined[a["seller"]] <= a["dateTime"] <= joined[a["seller"]] + BOUND_S * 1000
    )


def preload(bootstrap: str, topic: str, records: list[dict], key: str) -> None:
    """Keyed by `key` and partitioned by it (key % PARTITIONS), as Quix's joins require, with
    the event time as the record's timestamp: Quix orders the two topics' records by it.
    Every record is delivered once, or this fails: the comparison counts on it."""
    failed: list = []
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "enable.idempotence": True,
        }
    )
    for record in records:
        value = json.dumps(record, separators=(",", ":")).encode()
        while True:
            try:
                producer.produce(
                    topic,
                    value,
                    str(record[key]).encode(),
                    record[key] % PARTITIONS,
                    timestamp=record["dateTime"],
                    on_delivery=lambda error, _message: error and failed.append(error),
                )
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(300) or failed:
        raise RuntimeError(f"preloading {topic}: {len(failed)} records failed ({failed[:1]})")


def q3_pipeline(bootstrap: str, topics: dict[str, str], sink: str, checkpoint: str) -> dict:
    """Q3 as onceflow runs it: the auctions look up their seller in the persons table."""
    sources = {
        "persons": {"topics": [topics["persons"]], "schema": Q3_PERSON_SCHEMA},
        "auctions": {
            "topics": [topics["auctions"]],
            "starting_offsets": "earliest",
            "schema": Q3_AUCTION_SCHEMA,
            "lookup": {"persons": "seller"},
        },
    }
    for source in sources.values():
        source["max_records_per_batch"] = PER_BATCH
    return _bench_pipeline("q3", bootstrap, sources, Q3_SQL, sink, checkpoint)


def pipeline(bootstrap: str, topics: dict[str, str], sink: str, checkpoint: str) -> dict:
    event_time = {"field": "dateTime", "watermark_delay": f"{BOUND_S}s"}
    sources = {
        name: {
            "topics": [topics[name]],
            "starting_offsets": "earliest",
            "schema": schema,
            "event_time": event_time,
            "max_records_per_batch": PER_BATCH,
        }
        for name, schema in (("persons", PERSON_SCHEMA), ("auctions", AUCTION_SCHEMA))
    }
    return _bench_pipeline("q8", bootstrap, sources, SQL_JOIN, sink, checkpoint)


def _bench_pipeline(
    query: str, bootstrap: str, sources: dict, sql: str, sink: str, checkpoint: str
) -> dict:
    """What both queries' pipelines share: keyed by seller, 1 s trigger, two local cores."""
    return {
        "app_id": f"bench-{query}-{sink}",
        "kafka": {"bootstrap_servers": bootstrap},
        "sources": sources,
        "sql": sql,
        "key": "seller",
        "sink": {"topic": sink},
        "checkpoint": {"location": checkpoint, "interval": "1s"},
        "spark": {"master": "local[2]"},
        "metrics": {"port": 0},
    }


def output_pairs(bootstrap: str, topic: str) -> Counter:
    """(seller, auction) of every record in `topic`, read with read_committed."""
    pairs: Counter = Counter()
    for message in read_committed(bootstrap, topic):
        value = json.loads(message.value())
        pairs[(int(value["seller"]), int(value["auction"]))] += 1
    return pairs


def compared(expected: Counter, got: Counter) -> dict:
    twice = sum(n - 1 for pair, n in got.items() if n > 1)
    return {
        "pairs": sum(got.values()),
        "missing": sum((expected - got).values()),
        "published_twice": twice,
        "not_in_the_join": sum((got - expected).values()) - twice,
        "exact": got == expected,
    }


class JoinBench:
    def __init__(self, bootstrap: str, work: Path, people: int, query: str) -> None:
        self.bootstrap, self.work, self.query = bootstrap, work, query
        # The data ends now: a broker deletes records its retention thinks are old.
        first_ms = int(time.time() * 1000) - PERSON_EVERY_MS * people
        self.persons, self.auctions = people_and_auctions(people, first_ms)
        if query == "q3":
            with_states_and_categories(self.persons, self.auctions)
        self.topics = {"persons": self.topic("persons"), "auctions": self.topic("auctions")}
        self.records = len(self.persons) + len(self.auctions)

    def expected(self) -> Counter:
        if self.query == "q3":
            return expected_q3_pairs(self.persons, self.auctions)
        return expected_pairs(self.persons, self.auctions)

    def topic(self, name: str) -> str:
        topic = f"bench-{self.query}-{name}-{uuid.uuid4().hex[:6]}"
        create_topic(self.bootstrap, topic, PARTITIONS)
        return topic

    def onceflow(self, sink: str) -> tuple[dict, Measured]:
        path = self.work / f"{self.query}-onceflow-{sink}.yaml"
        make = q3_pipeline if self.query == "q3" else pipeline
        config = make(self.bootstrap, self.topics, sink, str(self.work / f"ck-{sink}"))
        path.write_text(yaml.safe_dump(config))
        run = Measured(
            [sys.executable, "-m", "onceflow.cli", "run", str(path), "--available-now"],
            self.work / f"{self.query}-onceflow-{sink}.log",
        )
        return onceflow_processing(run.wait()), run

    def spark_jvm(self, sink: str) -> tuple[dict, Measured]:
        run = Measured(
            [
                sys.executable,
                "-m",
                "bench.spark_kafka",
                *("--query", self.query, "--bootstrap", self.bootstrap),
                *("--source", f"{self.topics['persons']},{self.topics['auctions']}"),
                *("--sink", sink, "--checkpoint", str(self.work / f"spark-ck-{sink}")),
            ],
            self.work / f"{self.query}-spark-{sink}.log",
        )
        return _last_json(run.wait()), run

    def quix(self, sink: str) -> tuple[dict, Measured]:
        run = Measured(
            [
                str(QUIX_VENV / "bin" / "python"),
                "bench/quix_app.py",
                *("--query", self.query, "--bootstrap", self.bootstrap),
                *("--source", f"{self.topics['persons']},{self.topics['auctions']}"),
                *("--sink", sink, "--records", str(self.records)),
                *("--state-dir", str(self.work / f"quix-{sink}")),
            ],
            self.work / f"{self.query}-quix-{sink}.log",
        )
        return _last_json(run.wait()), run


SYSTEMS = {
    "onceflow exactly-once": JoinBench.onceflow,
    "Quix Streams exactly-once": JoinBench.quix,
    "Spark JVM Kafka at-least-once": JoinBench.spark_jvm,
}


def report(results: dict) -> str:
    if results.get("query") == "q3":
        title = "Nexmark Q3's join"
        join = (
            f"an auction of category {Q3_CATEGORY} with its seller, who lives in "
            f"{', '.join(Q3_STATES)}"
        )
        how = (
            " onceflow looks the seller up in the persons table (`lookup:`), Spark joins two "
            "streams without watermarks, Quix Streams uses `join_asof`."
        )
    else:
        title = "Nexmark Q8's join"
        join = f"an auction with its seller, opened within {BOUND_S} s after the seller joined"
        how = ""
    lines = [
        f"# {title} ({results['machine']}, {results['date']})",
        "",
        f"{results['persons']:,} people and {results['auctions']:,} auctions over "
        f"{PARTITIONS} partitions each, keyed by person id and seller; the join ({join}) has "
        f"{results['expected_pairs']:,} pairs. Each system drains the whole backlog; its "
        "output is read with read_committed and compared with the join computed from the "
        f"records. `python -m bench.joins --query {results.get('query', 'q8')}`.{how}",
        "",
        "| system | records/s | processing (s) | drain (s) | peak RSS (MB) | pairs | "
        "missing | published twice | exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        if "failed" in row:
            lines.append(f"| {row['system']} | failed: {row['failed']} |||||||| ")
            continue
        lines.append(
            f"| {row['system']} | {row['records_per_s']:,} | {row['seconds']} | "
            f"{row['drain_s']} | {row['peak_rss_mb']:,} | {row['pairs']:,} | {row['missing']:,} "
            f"| {row['published_twice']:,} | {'yes' if row['exact'] else 'NO'} |"
        )
    lines += [
        "",
        "Throughput counts input records (people and auctions) over processing seconds: "
        "onceflow and Spark from the second epoch's start to the last epoch's end, Quix from "
        "its first record to its last commit. Drain is the process' start to its exit.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--people", type=int, default=100_000)
    parser.add_argument("--query", choices=("q8", "q3"), default="q8")
    parser.add_argument("--only", help="comma-separated systems (onceflow, quix, spark)")
    args = parser.parse_args()
    chosen = [
        s for s in SYSTEMS if not args.only or any(o in s.lower() for o in args.only.split(","))
    ]
    if any("Quix" in s for s in chosen):
        ensure_quix()
    if any("Spark" in s for s in chosen):
        from bench.spark_kafka import connector_jars

        connector_jars()  # fetched once, before anything is timed
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or LocalKafka.from_env().start()
    work = Path("/tmp") / f"onceflow-joins-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    bench = JoinBench(bootstrap, work, args.people, args.query)
    expected = bench.expected()
    print(
        f"preloading {len(bench.persons):,} people and {len(bench.auctions):,} auctions "
        f"(the join: {sum(expected.values()):,} pairs) ...",
        flush=True,
    )
    preload(bootstrap, bench.topics["persons"], bench.persons, "id")
    preload(bootstrap, bench.topics["auctions"], bench.auctions, "seller")
    rows = []
    for system in chosen:
        print(f"{system} ...", flush=True)
        sink = bench.topic("out")
        try:
            result, run = SYSTEMS[system](bench, sink)
        except RuntimeError as exc:  # the others still run; the failure is in the results
            print(f"  failed: {exc}", flush=True)
            rows.append({"system": system, "failed": str(exc)})
            continue
        check = compared(expected, output_pairs(bootstrap, sink))
        row = {
            "system": system,
            "records": result["records"],
            "seconds": round(result["seconds"], 2),
            "records_per_s": round(result["records"] / result["seconds"]),
            "drain_s": round(run.drain_s, 1),
            "peak_rss_mb": round(run.peak_rss_mb),
            **check,
        }
        print(f"  {json.dumps(row)}", flush=True)
        rows.append(row)
    results = {
        "query": args.query,
        "date": datetime.now().strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python "
        f"{platform.python_version()}",
        "persons": len(bench.persons),
        "auctions": len(bench.auctions),
        "expected_pairs": sum(expected.values()),
        "rows": rows,
    }
    if args.only:  # a partial run prints, and keeps the recorded results
        print(json.dumps(results, indent=2))
        return
    RESULTS.mkdir(exist_ok=True)
    name = "joins" if args.query == "q8" else f"joins-{args.query}"
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
