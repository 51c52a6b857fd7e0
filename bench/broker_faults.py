"""A hung broker against a dead one: how long a pipeline goes without a committed epoch.

    .venv/bin/python -m bench.broker_faults [--rounds 3] [--kafka KEY=VALUE ...] [--label L]

On a local three-node cluster (three replicas, min ISR 2) a windowed pipeline runs while
clicks arrive at a steady rate (the cluster fault test's feeder, pipeline and commit watch).
Round after round, at a random moment of its epoch cycle, the node that is the transaction
coordinator of its sink is either SIGKILLed (and started again afterwards) or SIGSTOPped (a
hung broker: alive to TCP, answering nothing; SIGCONT afterwards); dead and hung rounds
alternate. A round's figure is the longest time without a committed epoch from the fault
until the second epoch committed after it. Kafka fences a silent broker after
`broker.session.timeout.ms` (9 s): the floor under both. A read_committed reader watches the
output all along and counts windows published twice and records seen, then gone (the
windows' contents are checked by the cluster fault test, not here).

`--kafka` settings go into the pipeline's kafka section (librdkafka's, for every client), to
measure one against the defaults. Each run is recorded under its label in
bench/results/broker-faults.json, and all of them in broker-faults.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

from onceflow.connectors.topics import create_topic
from onceflow.local_cluster import LocalCluster
from onceflow.local_kafka import LocalKafka
from tests.fault.live_checker import LiveChecker
from tests.fault.test_cluster import CommitWatch, Feeder, _window
from tests.fault.test_faults import Scenario, _committed
from tests.helpers import free_ports, wait_until

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
NODES = 3
KINDS = ("dead", "hung")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind")
    parser.add_argument("--kafka", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--label", default="onceflow's defaults")
    args = parser.parse_args()
    kafka = dict(setting.split("=", 1) for setting in args.kafka)

    work = Path(tempfile.mkdtemp(prefix="onceflow-broker-faults-"))
    print(f"logs and checkpoint in {work} (kept if a round fails)", flush=True)
    cluster = LocalCluster(LocalKafka.from_env().home, free_ports(NODES + 10), NODES)
    try:
        cluster.start(progress=print)
        measured = _rounds(cluster, work, args.rounds, kafka)
    finally:
        cluster.stop(progress=print)
        shutil.rmtree(cluster.directory, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    _record(args.label, kafka, measured)


def _rounds(cluster: LocalCluster, work: Path, rounds: int, kafka: dict) -> dict:
    topics = {n: f"{n}-{uuid.uuid4().hex[:10]}" for n in ("in", "out", "dlq", "late")}
    for topic in topics.values():
        create_topic(cluster.bootstrap, topic, 3)
    feeder = Feeder(cluster.bootstrap, topics["in"])
    app = Scenario(cluster.bootstrap, topics, [], work, long=False)
    pipeline = app.pipeline(  # as the cluster fault test runs it
        windowed=True,
        source={"max_records_per_batch": 2_000},
        event_time={"watermark_delay": "30s"},
        kafka=kafka,
    )
    sink = f"onceflow-fault-{topics['in']}-{topics['out']}"  # its transactional id
    checker = LiveChecker(cluster.bootstrap, topics["out"], partitions=3, identity=_window)
    service = app.service(pipeline)
    commits = work / "checkpoint" / "commits"
    results = []
    try:
        _commits_after(service, commits, 8)  # past the small first epochs and the backlog
        watch = CommitWatch(commits)
        for number, kind in enumerate(KINDS * rounds, 1):
            time.sleep(random.uniform(0, 1))  # anywhere in an epoch's cycle
            node = cluster.transaction_coordinator(sink)
            before, fault = _committed(commits), time.monotonic()
            if kind == "dead":
                cluster.node(node).kill()
            else:
                cluster.node(node).pause()
            try:
                _commits_after(service, commits, before + 2)
            finally:
                if kind == "dead":
                    cluster.start_node(node, progress=lambda _: None)
                else:
                    cluster.node(node).pause(False)
            stall = watch.longest_gap(fault)
            print(f"  round {number}: node {node} {kind}, {stall:.1f} s without a commit")
            results.append({"kind": kind, "node": node, "seconds": round(stall, 1)})
            cluster.wait_in_sync(progress=lambda _: None)
            _commits_after(service, commits, _committed(commits) + 3)  # settled again
        watch.stop()
    finally:
        feeder._stop.set()
        if service.process.poll() is None:
            service.terminate()
    figures = checker.finish()
    checked = {
        "windows_seen": figures["seen_live"],
        "published_twice": len(figures["duplicates"]),
        "seen_then_gone": len(figures["vanished"]),
    }
    print(f"  read_committed during the faults: {checked}")
    return {"rounds": results, "output": checked}


def _commits_after(service, commits: Path, count: int) -> None:
    wait_until(
        lambda: _committed(commits) >= count or service.process.poll() is not None,
        300,
        f"{count} epochs committed",
    )
    if service.process.poll() is not None:
        raise SystemExit(f"the service stopped; its log: {service.log}\n{service.tail()}")


def _record(label: str, kafka: dict, measured: dict) -> None:
    path = RESULTS / "broker-faults.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[label] = {
        "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}",
        "kafka": kafka,
        **measured,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(runs, indent=2) + "\n")
    _render(runs)


def _render(runs: dict) -> None:
    lines = [
        "# A hung broker against a dead one",
        "",
        "`python -m bench.broker_faults`: seconds without a committed epoch after the sink's "
        "transaction coordinator was SIGKILLed (dead) or SIGSTOPped (hung), windowed pipeline, "
        "three-node cluster. Kafka fences a silent broker after 9 s.",
        "",
        "| run | date | dead (median; rounds) | hung (median; rounds) | output |",
        "|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        cells = []
        for kind in KINDS:
            seconds = [r["seconds"] for r in run["rounds"] if r["kind"] == kind]
            median = f"{statistics.median(seconds):.1f}" if seconds else "-"
            cells.append(f"{median}; {', '.join(f'{s:.1f}' for s in seconds)}")
        output = run.get("output")
        checked = (
            f"{output['published_twice']} twice, {output['seen_then_gone']} seen then gone"
            if output
            else "not checked"
        )
        lines.append(f"| {name} | {run['date']} | {cells[0]} | {cells[1]} | {checked} |")
    (RESULTS / "broker-faults.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
