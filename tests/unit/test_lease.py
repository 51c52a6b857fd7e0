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


def config_for(tmp_path, location: str | None = None, master: str = "local[2]"):
    from types import SimpleNamespace

    return SimpleNamespace(
        checkpoint_location=location or str(tmp_path), app_id="app", spark_master=master
    )


def test_a_standby_takes_over_as_soon_as_the_holder_releases(tmp_path):
    import threading

    from onceflow.lease import wait_for

    active = Lease(CheckpointDir(tmp_path), "app")
    active.holder["host"] = "elsewhere"  # this process would count as the holder's later life
    active.acquire()
    taken: list = []
    standby = threading.Thread(
        target=lambda: taken.append(wait_for(config_for(tmp_path), threading.Event()))
    )
    standby.start()
    standby.join(1.0)
    assert standby.is_alive() and not taken  # still waiting while the lease is held
    active.release()
    standby.join(5.0)
    assert taken and taken[0] is not None
    assert json.loads((tmp_path / CLAIM).read_text())["holder"] == taken[0].holder
    taken[0].release()


def test_a_standby_stopped_while_waiting_takes_nothing(tmp_path):
    import threading

    from onceflow.lease import wait_for

    hold(tmp_path)
    stop = threading.Event()
    threading.Timer(0.6, stop.set).start()
    started = time.monotonic()
    assert wait_for(config_for(tmp_path), stop) is None
    assert 0.5 < time.monotonic() - started < 5
    assert json.loads((tmp_path / CLAIM).read_text())["holder"]["host"] == "other-host"


def test_a_standby_needs_a_checkpoint_with_a_lease(tmp_path):
    from onceflow.lease import check_standby

    check_standby(config_for(tmp_path))
    with pytest.raises(ConfigError, match="remote checkpoints have none"):
        check_standby(config_for(tmp_path, "s3a://bucket/checkpoints/app"))
    with pytest.raises(ConfigError, match="it would hold the cluster's executors"):
        check_standby(config_for(tmp_path, master="spark://spark-master:7077"))


def test_a_holder_in_another_pid_namespace_is_not_looked_up_here(tmp_path):
    """A sibling container with the same host name: its pid means nothing in this namespace;
    it is gone only once it has missed a renewal."""
    import socket

    from onceflow.lease import MISSED_RENEWAL_S

    dead = subprocess.Popen(["true"])
    dead.wait()  # no such process here; the holder's may well be alive in its own namespace
    sibling = {"host": socket.gethostname(), "pid": dead.pid, "pid_namespace": 1}
    lease = Lease(hold(tmp_path, **sibling), "app")
    assert not lease._is_free(sibling, time.time() - 5)
    assert lease._is_free(sibling, time.time() - MISSED_RENEWAL_S - 1)


def test_a_start_waits_for_a_sibling_namespace_holder_to_miss_a_renewal(tmp_path, monkeypatch):
    import socket
    import threading

    from onceflow import lease

    MISSED_RENEWAL_S = 2.0  # the lease's, shortened for the test
    monkeypatch.setattr(lease, "MISSED_RENEWAL_S", MISSED_RENEWAL_S)

    sibling = {"host": socket.gethostname(), "pid": 999_999, "pid_namespace": 1}
    checkpoint = hold(tmp_path, **sibling)
    claim = json.loads((tmp_path / CLAIM).read_text())
    claim["heartbeat"] = time.time() - MISSED_RENEWAL_S + 1  # a renewal is due in 1 s
    (tmp_path / CLAIM).write_text(json.dumps(claim))
    started = time.monotonic()
    Lease(checkpoint, "app").acquire()  # it never renews: this container's earlier life
    assert time.monotonic() - started >= 0.9

    renewing = threading.Event()

    def renew() -> None:  # a live sibling
        while not renewing.wait(0.2):
            with checkpoint.claim() as live:
                live["holder"], live["heartbeat"] = sibling, time.time()

    claim["heartbeat"] = time.time()
    (tmp_path / CLAIM).write_text(json.dumps(claim))
    threading.Thread(target=renew, daemon=True).start()
    try:
        with pytest.raises(CheckpointClaimError):
            Lease(checkpoint, "app").acquire()
    finally:
        renewing.set()


def test_a_reused_pid_does_not_keep_a_dead_holders_lease(tmp_path):
    import os
    import socket

    from onceflow.lease import _pid_namespace, _started

    alive = subprocess.Popen(["sleep", "30"])
    try:
        mine = {"host": socket.gethostname(), "pid": alive.pid, "pid_namespace": _pid_namespace()}
        with pytest.raises(CheckpointClaimError):  # the holder runs: refused
            Lease(hold(tmp_path, **mine, pid_started=_started(alive.pid)), "app").acquire()
        reused = {**mine, "pid_started": _started(alive.pid) - 1}  # an earlier process' pid
        Lease(hold(tmp_path, **reused), "app").acquire()
    finally:
        alive.kill()
        alive.wait()
    assert os.getpid() != alive.pid
