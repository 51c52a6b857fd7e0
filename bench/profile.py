"""Where an onceflow run's CPU goes: the JVM against the Python processes, the JVM's hottest
methods (Java Flight Recorder), and the hottest Python functions by role (py-spy, sampling
the service and every Python worker Spark starts).

    python -m bench.profile PIPELINE.yaml [--out bench/results/profile.md]

Runs `onceflow run PIPELINE --available-now` with a flight recording and under
`py-spy record --subprocesses`, reads every process's CPU seconds from /proc while it runs,
and writes a Markdown summary.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROLES = [  # (role, a file on the stack that marks it), first match wins
    ("sink phase 2: the epoch's Kafka transaction", "publisher.py"),
    ("sink phase 1: Arrow -> commit message", "connectors/sink.py"),
    ("router: late/dead-letter split (mapInArrow)", "routing.py"),
    ("table lookup: transformWithState", "table_lookup.py"),
    ("source: Kafka -> Arrow", "connectors/source.py"),
    ("Spark's Python workers: serialization, IPC", "pyspark/"),
]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 10 ms


def children(pid: int) -> list[int]:
    try:
        kids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [d for k in kids for d in [k, *children(k)]]


def watch_cpu(root: int, totals: dict, stop: threading.Event) -> None:
    """Last seen CPU seconds per process, by kind (jvm or python), until `stop`."""
    while not stop.is_set():
        for pid in [root, *children(root)]:
            try:
                kind = "jvm" if "java" in Path(f"/proc/{pid}/cmdline").read_text() else "python"
                totals[(kind, pid)] = cpu_seconds(pid)
            except OSError:
                continue
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pipeline")
    parser.add_argument("--out", default="bench/results/profile.md")
    args = parser.parse_args()
    stacks = Path(args.out).with_suffix(".collapsed")
    recording = Path(args.out).with_suffix(".jfr")
    config = yaml.safe_load(Path(args.pipeline).read_text())
    config.setdefault("spark", {}).setdefault("conf", {})["spark.driver.extraJavaOptions"] = (
        f"-XX:StartFlightRecording=filename={recording},settings=profile"
    )
    profiled = Path(args.out).with_suffix(".yaml")
    profiled.write_text(yaml.safe_dump(config))
    service = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "run", str(profiled), "--available-now"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    spy = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "py-spy"),
            *("record", "--subprocesses", "--nonblocking", "--rate", "50"),
            *("--format", "raw", "--output", str(stacks), "--pid", str(service.pid)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    totals: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_cpu, args=(service.pid, totals, stop))
    watcher.start()
    service.wait()
    stop.set()
    watcher.join()
    spy.wait(60)
    text = summary(stacks, totals, args.pipeline) + jvm_summary(recording)
    Path(args.out).write_text(text)
    for scratch in (stacks, recording, profiled):
        scratch.unlink(missing_ok=True)
    print(text)


def summary(stacks: Path, totals: dict, pipeline: str) -> str:
    jvm = sum(s for (kind, _), s in totals.items() if kind == "jvm")
    python = sum(s for (kind, _), s in totals.items() if kind == "python")
    roles: collections.Counter = collections.Counter()
    functions: collections.Counter = collections.Counter()
    total = 0
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        total += int(count)
        role = next((r for r, mark in ROLES if any(mark in f for f in frames)), "other")
        roles[role] += int(count)
        functions[re.sub(r" \(.*?/(site-packages/)?", " (", frames[-1])] += int(count)
    lines = [
        f"# Profile of `onceflow run {Path(pipeline).name} --available-now`",
        "",
        f"CPU seconds from /proc: JVM {jvm:.1f} s, Python (driver + workers) {python:.1f} s.",
        "",
        "py-spy samples of busy Python threads (py-spy leaves idle ones out), by role:",
        "",
        "| role | share of busy Python samples |",
        "|---|---|",
    ]
    lines += [f"| {r} | {n / total:.0%} |" for r, n in roles.most_common()]
    lines += ["", "Hottest Python functions (own time):", "", "| function | share |", "|---|---|"]
    lines += [f"| `{f}` | {n / total:.1%} |" for f, n in functions.most_common(12)]
    return "\n".join(lines) + "\n"


JVM_ACTIVITIES = [  # (activity, a frame on the stack that marks it), first match wins
    ("JSON parsing (from_json)", "JacksonParser"),
    ("Arrow: JVM rows -> Python", "ArrowWriter"),
    ("Arrow: JVM rows -> Python", "ArrowFieldWriter"),
    ("Arrow: Python -> JVM rows", "ArrowColumnVector"),
    ("Arrow: Python -> JVM rows", "ArrowStreamReader"),
    ("state store (RocksDB)", "StateStore"),
    ("class loading, code generation", "ClassLoader"),
    ("class loading, code generation", "janino"),
    ("generated query code (projections, aggregation)", "GeneratedClass"),
    ("Python runner I/O", "PythonRunner"),
]


def jvm_summary(recording: Path, top: int = 10) -> str:
    """The JVM's samples by activity (any frame on the stack) and its hottest methods (top
    frame) from the flight recorder's execution samples."""
    printed = subprocess.run(
        ["jfr", "print", "--events", "jdk.ExecutionSample", "--stack-depth", "64", str(recording)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    stacks = [
        re.findall(r"^\s+([\w.$<>]+)\(", event, re.MULTILINE)
        for event in printed.split("jdk.ExecutionSample")[1:]
    ]
    stacks = [s for s in stacks if s]
    activities = collections.Counter(
        next((a for a, mark in JVM_ACTIVITIES for f in s if mark in f), "other") for s in stacks
    )
    methods = collections.Counter(s[0] for s in stacks)
    lines = [
        "",
        f"JVM flight-recorder samples ({len(stacks)}, all threads) by activity on the stack:",
        "",
        "| activity | share |",
        "|---|---|",
    ]
    lines += [f"| {a} | {n / len(stacks):.0%} |" for a, n in activities.most_common()]
    lines += ["", "Hottest JVM methods (top frame):", "", "| method | share |", "|---|---|"]
    lines += [f"| `{m}` | {n / len(stacks):.1%} |" for m, n in methods.most_common(top)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
