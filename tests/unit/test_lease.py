"""The checkpoint lease: a second instance is refused at start, naming the holder."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from onceflow.config import ConfigError
from onceflow.connectors.checkpoint import CLAIM, CheckpointDir
from onceflow.connectors.errors import CheckpointClaimError
from onceflow.lease import LEASE_S, LOCK_FILE, Lease


def hold(tmp_path, **holder) -> CheckpointDir:
    checkpoint = CheckpointDir(tmp_path)
    claim = {
        "app_id": "app",
        "holder": {"host": "other-host", "pid": 4242, "instance": "x", **holder},
        "heartbeat": time.time(),
    }
    (tmp_path / CLAIM).write_text(json.dumps(claim))
    return checkpoint


HOLDER = """
import sys, time
from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.lease import Lease
lease = Lease(CheckpointDir(sys.argv[1]), "app")
lease.holder.update(host=sys.argv[2], pid=int(sys.argv[3]))
lease.acquire()
print("held", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def holder_process(tmp_path, host: str, pid: int) -> Iterator[subprocess.Popen]:
    """Another process holding the lease, recorded with `host` and `pid`: as an instance in
    another container of this host records itself (its own host name, its namespace's pid)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), host, str(pid)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() == "held\n"
        yield process
    finally:
        process.kill()
        process.wait()


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


def test_a_live_holder_with_this_host_name_and_this_processes_pid_keeps_its_lease(tmp_path):
    """Two containers sharing a host name (host networking, one pod) in which onceflow has the
    same pid: the holder is not this process' earlier life while its process lives."""
    checkpoint = CheckpointDir(tmp_path)
    with (
        holder_process(tmp_path, socket.gethostname(), os.getpid()),
        pytest.raises(CheckpointClaimError, match=f"pid {os.getpid()}"),
    ):
        Lease(checkpoint, "app").acquire()


def test_a_holder_in_another_container_of_this_host_is_free_once_its_process_is_gone(tmp_path):
    checkpoint = CheckpointDir(tmp_path)
    with holder_process(tmp_path, "onceflow-standby", 7) as holder:
        with pytest.raises(CheckpointClaimError, match="host onceflow-standby, pid 7"):
            Lease(checkpoint, "app").acquire()
        holder.kill()
        holder.wait()
        heartbeat = json.loads((tmp_path / CLAIM).read_text())["heartbeat"]
        lease = Lease(checkpoint, "app")
        lease.acquire()  # at once: its heartbeat is fresh, its lock free
    assert time.time() - heartbeat < LEASE_S
    assert json.loads((tmp_path / CLAIM).read_text())["holder"] == lease.holder
    lease.release()


def test_a_holder_on_another_kernel_is_free_only_when_its_heartbeat_expires(tmp_path):
    """Another host sharing the volume: its lock means nothing here (a network file system
    may lock locally), so only its heartbeat tells, even for this very lock file."""
    (tmp_path / LOCK_FILE).write_text("")
    stat = (tmp_path / LOCK_FILE).stat()
    lock = {"boot": "another-boot", "device": stat.st_dev, "inode": stat.st_ino}
    checkpoint = hold(tmp_path, lock=lock)
    with pytest.raises(CheckpointClaimError, match="host other-host"):
        Lease(checkpoint, "app").acquire()
    claim = json.loads((tmp_path / CLAIM).read_text())
    claim["heartbeat"] -= LEASE_S + 1
    (tmp_path / CLAIM).write_text(json.dumps(claim))
    Lease(checkpoint, "app").acquire()


def test_a_lock_on_a_file_system_that_may_lock_per_client_proves_nothing(tmp_path, monkeypatch):
    """NFS with `local_lock`, FUSE: another kernel's holder (two VMs cloned from one memory
    snapshot share a boot id) would find the lock free. Only a local file system's counts."""
    from onceflow import lease as lease_module

    def gone_holder(directory) -> CheckpointDir:
        """A holder on another host whose lock is free now, its claim as it left it."""
        directory.mkdir()
        holder = Lease(CheckpointDir(directory), "app")
        holder.holder["host"] = "elsewhere"
        holder.acquire()
        holder._drop_lock()
        return CheckpointDir(directory)

    monkeypatch.setattr(lease_module, "_file_system_type", lambda device: "nfs4")
    checkpoint = gone_holder(tmp_path / "nfs")
    assert json.loads((tmp_path / "nfs" / CLAIM).read_text())["holder"]["lock"]["boot"] is None
    with pytest.raises(CheckpointClaimError, match="host elsewhere"):
        Lease(checkpoint, "app").acquire()
    monkeypatch.setattr(lease_module, "_file_system_type", lambda device: "ext4")
    Lease(gone_holder(tmp_path / "ext4"), "app").acquire()  # a local one's free lock frees it


def test_a_lock_file_that_cannot_be_opened_costs_only_the_quick_takeover(tmp_path):
    """The lease is still taken and renewed; only the holder's death is then seen when its
    heartbeat expires."""
    (tmp_path / LOCK_FILE).mkdir()  # cannot be opened for writing
    lease = Lease(CheckpointDir(tmp_path), "app")
    lease.acquire()
    assert lease.holder["lock"] is None
    before = json.loads((tmp_path / CLAIM).read_text())["heartbeat"]
    time.sleep(0.01)
    lease.renew_once()
    assert json.loads((tmp_path / CLAIM).read_text())["heartbeat"] > before
    assert not lease.lost.is_set()
    lease.release()


def test_a_holder_without_a_lock_is_free_only_when_its_heartbeat_expires(tmp_path):
    """An earlier onceflow's record, with no process to ask: dead or alive, it is held until
    its heartbeat is LEASE_S old."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    checkpoint = hold(tmp_path, host=socket.gethostname(), pid=dead.pid)
    with pytest.raises(CheckpointClaimError, match="expires 30 s from now"):
        Lease(checkpoint, "app").acquire()


def test_a_lock_file_replaced_under_its_holder_does_not_free_the_lease(tmp_path):
    """A checkpoint copied back over a running instance's: the new file's lock is free, but it
    is not the one the holder holds."""
    checkpoint = CheckpointDir(tmp_path)
    with holder_process(tmp_path, "onceflow-standby", 7):
        (tmp_path / LOCK_FILE).rename(tmp_path / "moved.lock")
        (tmp_path / LOCK_FILE).write_text("")
        with pytest.raises(CheckpointClaimError, match="host onceflow-standby"):
            Lease(checkpoint, "app").acquire()


def test_an_instance_that_took_over_from_a_paused_holder_locks_once_the_holder_exits(tmp_path):
    """A holder paused past its lease still holds the lock when another instance takes over;
    the new holder takes the lock at a renewal once the old one is gone, so that its own death
    is seen at once again."""
    checkpoint = CheckpointDir(tmp_path)
    with holder_process(tmp_path, "paused", 7) as paused:
        claim = json.loads((tmp_path / CLAIM).read_text())
        claim["heartbeat"] -= LEASE_S + 1
        (tmp_path / CLAIM).write_text(json.dumps(claim))
        lease = Lease(checkpoint, "app")
        lease.acquire()
        assert lease.holder["lock"] is None
        lease.renew_once()
        assert json.loads((tmp_path / CLAIM).read_text())["holder"]["lock"] is None
        paused.kill()
        paused.wait()
        lease.renew_once()
    recorded = json.loads((tmp_path / CLAIM).read_text())["holder"]["lock"]
    assert recorded is not None and recorded == lease.holder["lock"]
    with pytest.raises(CheckpointClaimError):
        Lease(checkpoint, "app").acquire()  # the lock is held (by this process' lease)
    lease.release()
    Lease(checkpoint, "app").acquire()


def test_a_refused_start_keeps_no_lock(tmp_path):
    """An instance refused at start must not keep the lock: a standby polls every 0.25 s, and a
    lock it kept would hide the holder's death from every other instance."""
    checkpoint = CheckpointDir(tmp_path)
    with holder_process(tmp_path, "paused", 7):
        claim = json.loads((tmp_path / CLAIM).read_text())
        claim["heartbeat"] -= LEASE_S + 1
        (tmp_path / CLAIM).write_text(json.dumps(claim))
        holder = Lease(checkpoint, "app")
        holder.acquire()  # without the lock, which the paused one holds
    refused = Lease(checkpoint, "app")  # the lock is free now, the lease is not
    with pytest.raises(CheckpointClaimError):
        refused.acquire()
    assert refused._lock_fd is None and refused.holder["lock"] is None
    holder.renew_once()
    assert holder.holder["lock"] is not None  # the refused start left the lock free
    holder.release()


@pytest.mark.parametrize("directory", ["tmp", "/dev/shm"])
def test_the_lock_files_file_system_is_read_from_its_own_mount(tmp_path, directory):
    """By the open file's mount, as findmnt (util-linux) reads it: a btrfs subvolume's device
    number is not its mount's, so a look-up by device would call it unknown."""
    from onceflow.lease import _file_system_type

    where = tmp_path if directory == "tmp" else Path(directory)
    path = where / f"lock-{os.getpid()}"
    expected = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "-T", str(path.parent)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[-1]  # the mount on top, where a path leads
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        assert _file_system_type(fd) == expected
    finally:
        os.close(fd)
        path.unlink()
    assert _file_system_type(10_000_000) is None  # no such descriptor: cannot be told


STANDBY = """
import sys, time
from onceflow import lease
from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.connectors.errors import CheckpointClaimError
lease.LEASE_S = float(sys.argv[2])
watch = lease.HeartbeatWatch() if sys.argv[3] == "standby" else None  # else a start, polled
print("claiming", flush=True)
while True:
    try:
        lease.Lease(CheckpointDir(sys.argv[1]), "app", watch).acquire()
    except CheckpointClaimError:
        time.sleep(0.02)
        continue
    print("took over", flush=True)
    break
"""


def _claim_lock_holders(checkpoint: Path) -> set[int]:
    """The pids holding a flock on the checkpoint's claim lock file (/proc/locks)."""
    inode = (checkpoint / f".{CLAIM}.lock").stat().st_ino
    holders = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1] == "FLOCK" and int(fields[5].rsplit(":", 1)[1]) == inode:
            holders.add(int(fields[4]))
    return holders


def _pause(process: subprocess.Popen) -> None:
    """SIGSTOP `process` and wait until it is stopped."""
    import signal

    os.kill(process.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert process.poll() is None, "the standby exited"
        assert time.monotonic() < deadline, "the standby did not stop"
        time.sleep(0.0005)


@pytest.mark.parametrize("judged", ["standby", "start"])
def test_a_standby_paused_anywhere_takes_no_lease_from_a_live_holder(tmp_path, monkeypatch, judged):
    """A standby (or a start, tried again and again) beside a live holder never holds the
    claim's lock: paused (SIGSTOP, a frozen container) while it held it, it would keep the
    holder from renewing and, resumed past LEASE_S, take the lease from a live instance.
    Pauses at 300 random points find it outside the lock each time; then one longer than the
    lease takes nothing."""
    import signal

    from onceflow import lease as lease_module
    from tests.helpers import wait_until

    lease_s = 3.0
    monkeypatch.setattr(lease_module, "LEASE_S", lease_s)
    active = Lease(CheckpointDir(tmp_path), "app")
    active.acquire()
    # A claim file large enough that reading it takes milliseconds: a standby that read it
    # under the lock would be caught holding it by about half of the pauses.
    claim = json.loads((tmp_path / CLAIM).read_text())
    (tmp_path / CLAIM).write_text(json.dumps({**claim, "padding": "x" * 4_000_000}))
    standby = subprocess.Popen(
        [sys.executable, "-c", STANDBY, str(tmp_path), str(lease_s), judged],
        stdout=subprocess.PIPE,
        text=True,
    )

    def heartbeat() -> float:
        return json.loads((tmp_path / CLAIM).read_text())["heartbeat"]

    try:
        assert standby.stdout.readline() == "claiming\n"
        caught = 0
        for _ in range(300):
            _pause(standby)
            caught += standby.pid in _claim_lock_holders(tmp_path)
            os.kill(standby.pid, signal.SIGCONT)
            time.sleep(0.002)  # let it run on
        assert caught == 0, f"{caught} of 300 pauses found the standby holding the claim's lock"

        _pause(standby)
        paused_at = time.time()
        wait_until(lambda: heartbeat() > paused_at + lease_s, 3 * lease_s, "renewals")
        os.kill(standby.pid, signal.SIGCONT)
        resumed = time.time()
        wait_until(lambda: heartbeat() > resumed + lease_s / 3, 3 * lease_s, "a renewal")
        assert standby.poll() is None and not active.lost.is_set(), active.lost_to
        assert json.loads((tmp_path / CLAIM).read_text())["holder"] == active.holder
    finally:
        standby.kill()
        standby.wait()
        active.release()


def test_a_paused_process_holding_the_claims_lock_hangs_no_start_and_no_stop(
    tmp_path, monkeypatch, caplog
):
    """A process paused while it holds the claim's lock (an instance that was taking the lease
    over): a start gives up on the lock after CLAIM_WAIT_S, naming it, and a stopping
    instance drops its own lock and goes on, so that its end is seen at once."""
    import fcntl
    import threading

    from onceflow.connectors import checkpoint as checkpoint_module

    monkeypatch.setattr(checkpoint_module, "CLAIM_WAIT_S", 0.5)

    def in_time(call) -> None:
        done = threading.Thread(target=call, daemon=True)
        done.start()
        done.join(10)
        assert not done.is_alive(), f"{call} waited for the claim's lock"

    def start() -> None:
        with pytest.raises(CheckpointClaimError, match="paused or hung"):
            Lease(CheckpointDir(tmp_path), "app").acquire()

    paused = open(tmp_path / f".{CLAIM}.lock", "w")  # noqa: SIM115
    fcntl.flock(paused, fcntl.LOCK_EX)
    in_time(start)
    paused.close()
    active = Lease(CheckpointDir(tmp_path), "app")
    active.acquire()
    with open(tmp_path / f".{CLAIM}.lock", "w") as paused:
        fcntl.flock(paused, fcntl.LOCK_EX)
        in_time(active.release)
    assert "could not release the checkpoint lease" in caplog.text
    successor = Lease(CheckpointDir(tmp_path), "app")
    successor.acquire()  # at once: the lease's lock is free, though its heartbeat is fresh
    assert json.loads((tmp_path / CLAIM).read_text())["holder"] == successor.holder
    successor.release()


def test_an_unreadable_claim_is_neither_free_for_a_start_nor_lost_for_its_holder(tmp_path):
    """An unreadable claim (NFS answers ESTALE for a file another host replaced; garbage)
    is not "no holder": read as none, a start would take a live holder's lease, and the
    holder's renewal would find its lease lost and stop the pipeline. Both wait instead."""
    claim_file = tmp_path / CLAIM
    holder = Lease(CheckpointDir(tmp_path), "app")
    holder.holder["host"] = "elsewhere"  # its lock proves nothing: only the claim tells
    holder.acquire()
    written = claim_file.read_bytes()
    claim_file.write_bytes(b'{"app_id": "app", "hol')
    with pytest.raises(CheckpointClaimError, match="cannot read the checkpoint's claim"):
        Lease(CheckpointDir(tmp_path), "app").acquire()
    with pytest.raises(CheckpointClaimError, match="cannot read the checkpoint's claim"):
        holder.renew_once()
    assert not holder.lost.is_set()
    claim_file.write_bytes(written)
    holder.renew_once()
    assert not holder.lost.is_set()
    assert json.loads(claim_file.read_text())["holder"] == holder.holder
    holder.release()


def test_a_waiting_standby_says_why_once_per_reason(tmp_path, caplog):
    """Not once per poll (4 a second), and not only the first reason: a claim that turns
    unreadable while the standby waits is news to its operator."""
    import threading

    from onceflow.lease import wait_for
    from tests.helpers import wait_until

    hold(tmp_path)
    stop = threading.Event()
    standby = threading.Thread(target=wait_for, args=(config_for(tmp_path), stop))
    with caplog.at_level("INFO", logger="onceflow.run"):
        standby.start()
        try:

            def said() -> list[str]:
                return [r.getMessage() for r in caplog.records if "standby: wait" in r.message]

            wait_until(lambda: len(said()) == 1, 10, "the standby's first reason")
            time.sleep(1.2)  # several polls, each refused for the same reason
            assert len(said()) == 1, said()
            (tmp_path / CLAIM).write_bytes(b"{torn")
            wait_until(lambda: len(said()) == 2, 10, "the standby's second reason")
            assert "held by another instance" in said()[0]
            assert "cannot read the checkpoint's claim" in said()[1]
        finally:
            stop.set()
            standby.join(5)


def test_a_standby_whose_clock_runs_ahead_takes_over_only_once_the_renewals_stop(
    tmp_path, monkeypatch
):
    """A holder on another host renews its heartbeat every LEASE_S / 3, and the standby's wall
    clock runs three leases ahead of it (a clock stepped forward, or a host's clock ahead):
    judged by the wall clock, every heartbeat looks expired. The standby takes nothing while
    the renewals go on, and takes over once they have stopped for LEASE_S."""
    import threading
    from types import SimpleNamespace

    from onceflow import lease as lease_module
    from onceflow.lease import wait_for
    from tests.helpers import wait_until

    lease_s = 1.5
    monkeypatch.setattr(lease_module, "LEASE_S", lease_s)
    ahead = SimpleNamespace(time=lambda: time.time() + 3 * lease_s, monotonic=time.monotonic)
    monkeypatch.setattr(lease_module, "time", ahead)
    hold(tmp_path)
    renewing, last_renewal = threading.Event(), [time.monotonic()]
    renewing.set()

    def renew() -> None:
        while renewing.is_set():
            claim = json.loads((tmp_path / CLAIM).read_text())
            (tmp_path / f"{CLAIM}.new").write_text(json.dumps({**claim, "heartbeat": time.time()}))
            os.replace(tmp_path / f"{CLAIM}.new", tmp_path / CLAIM)
            last_renewal[0] = time.monotonic()
            time.sleep(lease_s / 3)

    taken: list = []
    stop = threading.Event()
    holder = threading.Thread(target=renew)
    standby = threading.Thread(
        target=lambda: taken.append((wait_for(config_for(tmp_path), stop), time.monotonic()))
    )
    holder.start()
    standby.start()
    try:
        standby.join(3 * lease_s)
        assert not taken, "the standby took the lease from a holder that renews it"
        renewing.clear()
        holder.join()
        wait_until(lambda: taken, 4 * lease_s, "the standby to take over")
        lease, taken_at = taken[0]
        assert lease is not None
        assert taken_at - last_renewal[0] >= lease_s
    finally:
        renewing.clear()
        stop.set()
        standby.join(5)
        if taken and taken[0][0] is not None:
            taken[0][0].release()
