"""Exactly-once under faults: the service is killed, stopped, doubled and starved of its broker,
and the read_committed output is checked with `onceflow verify` each time.

The default run is sized for CI; `pytest tests/fault --long` runs the full matrix (more
records, every fault point for both pipelines, ten or more random kills).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from onceflow.connectors.faults import POINTS, STATE_STORE_POINT, STATELESS_POINTS
from onceflow.connectors.topics import read_committed
from onceflow.lease import LEASE_S
from onceflow.verify import verify
from tests.helpers import produce, wait_until

pytestmark = pytest.mark.fault
BASE = 1_700_000_000_000
FLUSH_TS = BASE + 10**9
USERS = 7


class Service:
    """`onceflow run PIPELINE` in its own process group, as an operator would run it."""

    kills = 0  # by the test or by a fault point, over all services of a test
    started: ClassVar[list[Service]] = []  # of the running test (see stop_leftovers)

    def __init__(
        self,
        pipeline: Path,
        log: Path,
        *flags: str,
        fault: str = "",
        container: Sequence[str] = (),
    ):
        Service.started.append(self)
        env = {**os.environ, "ONCEFLOW_FAULT": fault}
        env.pop("ONCEFLOW_SERVICE_PGID", None)
        args = [*container, sys.executable, "-m", "onceflow.cli", "run", str(pipeline), *flags]
        self.log = log
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait(self, timeout: float = 300) -> int:
        return self.process.wait(timeout)

    def kill(self) -> None:
        """kill -9 the whole service: driver, JVM and the Python workers' group."""
        Service.kills += 1
        self._kill()

    def _kill(self) -> None:
        for pid in [*_descendants(self.process.pid), self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        self.process.wait(30)

    @classmethod
    def stop_leftovers(cls) -> None:
        """Kill every service the test left running: one that failed while a service ran
        (a wait that timed out) would leave it in a session of its own, holding a core, a
        port and its checkpoint's lease for the tests after."""
        for service in cls.started:
            if service.process.poll() is None:
                service._kill()
        cls.started = []

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(300)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def report(self) -> str:
        """For a failed assertion: the log's last error lines, then its end (a CI printout
        may keep only the start of a long message)."""
        text = self.log.read_text(errors="replace")
        errors = [
            line[:1000]
            for line in text.splitlines()
            if line.startswith("onceflow: ") or " ERROR " in line or "Error: " in line
        ]
        return "\n".join(
            ["the service's last errors:", *errors[-5:], "its log ends:", text[-4000:]]
        )


def _descendants(pid: int) -> list[int]:
    """Every process `pid` started, and theirs, whichever of its threads started them (the
    JVM starts Spark's Python processes from threads other than its main one)."""
    kids = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            kids += [int(p) for p in children.read_text().split()]
    return [d for k in kids for d in [k, *_descendants(k)]]


@pytest.fixture
def app(kafka_bootstrap, new_topic, tmp_path, request):
    """Topics, input records and pipeline files for one scenario."""
    long = request.config.getoption("--long")
    Service.kills = 0
    records = 300_000 if long else 10_000
    topics = {n: new_topic(partitions=3, prefix=n) for n in ("in", "out", "dlq", "late")}
    events = [(f"u{i % USERS}", BASE + i * 7) for i in range(records)]
    produce(
        kafka_bootstrap,
        topics["in"],
        ((u.encode(), _click(u, ts), i % 3) for i, (u, ts) in enumerate(events)),
    )
    # Last, one far-ahead record moves the watermark past every window of `events`.
    produce(kafka_bootstrap, topics["in"], [(b"u0", _click("u0", FLUSH_TS), 0)])
    return Scenario(kafka_bootstrap, topics, events, tmp_path, long)


class Scenario:
    def __init__(self, bootstrap, topics, events, tmp_path, long):
        self.bootstrap, self.topics, self.events, self.tmp, self.long = (
            bootstrap,
            topics,
            events,
            tmp_path,
            long,
        )
        self.runs = 0
        self.files = 0

    def pipeline(self, windowed: bool, **changes) -> Path:
        config = {
            "app_id": f"fault-{self.topics['in']}",
            "kafka": {"bootstrap_servers": self.bootstrap},
            "source": {
                "topics": [self.topics["in"]],
                "starting_offsets": "earliest",
                "format": "json",
                "schema": "user STRING, bytes LONG, ts LONG",
                "max_records_per_batch": 2_000 if not self.long else 20_000,
            },
            "event_time": {"field": "ts", "watermark_delay": "2s"},
            "sink": {
                "topic": self.topics["out"],
                "dead_letter_topic": self.topics["dlq"],
                "late_topic": self.topics["late"],
            },
            "checkpoint": {"location": str(self.tmp / "checkpoint"), "interval": "200ms"},
            "spark": {"master": "local[2]"},
            "metrics": {"port": 0},
        }
        if windowed:
            config["window"] = {
                "type": "tumbling",
                "size": "10s",
                "key": "user",
                "aggregations": {"clicks": "count(*)"},
            }
        for section, values in changes.items():
            config[section] = {**config.get(section, {}), **values}
        self.files += 1
        path = self.tmp / f"pipeline-{self.files}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def service(
        self, pipeline: Path, available_now=False, fault="", standby=False, container=()
    ) -> Service:
        self.runs += 1
        flags = ["--available-now"] * available_now + ["--standby"] * standby
        log = self.tmp / f"run-{self.runs}.log"
        return Service(pipeline, log, *flags, fault=fault, container=container)

    def drain(self, pipeline: Path) -> None:
        service = self.service(pipeline, available_now=True)
        assert service.wait() == 0, service.report()
        # The restart's first epoch (a replay after a kill) reaches the metrics like any other.
        assert "could not record query progress" not in service.log.read_text(), service.report()

    def report(self, count_field: str | None = None):
        """The checker's figures, also printed for the run's record (`pytest -rP`).

        With `count_field`, the window results are checked as `onceflow verify` checks them:
        against the newest pipeline file (the one the last service ran) and its checkpoint.
        """
        from dataclasses import replace

        from onceflow.config import load
        from onceflow.verify import WindowSpec

        windows = None
        if count_field:
            config = load(self.tmp / f"pipeline-{self.files}.yaml")
            windows = replace(WindowSpec.from_config(config), count_field=count_field)
        report = verify(
            self.bootstrap,
            [self.topics["in"]],
            self.topics["out"],
            self.topics["dlq"],
            self.topics["late"],
            windows,
        )
        print(f"records produced: {len(self.events)} (+ the far-ahead record)")
        print(f"service runs: {self.runs} (restarts: {self.runs - 1}), kills: {Service.kills}")
        print(report.summary())
        if count_field:
            print("(a windowed run leaves 1 pending: the far-ahead record's open window)")
        return report

    def check_pass_through(self) -> None:
        report = self.report()
        assert report.ok, report.summary()
        assert report.counted == len(self.events) + 1  # + the far-ahead record

    def check_windows(self) -> None:
        """Every window of `events` is published once, with exactly its count."""
        report = self.report(count_field="clicks")
        assert report.ok, report.summary()
        assert report.pending == 1, report.summary()  # the far-ahead record's open window
        assert report.counted == len(self.events), report.summary()
        expected = Counter((u, BASE + (ts - BASE) // 10_000 * 10_000) for u, ts in self.events)
        got = {}
        for m in read_committed(self.bootstrap, self.topics["out"]):
            value = json.loads(m.value())
            got[(value["key"], value["window_start"])] = value["clicks"]
        assert got == dict(expected)


def _click(user: str, ts: int) -> bytes:
    return json.dumps({"user": user, "bytes": 100, "ts": ts}).encode()


def crash_then_drain(app: Scenario, pipeline: Path, point: str) -> None:
    """SIGKILL the service at `point` in batch 3, then drain from the same checkpoint."""
    crashed = app.service(pipeline, available_now=True, fault=f"{point}@3")
    assert crashed.wait() == -signal.SIGKILL, crashed.report()
    Service.kills += 1
    app.drain(pipeline)


def crash_at_then_recover(app: Scenario, point: str, windowed: bool) -> None:
    crash_then_drain(app, app.pipeline(windowed=windowed), point)
    if windowed:
        app.check_windows()
    else:
        app.check_pass_through()


def test_kill_at_every_fault_point_windowed(app, windowed_point):
    crash_at_then_recover(app, windowed_point, windowed=True)


def pytest_generate_tests(metafunc) -> None:
    """CI kills each pipeline at its most replay-sensitive points (a windowed one after its
    side records are staged, after the commit and inside the state store commit; the sink's
    own tests kill before the prepare step and before the commit); --long at all."""
    long = metafunc.config.getoption("--long")
    for name, every, ci in (
        ("windowed_point", POINTS, ["after_prepare", "after_kafka_commit", STATE_STORE_POINT]),
        ("pass_through_point", STATELESS_POINTS, ["after_kafka_commit"]),
        ("update_mode_point", UPDATE_MODE_POINTS, ["after_kafka_commit"]),
        ("at_least_once_point", STATELESS_POINTS, ["before_kafka_commit"]),
        ("random_kills_pipeline", ["pass-through", "windowed"], ["windowed"]),
    ):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, every if long else ci)


def test_kill_at_every_fault_point_pass_through(app, pass_through_point):
    crash_at_then_recover(app, pass_through_point, windowed=False)


# foreachBatch publishes update mode: no prepare step in executor tasks.
UPDATE_MODE_POINTS = ("before_kafka_commit", "after_kafka_commit", "during_state_store_commit")


def test_kill_at_every_fault_point_update_mode(app, update_mode_point):
    """Update mode (foreachBatch): every update is published once, the last one is final."""
    pipeline = app.pipeline(windowed=True, window={"output_mode": "update"})
    crash_then_drain(app, pipeline, update_mode_point)
    updates = Counter()
    final = {}
    for m in read_committed(app.bootstrap, app.topics["out"]):
        value = json.loads(m.value())
        window = (value["key"], value["window_start"])
        updates[(*window, value["clicks"])] += 1
        final[window] = value["clicks"]
    assert [u for u, n in updates.items() if n > 1] == []  # an epoch's updates published twice
    expected = Counter((u, BASE + (ts - BASE) // 10_000 * 10_000) for u, ts in app.events)
    far_ahead = ("u0", BASE + (FLUSH_TS - BASE) // 10_000 * 10_000)
    assert final == {**expected, far_ahead: 1}


def test_kill_at_every_fault_point_at_least_once(app, at_least_once_point):
    """At-least-once may publish an epoch again after a crash, and never loses a record."""
    pipeline = app.pipeline(windowed=False, sink={"guarantee": "at_least_once"})
    crash_then_drain(app, pipeline, at_least_once_point)
    report = app.report()
    assert not report.missing and report.unaccounted <= 0, report.summary()
    if at_least_once_point == "before_kafka_commit":  # records acknowledged, marker not
        assert report.duplicates, "the kill did not land between the records and the marker"


def test_random_sigkills_then_restart_from_the_same_checkpoint(app, random_kills_pipeline):
    """Each kill lands at a random moment after the run's first committed epoch, while a
    backlog remains (epochs are small enough for several per run), so it can hit any step
    of an epoch, or the gap between two."""
    windowed = random_kills_pipeline == "windowed"
    kills = 12 if app.long else 2
    per_batch = len(app.events) // (kills * 4)
    pipeline = app.pipeline(windowed=windowed, source={"max_records_per_batch": per_batch})
    kill_each_run_at_random(app, pipeline, kills, default_seed=20261121)
    app.drain(pipeline)
    if windowed:
        app.check_windows()
    else:
        app.check_pass_through()


def kill_each_run_at_random(
    app: Scenario,
    pipeline: Path,
    kills: int,
    default_seed: int,
    after_first_epoch: Callable[[int], None] = lambda run: None,
    before_run: Callable[[int], None] = lambda run: None,
) -> None:
    """Start the service `kills` times and SIGKILL each run at a random moment (0-2 s) after
    its first committed epoch; `before_run(run)` runs before it starts, `after_first_epoch(run)`
    just before the pause. Prints the seed (ONCEFLOW_FAULT_SEED replays it), the delays and
    the epochs of each run."""
    seed = int(os.environ.get("ONCEFLOW_FAULT_SEED", str(default_seed)))
    rng = random.Random(seed)
    delays, committed = [], []
    for run in range(kills):
        before_run(run)
        service = app.service(pipeline)
        wait_until(
            lambda s=service: _epochs_done(s) or s.process.poll() is not None,
            180,
            "the run's first committed epoch",
        )
        assert service.process.poll() is None, service.report()
        after_first_epoch(run)
        delay = rng.uniform(0.0, 2.0)
        time.sleep(delay)  # the random moment of the kill, not a synchronisation
        service.kill()
        delays.append(round(delay, 2))
        committed.append(_epochs_done(service))
    print(f"seed {seed}: killed {delays} s after each run's first committed epoch")
    print(f"epochs committed per run before its kill: {committed}")
    assert all(n >= 1 for n in committed), committed


CRASH_LOOP_KILL_AFTER_S = 30.0  # the recovery goal is 10 s: README, Recovery


def test_a_crash_loop_commits_an_epoch_every_round(app):
    """SIGKILL a fixed time after every start, whatever the service is doing (as a crash loop
    or an impatient liveness probe does): every round still commits an epoch, and the
    output is exactly once."""
    rounds = 10 if app.long else 2
    # Small epochs: the backlog outlasts every round (a round of 30 s ran up to 58 of them on
    # the 2-core CI machine; room here for 200), so a round without a commit is the service's
    # fault, never a lack of input.
    per_batch = len(app.events) // (rounds * 200)
    pipeline = app.pipeline(windowed=True, source={"max_records_per_batch": per_batch})
    commits = app.tmp / "checkpoint" / "commits"
    per_round = []
    for _ in range(rounds):
        before = _committed(commits)
        service = app.service(pipeline)
        time.sleep(CRASH_LOOP_KILL_AFTER_S)  # the kill's fixed moment, not a synchronisation
        assert service.process.poll() is None, service.report()
        service.kill()
        per_round.append(_committed(commits) - before)
    print(
        f"epochs committed per round, killed {CRASH_LOOP_KILL_AFTER_S:g} s after each start: "
        f"{per_round}"
    )
    assert all(n >= 1 for n in per_round), per_round
    # A round that ended the backlog would leave the drain nothing to run: after a restart
    # Spark does not run the epoch that only moves the watermark (see README).
    assert _records_read(app.tmp / "checkpoint") <= len(app.events), "make per_batch smaller"
    app.drain(app.pipeline(windowed=True))  # the rest in epochs of the default size
    app.check_windows()


def _records_read(checkpoint: Path) -> int:
    """Input records up to the end of the newest epoch in Spark's offset log."""
    newest = max(checkpoint.glob("offsets/[0-9]*"), key=lambda p: int(p.name))
    ranges = json.loads(newest.read_text().splitlines()[-1])
    return sum(
        end for topic, ends in ranges.items() if not topic.startswith("@") for end in ends.values()
    )


def _committed(commits: Path) -> int:
    """Epochs in Spark's commit log: the newest batch id, plus one."""
    ids = [int(p.name) for p in commits.glob("[0-9]*")] if commits.exists() else []
    return max(ids, default=-1) + 1


def in_a_container(host: str, tmp: Path) -> list[str]:
    """A command prefix that runs a service as a sibling container on this host runs: its own
    host name (in its /etc/hosts, as Docker writes it), pid namespace and /proc, on the same
    kernel, network and checkpoint directory."""
    hosts = tmp / f"hosts-{host}"
    hosts.write_text(f"127.0.0.1 localhost {host}\n")
    isolate = ["unshare", "--uts", "--pid", "--mount", "--fork", "--mount-proc"]
    probe = subprocess.run([*isolate, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(
            f"cannot run a service in namespaces of its own here ({probe.stderr.strip()}); "
            "tests/unit/test_lease.py covers a holder of another container with real processes"
        )
    setup = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
    return [*isolate, "sh", "-c", setup, "sh", host, str(hosts)]


@pytest.mark.parametrize("where", ["this-container", "another-container"])
def test_a_standby_takes_over_when_the_active_instance_is_killed(app, where):
    """`run --standby` starts Spark beside the active instance, stays out of the checkpoint
    while that one runs, and takes it over when it is SIGKILLed mid-backlog: at once, also
    from another container of this host (its own host name and pid namespace), where neither
    host name nor pid can tell whether the holder lives, but the kernel's lock can."""
    from onceflow.connectors.checkpoint import CLAIM

    per_batch = len(app.events) // 60  # small epochs: the backlog outlasts the standby's start
    pipeline = app.pipeline(windowed=True, source={"max_records_per_batch": per_batch})
    container = in_a_container("onceflow-standby", app.tmp) if where != "this-container" else ()
    active = app.service(pipeline)
    wait_until(
        lambda: _epochs_done(active) or active.process.poll() is not None,
        180,
        "the active instance's first committed epoch",
    )
    standby = app.service(pipeline, standby=True, container=container)
    wait_until(
        lambda: (
            "standby: waiting to take over" in standby.log.read_text(errors="replace")
            or standby.process.poll() is not None
        ),
        180,
        "the standby waiting for the lease",
    )
    assert active.process.poll() is None, active.report()
    assert standby.process.poll() is None, standby.report()
    holder = json.loads((app.tmp / "checkpoint" / CLAIM).read_text())["holder"]
    assert holder["pid"] == active.process.pid, holder
    assert "took over" not in standby.log.read_text(), standby.report()
    before = _epochs_done(active)
    active.kill()
    killed_at = time.time()
    wait_until(
        lambda: _epochs_done(standby) or standby.process.poll() is not None,
        180,
        "the standby's first committed epoch",
    )
    first_epoch = _logged_time(standby, r"epoch \d+ done: [1-9]") - killed_at
    took_over = _logged_time(standby, r"standby: took over") - killed_at
    print(
        f"active committed {before} epoch(s); the standby ({where}) took over {took_over:.1f} s "
        f"after the kill and committed its first epoch {first_epoch:.1f} s after"
    )
    # The holder's process is gone from this kernel: no waiting for its lease to expire.
    assert took_over < LEASE_S / 2, standby.report()
    holder = json.loads((app.tmp / "checkpoint" / CLAIM).read_text())["holder"]
    assert holder["host"] == ("onceflow-standby" if container else socket.gethostname()), holder
    if container:  # and back: a dead holder of another container holds nothing either
        standby.kill()
    else:
        assert standby.terminate() == 0, standby.report()
    app.drain(pipeline)
    app.check_windows()


def _logged_time(service: Service, pattern: str) -> float:
    """Wall-clock time of the first line of the service's log matching `pattern`."""
    from datetime import datetime

    for line in service.log.read_text(errors="replace").splitlines():
        if re.search(pattern, line):
            stamp = " ".join(line.split()[:2])
            return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise AssertionError(f"no line matching {pattern!r} in the log:\n{service.report()}")


def _epochs_done(service: Service) -> int:
    """Epochs this run committed, from its log ("epoch N done" follows Spark's commit log)."""
    return len(re.findall(r"epoch \d+ done: [1-9]", service.log.read_text(errors="replace")))


def test_sigterm_finishes_the_epoch_and_exits_0(app):
    pipeline = app.pipeline(windowed=False)
    service = app.service(pipeline)
    out = app.topics["out"]
    wait_until(lambda: len(read_committed(app.bootstrap, out)) > 0, 120, "first committed epoch")
    assert service.terminate() == 0, service.report()
    log = service.log.read_text(errors="replace")
    # The epoch running at SIGTERM commits (unless SIGTERM fell between two epochs); no later
    # epoch does, though a backlog remains. Epochs are compared by number: the listener's
    # "epoch N done" lines are logged asynchronously, possibly after the stop request.
    running = _logged_epoch(r"stop requested: finishing epoch (\d+)", log, service)
    last = _logged_epoch(r"stopped after epoch (-?\d+)", log, service)
    assert last in (running - 1, running), service.report()
    assert max(int(n) for n in re.findall(r"epoch (\d+) done", log)) == last, service.report()
    app.drain(pipeline)
    app.check_pass_through()


def test_ctrl_c_exits_130_and_the_restart_is_exactly_once(app):
    """Ctrl-C in a terminal signals the whole process group: the driver stops the query,
    Spark's Python workers are interrupted mid-task (the epoch is replayed on restart, as
    after the kills above)."""
    pipeline = app.pipeline(windowed=False)
    service = app.service(pipeline)
    out = app.topics["out"]
    wait_until(lambda: len(read_committed(app.bootstrap, out)) > 0, 120, "first committed epoch")
    os.killpg(service.process.pid, signal.SIGINT)
    assert service.wait() == 130, service.report()
    assert "Traceback" not in service.tail(), service.report()
    app.drain(pipeline)
    app.check_pass_through()


def _logged_epoch(pattern: str, log: str, service) -> int:
    match = re.search(pattern, log)
    assert match, f"no line matching {pattern!r} in the service's log:\n{service.report()}"
    return int(match.group(1))


def test_two_instances_at_once_one_is_fenced(app):
    pipeline = app.pipeline(windowed=False)
    first = app.service(pipeline)
    wait_until(lambda: len(read_committed(app.bootstrap, app.topics["out"])) > 0, 120, "output")
    # A second instance of the same app (same transactional id) with a checkpoint of its own:
    # starting fences the first; then it finds the sink's markers belong to another checkpoint.
    second = app.service(app.pipeline(windowed=False, checkpoint={"location": str(app.tmp / "b")}))
    assert second.wait() == 1
    assert "CheckpointMismatchError" in second.tail()
    # The first notices at its next commit: it has been fenced, and stops.
    more = [(f"u{i % USERS}", FLUSH_TS + 1 + i) for i in range(100)]
    produce(app.bootstrap, app.topics["in"], [(u.encode(), _click(u, ts), 1) for u, ts in more])
    app.events += more
    assert first.wait() == 1
    assert "FencedError: this instance was fenced" in first.tail()
    app.drain(pipeline)
    app.check_pass_through()


def test_broker_bounce_while_running(app, local_broker):
    pipeline = app.pipeline(windowed=False)
    service = app.service(pipeline)
    wait_until(lambda: len(read_committed(app.bootstrap, app.topics["out"])) > 0, 120, "output")
    local_broker.kill()  # hard
    time.sleep(3)
    local_broker.start(progress=lambda _: None)
    time.sleep(5)
    local_broker.stop(progress=lambda _: None)  # clean
    local_broker.start(progress=lambda _: None)
    if service.process.poll() is None:
        service.terminate()
    app.drain(pipeline)
    app.check_pass_through()


def test_a_deleted_checkpoint_is_refused_not_reprocessed(app):
    import shutil

    pipeline = app.pipeline(windowed=False)
    app.drain(pipeline)
    published = len(read_committed(app.bootstrap, app.topics["out"]))
    shutil.rmtree(app.tmp / "checkpoint")
    service = app.service(pipeline, available_now=True)
    assert service.wait() == 1
    assert "CheckpointMismatchError" in service.tail() and "was deleted" in service.tail()
    assert len(read_committed(app.bootstrap, app.topics["out"])) == published


def test_another_apps_or_an_unwritable_checkpoint_is_a_config_error(app):
    pipeline = app.pipeline(windowed=False)
    (app.tmp / "checkpoint").mkdir()
    (app.tmp / "checkpoint" / "onceflow-app.json").write_text('{"app_id": "someone-else"}')
    service = app.service(pipeline, available_now=True)
    assert service.wait() == 2
    assert (
        "checkpoint.location" in service.tail()
        and "belongs to app 'someone-else'" in service.tail()
    )

    unwritable = app.pipeline(windowed=False, checkpoint={"location": "/proc/onceflow-ck"})
    service = app.service(unwritable, available_now=True)
    assert service.wait() == 2
    assert "checkpoint.location: /proc/onceflow-ck is not usable" in service.tail()


HOSTILE = [
    b"{not json",  # malformed
    json.dumps({"user": "u1", "bytes": "lots", "ts": BASE}).encode(),  # wrong type
    json.dumps({"user": "u1", "bytes": 1}).encode(),  # no event time
    json.dumps({"bytes": 1, "ts": BASE}).encode(),  # no key field
    None,  # null value
    b"\xff\xfe not utf-8",
]


def test_hostile_input_is_accounted_for_and_nothing_crashes(app):
    huge = json.dumps({"user": "u2", "bytes": 5, "ts": BASE + 1, "pad": "x" * 900_000}).encode()
    far_past = _click("u3", 0)
    far_future = _click("u4", BASE + 10**10)
    produce(
        app.bootstrap,
        app.topics["in"],
        [(b"hostile", v, 1) for v in HOSTILE]
        + [(None, huge, 2), (None, far_past, 0), (None, far_future, 0)],
    )
    pipeline = app.pipeline(windowed=True)
    app.drain(pipeline)
    report = app.report(count_field="clicks")
    assert report.ok, report.summary()
    assert report.dead_letters == len(HOSTILE), report.summary()
    # The far-future record's window is the only one still open.
    assert report.pending == 1, report.summary()


def test_an_output_record_over_the_size_limit_becomes_a_dead_letter(app):
    # The app's producer takes records up to 500 kB; this input (accepted by the broker) is
    # bigger, so its pass-through output cannot be published as it is.
    big = json.dumps({"user": "u1", "bytes": 1, "ts": BASE, "pad": "y" * 600_000}).encode()
    produce(app.bootstrap, app.topics["in"], [(b"big", big, 0)])
    app.drain(app.pipeline(windowed=False, kafka={"message.max.bytes": 500_000}))
    report = app.report()
    assert report.ok, report.summary()
    (dead,) = read_committed(app.bootstrap, app.topics["dlq"])
    headers = dict(dead.headers())
    assert dead.key() == b"big" and dead.value() is None
    assert b"exceeds the producer limit of 500000 bytes" in headers["onceflow.error"]
    # Partition 0 holds every third event (ceil(n / 3)), then the far-ahead record, then this.
    offset = (len(app.events) + 2) // 3 + 1
    assert headers["onceflow.source"] == f"{app.topics['in']}/0/{offset}".encode()
