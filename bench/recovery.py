"""Recovery: restart to first output, progress under a crash loop, the empty epoch's cost.

    .venv/bin/python -m bench.recovery        # make bench-recovery

1. Restart to output. A windowed pipeline (tumbling 10 s windows per user, RocksDB state)
   first runs over a small input, so that its checkpoint and state exist. Then, each round,
   a backlog of 100,000 clicks whose event times continue the previous round's is produced,
   and the pipeline is started again (`onceflow run --available-now`, as after a crash):
   timed from the process start to the first new output record readable with
   `read_committed`, with the times of the start-up steps from its log (metrics server up,
   query started, first epoch done). Median, min and max of the warm rounds; "cold" is one
   round after dropping the OS page cache (root only; skipped, and said so, otherwise).
2. Crash loop. The pipeline runs while a producer writes clicks at a steady rate, and is
   SIGKILLed a fixed time after each start, round after round. The epochs committed per
   round are counted from the checkpoint's commit log; then the rest is drained and
   `onceflow verify` checks that the output is exactly once.
3. Small epochs. The windowed pipeline, and a pass-through one, run on a trickle of input
   (a few records per epoch); the median duration of their epochs and of their plan,
   process and commit phases (and of Spark's own), from their progress lines: the fixed
   cost of an epoch (Spark runs no epoch without new input).
4. Spark's floor. A two-task job over ten rows in a warm session, in the JVM alone and
   through one Python stage (`bench.spark_floor`): what Spark itself costs per epoch here.

1b (`failover`) is described at its method.

Writes bench/results/recovery.json and recovery.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

import yaml
from confluent_kafka import Consumer, Producer, TopicPartition

from onceflow.connectors.topics import create_topic
from onceflow.local_kafka import LocalKafka

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PARTITIONS = 2
USERS = [f"user-{i}" for i in range(50)]
BASE_MS = 1_700_000_000_000
ROUND_SPAN_MS = 3_600_000  # event time covered by one round's backlog


class Clicks:
    """Click records whose event times only move forward, round after round; with
    `transactional`, each `produce` call's clicks are one transaction, as another
    exactly-once pipeline (onceflow's, Kafka Streams') writes its output."""

    def __init__(self, bootstrap: str, topic: str, transactional: bool = False) -> None:
        self.topic = topic
        conf = {"bootstrap.servers": bootstrap, "linger.ms": 20}
        if transactional:
            conf["transactional.id"] = f"bench-clicks-{topic}"
        self.producer = Producer(conf)
        self.transactional = transactional
        if transactional:
            self.producer.init_transactions(30)
        self.rng = random.Random(11)
        self.next_ms = BASE_MS

    def produce(self, count: int, span_ms: int = ROUND_SPAN_MS) -> None:
        step = max(1, span_ms // max(count, 1))
        if self.transactional:
            self.producer.begin_transaction()
        for _ in range(count):
            user = self.rng.choice(USERS)
            value = json.dumps(
                {"user": user, "bytes": self.rng.randint(200, 20_000), "ts": self.next_ms}
            )
            while True:
                try:
                    self.producer.produce(self.topic, key=user.encode(), value=value.encode())
                    break
                except BufferError:
                    self.producer.poll(0.05)
            self.next_ms += step
        if self.transactional:
            self.producer.commit_transaction(60)
        assert self.producer.flush(60) == 0, "the bench producer could not deliver its clicks"


class OutputWatch:
    """The first record appended to the output topic after `arm()`, read_committed."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-recovery-{uuid.uuid4()}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
            }
        )
        self.topic = topic

    def arm(self) -> None:
        """Start at the current end of every partition: only new output counts."""
        ends = []
        for p in range(PARTITIONS):
            _, high = self.consumer.get_watermark_offsets(TopicPartition(self.topic, p), 10)
            ends.append(TopicPartition(self.topic, p, high))
        self.consumer.assign(ends)

    def first(self, process: subprocess.Popen, timeout: float) -> float | None:
        """time.monotonic() when the first new output record arrived; None if the process
        ended or `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.consumer.poll(0.05)
            if message is not None and message.error() is None:
                return time.monotonic()
            if process.poll() is not None:  # its output may still be on the way
                deadline = min(deadline, time.monotonic() + 5)
        return None


class Bench:
    def __init__(self, bootstrap: str, work: Path, backlog: int) -> None:
        self.bootstrap, self.work, self.backlog = bootstrap, work, backlog

    def topic(self, name: str) -> str:
        topic = f"recovery-{name}-{uuid.uuid4().hex[:6]}"
        create_topic(self.bootstrap, topic, PARTITIONS)
        return topic

    def pipeline(self, name: str, source: str, output: str, windowed: bool = True, **extra) -> Path:
        config = {
            "app_id": f"recovery-{name}-{uuid.uuid4().hex[:6]}",
            "kafka": {"bootstrap_servers": self.bootstrap},
            "source": {
                "topics": [source],
                "starting_offsets": "earliest",
                "format": "json",
                "schema": "user STRING, bytes LONG, ts LONG",
                "max_records_per_batch": 50_000,
            },
            "event_time": {"field": "ts", "watermark_delay": "1s"},
            "window": {
                "type": "tumbling",
                "size": "10s",
                "key": "user",
                "aggregations": {"clicks": "count(*)", "bytes": "sum(bytes)"},
            },
            "sink": {"topic": output},
            "checkpoint": {"location": str(self.work / f"ck-{name}")},
            "spark": {"master": "local[2]"},
            "metrics": {"port": 0},
            **extra,
        }
        if not windowed:
            del config["event_time"], config["window"]
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self, path: Path, log: Path, *args: str) -> subprocess.Popen:
        env = {**os.environ, "ONCEFLOW_LOG_FORMAT": "json"}
        with open(log, "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "onceflow.cli", "run", *args, str(path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )

    def after_a_first_run(self, name: str, topic: str) -> tuple[Path, Clicks, OutputWatch]:
        """A windowed pipeline whose checkpoint and state exist (a first run over 5,000
        clicks), its click producer and a watch on its output."""
        source, output = self.topic(topic), self.topic(topic.replace("in", "out"))
        path = self.pipeline(name, source, output)
        clicks, watch = Clicks(self.bootstrap, source), OutputWatch(self.bootstrap, output)
        clicks.produce(5_000)
        print("  first run: creating the checkpoint and state ...", flush=True)
        assert self.start(path, self.work / f"{name}-0.log", "--available-now").wait() == 0
        return path, clicks, watch

    # -- 1. restart to output ----------------------------------------------------------------

    def restart_to_output(self, rounds: int, cold: bool) -> dict:
        path, clicks, watch = self.after_a_first_run("restart", "in")

        def one(label: str) -> dict:
            clicks.produce(self.backlog)
            watch.arm()
            log = self.work / f"restart-{label}.log"
            log.unlink(missing_ok=True)
            wall, t0 = time.time(), time.monotonic()
            process = self.start(path, log, "--available-now")
            first = watch.first(process, timeout=600)
            code = process.wait()
            assert code == 0 and first is not None, f"round {label} failed, see {log}"
            steps = _startup_steps(log, wall)
            result = {"seconds": round(first - t0, 2), **steps}
            print(f"  {label}: first output after {result['seconds']:.1f}s {steps}", flush=True)
            return result

        warm = [one(f"warm-{i + 1}") for i in range(rounds)]
        seconds = [r["seconds"] for r in warm]
        result = {
            "backlog_records": self.backlog,
            "warm_rounds": warm,
            "warm_median_s": statistics.median(seconds),
            "warm_min_s": min(seconds),
            "warm_max_s": max(seconds),
        }
        if cold and _drop_page_cache():
            result["cold"] = one("cold")
        else:
            result["cold"] = "not measured: dropping the page cache needs root"
        return result

    # -- 1b. failover to a standby -----------------------------------------------------------

    def failover(self, rounds: int) -> dict:
        """Kill the active instance with a backlog waiting and a standby (`run --standby`)
        beside it: seconds from the kill to the standby's first output."""
        path, clicks, watch = self.after_a_first_run("failover", "fo-in")
        seconds = []
        for i in range(rounds):
            active_log, standby_log = (self.work / f"failover-{i}-{n}.log" for n in "as")
            active = self.start(path, active_log)
            _wait_for_line(active_log, "started (checkpoint", active)
            standby = self.start(path, standby_log, "--standby")
            _wait_for_line(standby_log, "standby: waiting", standby)
            os.killpg(active.pid, signal.SIGSTOP)  # idle; the backlog must wait for the standby
            clicks.produce(self.backlog)
            watch.arm()
            t0 = time.monotonic()
            os.killpg(active.pid, signal.SIGKILL)
            active.wait()
            first = watch.first(standby, timeout=600)
            assert first is not None, f"round {i + 1}: no standby output, see {standby_log}"
            seconds.append(round(first - t0, 2))
            print(f"  round {i + 1}: standby's first output {seconds[-1]:.1f}s after the kill")
            standby.send_signal(signal.SIGTERM)
            assert standby.wait(300) == 0, f"the standby did not stop cleanly, see {standby_log}"
        return {
            "backlog_records": self.backlog,
            "seconds": seconds,
            "median_s": statistics.median(seconds),
            "min_s": min(seconds),
            "max_s": max(seconds),
        }

    # -- 2. crash loop -----------------------------------------------------------------------

    def crash_loop(self, rounds: int, kill_after_s: float, rate: int) -> dict:
        source, output = self.topic("crash-in"), self.topic("crash-out")
        path = self.pipeline("crash", source, output)
        commits = self.work / "ck-crash" / "commits"
        clicks = Clicks(self.bootstrap, source)
        clicks.produce(rate * 5, span_ms=5_000)
        stop = threading.Event()

        def feed() -> None:
            while not stop.is_set():
                clicks.produce(rate // 10, span_ms=100)
                time.sleep(0.1)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        per_round = []
        try:
            for i in range(rounds):
                before = _committed(commits)
                process = self.start(path, self.work / "crash.log")
                time.sleep(kill_after_s)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                per_round.append(_committed(commits) - before)
                print(f"  round {i + 1}: {per_round[-1]} epoch(s) committed", flush=True)
        finally:
            stop.set()
            feeder.join()
        drained = self.start(path, self.work / "crash.log", "--available-now").wait()
        verify = subprocess.run(
            [sys.executable, "-m", "onceflow.cli", "verify", "--json", str(path)],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        report = json.loads(verify.stdout) if verify.stdout.strip() else {}
        return {
            "rounds": rounds,
            "kill_after_s": kill_after_s,
            "input_rate_per_s": rate,
            "epochs_per_round": per_round,
            "rounds_without_progress": sum(1 for n in per_round if n == 0),
            "drain_exit_code": drained,
            "verify_exit_code": verify.returncode,
            "verify": {k: report.get(k) for k in ("ok", "duplicates", "missing") if k in report},
        }

    # -- 3. small epochs ---------------------------------------------------------------------

    def small_epochs(self, seconds: float, rate: int = 5) -> dict:
        """An epoch's fixed cost, windowed and pass-through: Spark runs no epoch without new
        input, so the input is a trickle (`rate` clicks a second, a few per epoch at the
        default 1 s trigger). Medians of onceflow's phases and of Spark's own (`phases_ms`).
        `pass_through_of_transactions`: the input is written as an exactly-once pipeline
        writes its output, a transaction per click (`rate` transactions a second)."""
        kinds = ("windowed", "pass_through", "pass_through_of_transactions")
        return {kind: self._trickle(kind, seconds, rate) for kind in kinds}

    def _trickle(self, kind: str, seconds: float, rate: int) -> dict:
        source, output = self.topic(f"trickle-{kind}-in"), self.topic(f"trickle-{kind}-out")
        path = self.pipeline(f"trickle-{kind}", source, output, windowed=kind == "windowed")
        per_transaction = kind == "pass_through_of_transactions"
        clicks = Clicks(self.bootstrap, source, transactional=per_transaction)
        log = self.work / f"trickle-{kind}.log"
        process = self.start(path, log)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if per_transaction:
                for _ in range(rate):
                    clicks.produce(1, span_ms=1_000 // rate)
                    time.sleep(1 / rate)
            else:
                clicks.produce(rate, span_ms=1_000)
                time.sleep(1)
        process.send_signal(signal.SIGTERM)
        process.wait(120)
        epochs = [e for e in _epochs(log) if 0 < e["input_records"] <= 5 * rate][3:]  # warm
        if not epochs:
            return {"epochs": 0}
        spark_phases = sorted({p for e in epochs for p in e["phases_ms"]})
        return {
            "epochs": len(epochs),
            "input_records_per_s": rate,
            **{
                f"{key}_median_ms": statistics.median(e[key] for e in epochs)
                for key in ("duration_ms", "plan_ms", "process_ms", "commit_ms")
            },
            "spark_phases_median_ms": {
                p: statistics.median(e["phases_ms"].get(p, 0) for e in epochs) for p in spark_phases
            },
        }

    # -- 4. Spark's floor -------------------------------------------------------------------

    def spark_floor(self) -> dict:
        """Spark's own cost of a tiny job here, with and without one Python stage."""
        out = subprocess.run(
            [sys.executable, "-m", "bench.spark_floor"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out.strip().splitlines()[-1])


def _wait_for_line(log: Path, text: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {text!r} in {log}")
        time.sleep(0.2)


def _committed(commits: Path) -> int:
    """Epochs committed so far: the newest batch id in Spark's commit log, plus one."""
    ids = [int(p.name) for p in commits.glob("[0-9]*")] if commits.exists() else []
    return max(ids, default=-1) + 1


def _log_lines(log: Path) -> list[dict]:
    lines = []
    for raw in log.read_text(errors="replace").splitlines():
        if raw.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                lines.append(json.loads(raw))
    return lines


def _seconds_since(ts: str, wall: float) -> float:
    return round(datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() - wall, 2)


def _startup_steps(log: Path, wall: float) -> dict:
    """Seconds from the process start to each start-up step in its log."""
    steps: dict[str, float] = {}
    for line in _log_lines(log):
        message = line["message"]
        for step, prefix in (
            ("metrics_up_s", "metrics on http"),
            ("query_started_s", "query "),
            ("first_epoch_done_s", "epoch "),
        ):
            if step not in steps and message.startswith(prefix):
                if step == "first_epoch_done_s" and " done: " not in message:
                    continue
                steps[step] = _seconds_since(line["ts"], wall)
    return steps


def _epochs(log: Path) -> list[dict]:
    pattern = re.compile(
        r"epoch \d+ done: (\d+) records in (\d+) ms \(plan (\d+), process (\d+), commit (\d+)\)"
    )
    epochs = []
    for line in _log_lines(log):
        match = pattern.match(line["message"])
        if match:
            records, total, plan, process, commit = map(int, match.groups())
            epochs.append(
                {
                    "input_records": records,
                    "duration_ms": total,
                    "plan_ms": plan,
                    "process_ms": process,
                    "commit_ms": commit,
                    "phases_ms": line.get("phases_ms", {}),
                }
            )
    return epochs


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def report(results: dict) -> str:
    restart, crash, small = results["restart"], results["crash_loop"], results["small_epochs"]
    failover = results["failover"]
    cold = restart["cold"]
    cold_text = f"{cold['seconds']:.1f} s" if isinstance(cold, dict) else cold
    lines = [
        "# Recovery benchmark",
        "",
        f"{results['date']}, {results['machine']}. `python -m bench.recovery`.",
        "",
        f"- Restart to first committed output, {restart['backlog_records']:,}-record backlog, "
        f"windowed (RocksDB): median {restart['warm_median_s']:.1f} s "
        f"(min {restart['warm_min_s']:.1f}, max {restart['warm_max_s']:.1f}, "
        f"{len(restart['warm_rounds'])} warm rounds); cold {cold_text}.",
        "- Start-up steps per warm round (seconds from process start): "
        + "; ".join(
            ", ".join(f"{k.removesuffix('_s')} {v}" for k, v in r.items())
            for r in restart["warm_rounds"]
        ),
        f"- Failover: a standby's first output {failover['median_s']:.1f} s after the active "
        f"instance's SIGKILL, {failover['backlog_records']:,}-record backlog (median; min "
        f"{failover['min_s']:.1f}, max {failover['max_s']:.1f}, {len(failover['seconds'])} "
        "rounds).",
        f"- Crash loop (SIGKILL {crash['kill_after_s']:g} s after each start, "
        f"{crash['input_rate_per_s']:,} clicks/s arriving): epochs committed per round "
        f"{crash['epochs_per_round']}, {crash['rounds_without_progress']} of "
        f"{crash['rounds']} rounds without progress; `onceflow verify` exit "
        f"{crash['verify_exit_code']} {crash['verify']}.",
        *[
            f"- Epochs of a few records, {kind.replace('_', '-')}: {figures}."
            for kind, figures in small.items()
        ],
        f"- Spark's floor (a two-task job over ten rows, warm session): {results['spark_floor']}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5, help="warm restart rounds")
    parser.add_argument("--failover-rounds", type=int, default=3)
    parser.add_argument("--crash-rounds", type=int, default=10)
    parser.add_argument("--kill-after", type=float, default=10.0, help="seconds")
    parser.add_argument("--rate", type=int, default=2_000, help="clicks/s in the crash loop")
    parser.add_argument("--trickle-seconds", type=float, default=60.0)
    parser.add_argument("--no-cold", action="store_true", help="skip the cold round")
    parser.add_argument(
        "--only",
        help="comma-separated parts (restart, failover, crash_loop, small_epochs, spark_floor)",
    )
    args = parser.parse_args()

    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or LocalKafka.from_env().start()
    work = Path(tempfile.mkdtemp(prefix="onceflow-recovery-"))
    print(f"logs and checkpoints in {work} (kept if a step fails)", flush=True)
    bench = Bench(bootstrap, work, args.backlog)
    parts = {
        "restart": lambda: bench.restart_to_output(args.rounds, cold=not args.no_cold),
        "failover": lambda: bench.failover(args.failover_rounds),
        "crash_loop": lambda: bench.crash_loop(args.crash_rounds, args.kill_after, args.rate),
        "small_epochs": lambda: bench.small_epochs(args.trickle_seconds),
        "spark_floor": bench.spark_floor,
    }
    chosen = args.only.split(",") if args.only else list(parts)
    results = {
        "date": datetime.now().strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python "
        f"{platform.python_version()}",
    }
    for number, name in enumerate(chosen, 1):
        print(f"{number}. {name.replace('_', ' ')}", flush=True)
        results[name] = parts[name]()
    shutil.rmtree(work, ignore_errors=True)
    if len(chosen) < len(parts):  # a partial run prints, and keeps the recorded results
        print(json.dumps(results, indent=2))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "recovery.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results)
    (RESULTS / "recovery.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
