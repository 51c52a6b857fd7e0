"""The Nexmark benchmark: onceflow next to its peers, same broker, same data, same machine.

    make bench        # = .venv/bin/python -m bench.run [--records 1000000]

Preloads Nexmark bids, then runs each system on Q1 (stateless), Q5 (sliding count), Q7
(tumbling max) and Q11 (session count), each draining the whole backlog in a process of its
own while this one samples the process tree's RSS:
- onceflow exactly-once, and onceflow at-least-once (`sink.guarantee: at_least_once`);
- the copier ceiling for Q1 (bench/copier.py) and a plain consumer's read rate;
- Quix Streams exactly-once (bench/quix_app.py, in bench/.venv-quix);
- Spark's JVM Kafka source and sink, at-least-once (bench/spark_kafka.py).
Then Q1 end-to-end latency at half of onceflow's saturation rate (onceflow with its default 1 s
trigger and with 250 ms), onceflow on 1 vs 2 cores,
and a profile of onceflow's Q1 and Q5 (bench/profile.py: JFR + py-spy). Throughput is
records / processing seconds: for onceflow and Spark from the second epoch's start to the last
epoch's end (the first starts Python workers and warms the JVM up), for Quix and the copier
from the first record read to the last commit. Q1 of the copier and of onceflow exactly-once,
the closest ratio, is the median of Q1_ROUNDS alternating runs.
Writes bench/results/nexmark.json, nexmark.md, nexmark.png and profile-q1.md, profile-q5.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

import yaml
from confluent_kafka import Consumer, Producer

from bench.connectors import plain_consumer
from bench.nexmark import QUERIES, bids, pipeline, preload
from bench.profile import children
from onceflow.connectors.topics import create_topic
from onceflow.local_kafka import LocalKafka

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
QUIX_VENV = REPO / "bench" / ".venv-quix"
QUIX_VERSION = "3.28.1"
PARTITIONS = 3
EPOCH_LINE = re.compile(
    r"^(\S+ \S+) INFO onceflow.metrics: epoch \d+ done: (\d+) records in (\d+) ms"
)
Q1_ROUNDS = 3
LATENCY_SECONDS, LATENCY_WARMUP = 40, 10
LATENCY_POOL, LATENCY_TICK = 50_000, 0.005  # bids made ahead, seconds between bursts
# The trigger interval a latency-minded user sets (README, "Latency and the trigger
# interval"): an epoch starts as soon as the last one ends while records keep coming.
SHORT_TRIGGER = "250ms"
ONCEFLOW_SHORT_TRIGGER = f"onceflow exactly-once, {SHORT_TRIGGER} trigger"
DATETIME_FIELD = re.compile(rb'"dateTime":\s*(\d+)')


class Measured:
    """A command run to completion (or until stopped) with its process tree's peak RSS."""

    def __init__(self, command: list[str], log: Path, cpus: str | None = None) -> None:
        if cpus:
            command = ["taskset", "-c", cpus, *command]
        self.log = log
        self.started = time.monotonic()
        self.drain_s = 0.0  # process start to exit: what a user draining a backlog waits
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )
        self.peak_rss_mb = 0.0
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self) -> None:
        while self.process.poll() is None:
            self.peak_rss_mb = max(self.peak_rss_mb, _tree_rss_mb(self.process.pid))
            time.sleep(0.2)
        self.drain_s = time.monotonic() - self.started

    def wait(self, timeout: float = 1800) -> str:
        code = self.process.wait(timeout)
        self.sampler.join()
        output = self.log.read_text(errors="replace")
        if code != 0:
            raise RuntimeError(f"{self.process.args} exited {code}; see {self.log}")
        return output

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.sampler.join()


def _tree_rss_mb(pid: int) -> float:
    total = 0
    for p in [pid, *children(pid)]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        except (OSError, AttributeError):
            continue
    return total / 1024


class Bench:
    def __init__(self, bootstrap: str, records: int, work: Path) -> None:
        self.bootstrap, self.records, self.work = bootstrap, records, work
        self.source = self.topic("bids")
        self.rows: list[dict] = []

    def topic(self, name: str) -> str:
        topic = f"bench-{name}-{uuid.uuid4().hex[:6]}"
        create_topic(self.bootstrap, topic, PARTITIONS)
        return topic

    def record(self, system: str, query: str, *runs: tuple[dict, Measured]) -> dict:
        """One row per system and query; of several runs, the median one (by records/s)."""
        rates = sorted(
            ((result["records"] / result["seconds"], result) for result, _ in runs),
            key=lambda pair: pair[0],
        )
        rate, result = rates[len(rates) // 2]
        drains = sorted(run.drain_s for _, run in runs)
        row = {
            "system": system,
            "query": query,
            "records": result["records"],
            "seconds": round(result["seconds"], 2),
            "records_per_s": round(rate),
            "peak_rss_mb": round(max(run.peak_rss_mb for _, run in runs)),
            "drain_s": round(drains[len(drains) // 2], 1),
        }
        if len(runs) > 1:
            row["runs_records_per_s"] = [round(r) for r, _ in rates]
        print(
            f"  {system:28s} {query:4s} {row['records_per_s']:>9,} records/s  "
            f"peak RSS {row['peak_rss_mb']:,} MB",
            flush=True,
        )
        self.rows.append(row)
        return row

    # -- the systems ---------------------------------------------------------------------

    def onceflow(
        self, query: str, guarantee: str, cpus: str | None = None
    ) -> tuple[dict, Measured]:
        name = f"{query}-{guarantee}-{cpus or 'all'}-{uuid.uuid4().hex[:6]}"
        config = pipeline(
            query,
            self.bootstrap,
            self.source,
            self.topic(f"out-{query}"),
            str(self.work / f"ck-{name}"),
            guarantee,
            master="local[1]" if cpus and "," not in cpus else "local[2]",
        )
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        run = Measured(
            [sys.executable, "-m", "onceflow.cli", "run", str(path), "--available-now"],
            self.work / f"{name}.log",
            cpus,
        )
        return onceflow_processing(run.wait()), run

    def spark_jvm(self, query: str) -> tuple[dict, Measured]:
        run = Measured(
            [
                sys.executable,
                "-m",
                "bench.spark_kafka",
                *("--query", query, "--bootstrap", self.bootstrap, "--source", self.source),
                *("--sink", self.topic(f"spark-{query}"), "--checkpoint"),
                str(self.work / f"spark-ck-{query}"),
            ],
            self.work / f"spark-{query}.log",
        )
        return _last_json(run.wait()), run

    def quix(
        self, query: str, records: int | None = None, source: str = "", sink: str = ""
    ) -> Measured:
        return Measured(
            [
                str(QUIX_VENV / "bin" / "python"),
                "bench/quix_app.py",
                *("--query", query, "--bootstrap", self.bootstrap),
                *("--source", source or self.source),
                *("--sink", sink or self.topic(f"quix-{query}")),
                *("--records", str(records or self.records)),
                *("--state-dir", str(self.work / f"quix-{query}-{uuid.uuid4().hex[:6]}")),
            ],
            self.work / f"quix-{query}.log",
        )

    def copier(self, source: str, sink: str, records: int) -> Measured:
        return Measured(
            [
                sys.executable,
                "-m",
                "bench.copier",
                *("--bootstrap", self.bootstrap, "--source", source, "--sink", sink),
                *("--records", str(records)),
            ],
            self.work / f"copier-{sink}.log",
        )


def onceflow_processing(output: str) -> dict:
    """Records and seconds from the second epoch's start to the last epoch's end (log lines):
    the first epoch starts Spark's Python workers and warms the JVM up."""
    epochs = []
    for line in output.splitlines():
        match = EPOCH_LINE.match(line)
        if match and int(match.group(2)):
            end = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            epochs.append((end - int(match.group(3)) / 1000, end, int(match.group(2))))
    if not epochs:
        raise RuntimeError("no epoch with records in the service's log")
    epochs = epochs[1:] or epochs
    return {"records": sum(e[2] for e in epochs), "seconds": epochs[-1][1] - epochs[0][0]}


def _last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


# -- latency ------------------------------------------------------------------------------


def latency(bench: Bench, system: str, rate: float) -> dict:
    """Q1 end-to-end latency at `rate` bids/s: produced (wall-clock dateTime) -> visible to a
    read_committed consumer of the output. Until the first output appears bids come at a tenth
    of the rate; measuring starts LATENCY_WARMUP seconds after that and lasts LATENCY_SECONDS."""
    source, sink = bench.topic("lat-in"), bench.topic("lat-out")
    if system.startswith("onceflow exactly-once"):
        config = pipeline("q1", bench.bootstrap, source, sink, str(bench.work / f"lat-{sink}"))
        if system == ONCEFLOW_SHORT_TRIGGER:
            config["checkpoint"]["interval"] = SHORT_TRIGGER
        path = bench.work / f"lat-{sink}.yaml"
        path.write_text(yaml.safe_dump(config))
        cmd = [sys.executable, "-m", "onceflow.cli", "run", str(path)]
        run = Measured(cmd, bench.work / f"lat-{sink}.log")
    elif system == "copier (ceiling)":
        run = bench.copier(source, sink, 10**12)
    else:
        run = bench.quix("q1", 10**12, source, sink)
    probe = _LatencyProbe(bench.bootstrap, sink)
    probe.start()
    # Bids are made before the clock starts and stamped with the wall clock as they go out,
    # in ticks: the harness shares the cores with the system under test and must stay light.
    pool = [_stampable(key, value) for key, value in bids(LATENCY_POOL, seed=7)]
    producer = Producer({"bootstrap.servers": bench.bootstrap, "linger.ms": 1})
    start = last = time.monotonic()
    warm_since, stop_at, measured_from, sent, credit = None, None, 0, 0, 0.0
    while stop_at is None or last < stop_at:
        now = time.monotonic()
        if warm_since is None and probe.first_output.is_set():
            warm_since = now
        if stop_at is None and warm_since is not None and now - warm_since >= LATENCY_WARMUP:
            probe.measure_from_ms = time.time() * 1000
            stop_at, measured_from = now + LATENCY_SECONDS, sent
        if now - start > 600 and warm_since is None:
            raise RuntimeError(f"{system} produced no output in 10 minutes; see {run.log}")
        # A tenth of the rate until the first output: start-up must not leave a backlog
        # that the measurement would then include. At most a second's worth is caught up.
        paced = rate if warm_since is not None else rate / 10
        credit = min(credit + (now - last) * paced, paced)
        last = now
        stamp = b'"dateTime":%d' % (time.time() * 1000)
        while credit >= 1:
            key, head, tail = pool[sent % LATENCY_POOL]
            producer.produce(source, head + stamp + tail, key, sent % PARTITIONS)
            sent, credit = sent + 1, credit - 1
        producer.poll(0)
        time.sleep(LATENCY_TICK)
    producer.flush(60)
    achieved = (sent - measured_from) / LATENCY_SECONDS
    time.sleep(5)  # the last records' way through
    probe.stop.set()
    probe.join()
    run.stop()
    samples = sorted(probe.samples)
    if len(samples) < 100:
        raise RuntimeError(f"{system}: only {len(samples)} latency samples; see {run.log}")
    return {
        "system": system,
        "rate": round(rate),
        "achieved_rate": round(achieved),
        "p50_ms": round(statistics.median(samples)),
        "p99_ms": round(samples[int(len(samples) * 0.99)]),
        "samples": len(samples),
        "peak_rss_mb": round(run.peak_rss_mb),
    }


def _stampable(key: bytes, value: bytes) -> tuple[bytes, bytes, bytes]:
    """A bid as (key, JSON before dateTime, JSON after it), to be stamped when it is sent."""
    head, _, tail = DATETIME_FIELD.split(value, 1)
    return key, head, tail


class _LatencyProbe(threading.Thread):
    """Reads the output with read_committed; one sample per record produced after
    `measure_from_ms`: the time it became visible minus the time it was produced."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        self.samples: list[float] = []
        self.first_output = threading.Event()
        self.stop = threading.Event()
        self.measure_from_ms = float("inf")

    def run(self) -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"latency-{uuid.uuid4().hex[:6]}",
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
            }
        )
        consumer.subscribe([self.topic])
        while not self.stop.is_set():
            for message in consumer.consume(1000, 0.2):
                if message.error():
                    continue
                now = time.time() * 1000
                self.first_output.set()
                produced = int(DATETIME_FIELD.search(message.value()).group(1))
                if produced >= self.measure_from_ms:
                    self.samples.append(now - produced)
        consumer.close()


# -- the run --------------------------------------------------------------------------------


def ensure_quix() -> None:
    if not (QUIX_VENV / "bin" / "python").exists():
        print(f"creating {QUIX_VENV} with quixstreams=={QUIX_VERSION} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(QUIX_VENV)], check=True)
        subprocess.run(
            [str(QUIX_VENV / "bin" / "pip"), "install", "-q", f"quixstreams=={QUIX_VERSION}"],
            check=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="onceflow's Nexmark benchmark")
    parser.add_argument("--records", type=int, default=1_000_000)
    args = parser.parse_args()
    ensure_quix()
    from bench.spark_kafka import connector_jars

    connector_jars()  # fetched once, before anything is timed
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or LocalKafka.from_env().start()
    work = Path("/tmp") / f"onceflow-nexmark-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    bench = Bench(bootstrap, args.records, work)
    RESULTS.mkdir(exist_ok=True)
    print(f"preloading {args.records:,} Nexmark bids into {bench.source} ...", flush=True)
    t0 = time.perf_counter()
    payload = preload(bootstrap, bench.source, args.records, PARTITIONS)
    print(
        f"  {args.records / (time.perf_counter() - t0):,.0f} bids/s, "
        f"{payload / args.records:.0f} bytes per bid (key + value)",
        flush=True,
    )

    print("plain read_committed consumer ...", flush=True)
    read_rate = plain_consumer(bootstrap, bench.source, args.records)
    print(f"  {read_rate:,.0f} records/s", flush=True)
    # Q1 against its ceiling is the closest call, so it is measured in alternating rounds
    # and the median counts; a single run of either moved the ratio by 10% (0.44 to 0.55).
    print(f"q1, copier and onceflow exactly-once, {Q1_ROUNDS} rounds ...", flush=True)
    copiers, onceflows = [], []
    for _ in range(Q1_ROUNDS):
        copier = bench.copier(bench.source, bench.topic("copier-q1"), args.records)
        copiers.append((_last_json(copier.wait()), copier))
        onceflows.append(bench.onceflow("q1", "exactly_once"))
    bench.record("copier (ceiling)", "q1", *copiers)
    bench.record("onceflow exactly-once", "q1", *onceflows)
    for query in QUERIES:
        print(f"{query} ...", flush=True)
        for guarantee in ("at_least_once",) if query == "q1" else ("exactly_once", "at_least_once"):
            system = f"onceflow {guarantee.replace('_', '-')}"
            bench.record(system, query, bench.onceflow(query, guarantee))
        quix = bench.quix(query)
        bench.record("Quix Streams exactly-once", query, (_last_json(quix.wait()), quix))
        bench.record("Spark JVM Kafka at-least-once", query, bench.spark_jvm(query))
    print("onceflow on one core ...", flush=True)
    for query in ("q1", "q5"):
        bench.record(
            "onceflow exactly-once, 1 core", query, bench.onceflow(query, "exactly_once", "0")
        )

    saturation = _rate(bench.rows, "onceflow exactly-once", "q1")
    rate = saturation / 2
    print(f"Q1 latency at {rate:,.0f} bids/s (half of onceflow's saturation) ...", flush=True)
    latencies = []
    for system in (
        "onceflow exactly-once",
        ONCEFLOW_SHORT_TRIGGER,
        "copier (ceiling)",
        "Quix Streams exactly-once",
    ):
        latencies.append(latency(bench, system, rate))
        print(f"  {system:28s} p50 {latencies[-1]['p50_ms']} ms, p99 {latencies[-1]['p99_ms']} ms")

    for query in ("q1", "q5"):
        print(f"profiling onceflow {query} ...", flush=True)
        config = pipeline(
            query,
            bootstrap,
            bench.source,
            bench.topic(f"prof-{query}"),
            str(work / f"prof-{query}"),
        )
        path = work / f"prof-{query}.yaml"
        path.write_text(yaml.safe_dump(config))
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.profile",
                str(path),
                "--out",
                str(RESULTS / f"profile-{query}.md"),
            ],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )

    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {datetime.now().date()}",
        "records": args.records,
        "bytes_per_record": round(payload / args.records),
        "plain_consumer_records_per_s": round(read_rate),
        "throughput": bench.rows,
        "latency_q1": latencies,
    }
    (RESULTS / "nexmark.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = report(results)
    (RESULTS / "nexmark.md").write_text(markdown)
    plot(results, RESULTS / "nexmark.png")
    print(markdown)


def _rate(rows: list[dict], system: str, query: str) -> float:
    return next(r["records_per_s"] for r in rows if r["system"] == system and r["query"] == query)


def report(results: dict) -> str:
    rows = results["throughput"]
    lines = [
        f"# Nexmark benchmark ({results['machine']})",
        "",
        f"{results['records']:,} bids of {results['bytes_per_record']} bytes over "
        f"{PARTITIONS} partitions, one local broker; each system drains the whole backlog. "
        f"A plain read_committed consumer reads {results['plain_consumer_records_per_s']:,} "
        "records/s.",
        "",
        "## Throughput at saturation (records/s) and peak RSS of the whole process tree",
        "",
        "| system | " + " | ".join(QUERIES) + " | peak RSS (MB) |",
        "|---|" + "---|" * (len(QUERIES) + 1),
    ]
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = {r["query"]: r for r in rows if r["system"] == system}
        cells = [f"{mine[q]['records_per_s']:,}" if q in mine else "-" for q in QUERIES]
        lines.append(
            f"| {system} | "
            + " | ".join(cells)
            + f" | {max(r['peak_rss_mb'] for r in mine.values()):,} |"
        )
    for r in rows:
        if "runs_records_per_s" in r:
            runs = ", ".join(f"{rate:,}" for rate in r["runs_records_per_s"])
            lines.append(f"\n{r['system']}, {r['query']}: median of {runs} records/s.")
    lines += [
        "",
        "## Draining the backlog: process start to exit (s)",
        "",
        "What a user draining the backlog waits for, start-up and onceflow's and Spark's first "
        "epoch included (the rates above leave the first epoch out).",
        "",
        "| system | " + " | ".join(QUERIES) + " |",
        "|---|" + "---|" * len(QUERIES),
    ]
    for system in dict.fromkeys(r["system"] for r in rows if "drain_s" in r):
        mine = {r["query"]: r for r in rows if r["system"] == system}
        cells = [f"{mine[q]['drain_s']:,.1f}" if q in mine else "-" for q in QUERIES]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    eo = {r["query"]: r["records_per_s"] for r in rows if r["system"] == "onceflow exactly-once"}
    ratios = [
        ("onceflow exactly-once / at-least-once", "onceflow at-least-once"),
        ("onceflow exactly-once / Quix Streams exactly-once", "Quix Streams exactly-once"),
        ("onceflow exactly-once / Spark JVM Kafka", "Spark JVM Kafka at-least-once"),
        ("onceflow exactly-once / copier ceiling", "copier (ceiling)"),
        ("2 cores / 1 core (onceflow exactly-once)", "onceflow exactly-once, 1 core"),
    ]
    lines += [
        "",
        "## Ratios",
        "",
        "| ratio | " + " | ".join(QUERIES) + " |",
        "|---|" + "---|" * len(QUERIES),
    ]
    for label, other in ratios:
        theirs = {r["query"]: r["records_per_s"] for r in rows if r["system"] == other}
        cells = [f"{eo[q] / theirs[q]:.2f}" if q in theirs else "-" for q in QUERIES]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Q1 end-to-end latency at {results['latency_q1'][0]['rate']:,} bids/s",
        "",
        "Produced (wall-clock `dateTime`) to visible for a read_committed consumer, over "
        f"{LATENCY_SECONDS} s that start {LATENCY_WARMUP} s after the first output (bids come "
        "at a tenth of the rate until then).",
        "",
        "| system | bids/s achieved | p50 (ms) | p99 (ms) | samples | peak RSS (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["latency_q1"]:
        lines.append(
            f"| {r['system']} | {r['achieved_rate']:,} | {r['p50_ms']:,} | {r['p99_ms']:,} | "
            f"{r['samples']:,} | "
            f"{r['peak_rss_mb']:,} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["throughput"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), width_ratios=(3, 1))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        mine = {r["query"]: r["records_per_s"] for r in rows if r["system"] == system}
        xs = [q + i * width for q, name in enumerate(QUERIES) if name in mine]
        left.bar(xs, [mine[n] for n in QUERIES if n in mine], width, label=system)
    left.set_xticks(
        [q + 0.4 - width / 2 for q in range(len(QUERIES))], [q.upper() for q in QUERIES]
    )
    left.set_ylabel("records/s (backlog drained)")
    left.set_title("Throughput at saturation", loc="left")
    left.legend(fontsize=7)
    left.grid(axis="y", alpha=0.3)
    latencies = results["latency_q1"]
    names = [r["system"].replace(" exactly-once", "\nexactly-once") for r in latencies]
    right.bar(names, [r["p99_ms"] for r in latencies], color="#f5b041", label="p99")
    right.bar(names, [r["p50_ms"] for r in latencies], color="#2e86c1", label="p50")
    right.set_title(f"Q1 latency at {latencies[0]['rate']:,} bids/s (ms)", loc="left")
    right.tick_params(axis="x", labelsize=7)
    right.legend(fontsize=7)
    figure.suptitle(results["machine"], fontsize=9)
    figure.tight_layout()
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
