"""`onceflow kafka start|stop|status` on a second, private broker (its own port and home)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def kafka_cli(action: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "kafka", action],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def broker_processes(home: Path) -> int:
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes()
        except OSError:
            continue
        if b"kafka.Kafka" in args and str(home).encode() in args:
            count += 1
    return count


def test_start_twice_leaves_one_broker_and_status_tells_the_truth(tmp_path, local_broker):
    # Reuse the downloaded jars of the session broker; only data, pid and log are private.
    home = tmp_path / "home"
    (home / local_broker.libs.parent.name).mkdir(parents=True)
    os.symlink(local_broker.libs, home / local_broker.libs.parent.name / "libs")
    env = {**os.environ, "ONCEFLOW_HOME": str(home), "ONCEFLOW_KAFKA_PORT": "19192"}

    assert kafka_cli("status", env).returncode == 3
    assert kafka_cli("status", env).stdout.strip() == "not running"
    try:
        first = kafka_cli("start", env)
        assert first.returncode == 0, first.stderr
        assert "Kafka is ready at 127.0.0.1:19192" in first.stdout
        second = kafka_cli("start", env)
        assert "already running at 127.0.0.1:19192" in second.stdout
        assert broker_processes(home) == 1
        status = kafka_cli("status", env)
        assert status.returncode == 0 and status.stdout.startswith("running at 127.0.0.1:19192")
    finally:
        stopped = kafka_cli("stop", env)
    assert stopped.returncode == 0 and "Kafka stopped" in stopped.stdout
    assert broker_processes(home) == 0
    assert kafka_cli("status", env).stdout.strip() == "not running"
