"""The checkpoint lease: a second instance is refused at start, naming the holder."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from onceflow.config import ConfigError
from onceflow.connectors.checkpoint import CLAIM, CheckpointDir
from onceflow.connectors.errors import CheckpointClaimError
from onceflow.lease import LEASE_S, Lease


def hold(tmp_path, **holder) -> CheckpointDir:
    checkpoint = CheckpointDir(tmp_path)
    claim = {
        "app_id": "app",
        "holder": {"host": "other-host", "pid": 4242, "instance": "x", **holder},
        "heartbeat": time.time(),
    }
    (tmp_path / CLAIM).write_text(json.dumps(claim))
    return checkpoint


def test_a_second_instance_is_refused_naming_the_holder(tmp_path):
    checkpoint = hold(tmp_path)
    with pytest.raises(CheckpointClaimError, match="host other-host, pid 4242"):
        Lease(checkpoint, "app").acquire()


def test_a_lease_whose_heartbeat_expired_is_taken_over(tmp_path):
    checkpoint = hold(tmp_path)
    claim = json.loads((tmp_path / CLAIM).read_text())
    claim["heartbeat"] -= LEASE_S + 1
    (tmp_path / CLAIM).write_text(json.dumps(claim))
    lease = Lease(checkpoint, "app")
    lease.acquire()
    assert json.loads((tmp_path / CLAIM).read_text())["holder"] == lease.holder
    lease.release()


def test_a_dead_process_of_this_host_holds_nothing(tmp_path):
    import socket

    dead = subprocess.Popen(["true"])
    dead.wait()
    checkpoint = hold(tmp_path, host=socket.gethostname(), pid=dead.pid)
    Lease(checkpoint, "app").acquire()


def test_a_released_lease_is_free_and_a_second_start_is_refused_while_held(tmp_path):
    checkpoint = CheckpointDir(tmp_path)
    first = Lease(checkpoint, "app")
    first.acquire()
    second = Lease(checkpoint, "app")
    second.holder["host"] = "elsewhere"  # as if on another node sharing the volume
    with pytest.raises(CheckpointClaimError):
        second.acquire()
    first.release()
    second.acquire()


def test_another_apps_checkpoint_is_a_config_error(tmp_path):
    (tmp_path / CLAIM).write_text(json.dumps({"app_id": "someone-else"}))
    with pytest.raises(ConfigError, match="belongs to app 'someone-else'"):
        Lease(CheckpointDir(tmp_path), "app").acquire()
