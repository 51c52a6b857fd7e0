"""Spark's Python processes come from onceflow's fork server, and Spark still stops them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

# A process of its own: its own JVM, fork server and daemons, stopped at the end.
SCRIPT = """
import json, os, sys, time
from pathlib import Path
from pyspark import SparkContext
from onceflow import forkserver
from onceflow.spark_session import build_session
from onceflow.warmup import warm_up
from tests.helpers import processes

spark = build_session("local[2]", "fork-server-test")
warm_up(spark)  # every kind of daemon a query's first epoch needs but the commit runner's
jvm, server = SparkContext._gateway.proc.pid, forkserver._server[0].pid
inherited = [os.environ.get(n) for n in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")]
seen = processes()
commands = {pid: (p, b" ".join(c).decode()) for pid, (p, c) in seen.items()}
launched = [c for p, c in commands.values() if p == jvm and "python" in c]
forked = [pid for pid, (p, _) in seen.items() if p == server]
spark.stop()
deadline = time.monotonic() + 30
while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in forked):
    time.sleep(0.1)
left = [pid for pid in forked if Path(f"/proc/{pid}").exists()]
print(json.dumps({
    "launched": launched,
    "forked": len(forked),
    "left": left,
    "inherited": inherited == [sys.executable] * 2,
}))
"""


def test_sparks_python_daemons_are_forked_by_the_server_and_stopped_with_spark():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # Every Python process the JVM started asked the server for its daemon ...
    assert seen["launched"], "the JVM started no Python process"
    for command in seen["launched"]:
        assert "-m onceflow.forkserver " in command, seen["launched"]
        assert " pyspark.daemon pyspark." in command, seen["launched"]
    # ... lookup, create, read planning, write planning, tasks, batch commit ...
    assert seen["forked"] >= 6, seen
    # ... and Spark's stop (SIGTERM to what it started) reached the daemons.
    assert seen["left"] == [], seen
    # Processes the driver starts later (a Spark worker, another pipeline) run plain Python.
    assert seen["inherited"], seen
