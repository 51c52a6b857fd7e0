"""The checkpoint's lease: one running instance per checkpoint, refused at start otherwise.

Kafka fencing and Spark's logs already keep a second instance from publishing twice, but
only once it reaches a commit; a lease refuses it at start, with a message naming the
holder. The holder renews its heartbeat every LEASE_S / 3 seconds. A lease is free when it
was released, when its heartbeat is older than LEASE_S, or when its holder is a process of
this host that no longer runs (a restarted container has the same host name and pid).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.connectors.errors import CheckpointClaimError

from .config import ConfigError, PipelineConfig

log = logging.getLogger("onceflow.run")

LEASE_S = 30.0
MISSED_RENEWAL_S = LEASE_S / 3 + 2.0  # a live holder renews every LEASE_S / 3
STANDBY_POLL_S = 0.25


class Lease:
    """This instance's hold on a checkpoint; `release` it on exit."""

    def __init__(self, checkpoint: CheckpointDir, app_id: str) -> None:
        self.checkpoint = checkpoint
        self.app_id = app_id
        self.holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_namespace": _pid_namespace(),
            "pid_started": _started(os.getpid()),
            "instance": uuid.uuid4().hex,
            "since": time.time(),
        }
        self._stop = threading.Event()
        self.lost = threading.Event()  # set when another instance took the lease over
        self.lost_to: dict = {}

    def acquire(self) -> None:
        """Take the lease, or raise CheckpointClaimError naming its live holder. A holder on
        this host in another pid namespace is waited for until it misses a renewal."""
        time.sleep(self._wait_for_a_renewal())
        with self.checkpoint.claim() as claim:
            owner = claim.get("app_id", self.app_id)
            if owner != self.app_id:
                raise ConfigError(
                    "checkpoint.location",
                    f"{self.checkpoint.path} belongs to app {owner!r}, not {self.app_id!r}; "
                    "point this app at its own checkpoint directory",
                )
            held = claim.get("holder")
            if held and not self._is_free(held, claim.get("heartbeat", 0.0)):
                age = time.time() - claim.get("heartbeat", 0.0)
                raise CheckpointClaimError(
                    f"checkpoint {self.checkpoint.path} is held by another instance of app "
                    f"{self.app_id!r} (host {held.get('host')}, pid {held.get('pid')}, last "
                    f"heartbeat {age:.0f} s ago). Stop that instance; if it is gone, its lease "
                    f"expires {max(0.0, LEASE_S - age):.0f} s from now."
                )
            claim.update(app_id=self.app_id, holder=self.holder, heartbeat=time.time())
        threading.Thread(target=self._renew, name="onceflow-lease", daemon=True).start()

    def _wait_for_a_renewal(self) -> float:
        """Seconds until a holder of this host in another pid namespace has missed a renewal:
        a restarted container's earlier life never renews, a live sibling does."""
        with self.checkpoint.claim() as claim:
            held, heartbeat = claim.get("holder"), claim.get("heartbeat", 0.0)
        if not held or held.get("pid") == os.getpid() or not self._in_another_namespace(held):
            return 0.0
        return max(0.0, min(MISSED_RENEWAL_S, heartbeat + MISSED_RENEWAL_S - time.time()))

    def _in_another_namespace(self, held: dict) -> bool:
        return (
            held.get("host") == self.holder["host"]
            and held.get("pid_namespace", self.holder["pid_namespace"])
            != self.holder["pid_namespace"]
        )

    def _is_free(self, held: dict, heartbeat: float) -> bool:
        """Free when its heartbeat expired, or its holder is a process of this host that no
        longer runs. A holder with this process' pid is its earlier life (a restarted
        container has the same host name and pid). Other pids are looked up only in the
        holder's own pid namespace; a holder in another one (a sibling container with the
        same host name, or this container's earlier life) is gone once it missed a renewal."""
        age = time.time() - heartbeat
        if age > LEASE_S:
            return True
        if held.get("host") != self.holder["host"]:
            return False
        pid = held.get("pid")
        if pid == os.getpid():
            return True  # an earlier life of this process, or of its container
        if self._in_another_namespace(held):
            return age > MISSED_RENEWAL_S
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # another user's process: the start time tells whether the pid was reused
        except (OSError, TypeError):
            return False
        started = held.get("pid_started")
        return started is not None and _started(pid) not in (None, started)  # pid reused

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_S / 3):
            try:
                with self.checkpoint.claim() as claim:
                    if (claim.get("holder") or {}).get("instance") != self.holder["instance"]:
                        self.lost_to = claim.get("holder") or {}
                        self.lost.set()
                        return
                    claim["heartbeat"] = time.time()
            except OSError as exc:  # the next renewal tries again; the lease lasts LEASE_S
                log.warning("could not renew the checkpoint lease: %s", exc)

    def lost_error(self) -> CheckpointClaimError:
        holder = self.lost_to
        return CheckpointClaimError(
            f"another instance (host {holder.get('host')}, pid {holder.get('pid')}) took over "
            f"checkpoint {self.checkpoint.path} while this one did not renew its lease (paused "
            f"for over {LEASE_S:.0f} s?); this one stops. Run one instance per checkpoint."
        )

    def release(self) -> None:
        self._stop.set()
        try:
            with self.checkpoint.claim() as claim:
                if (claim.get("holder") or {}).get("instance") == self.holder["instance"]:
                    claim["holder"] = None
        except OSError as exc:
            log.warning("could not release the checkpoint lease: %s", exc)


def check_standby(config: PipelineConfig) -> None:
    """A standby takes over through the lease, which only a local checkpoint has, and runs
    Spark on its own cores: on a cluster it would hold executors the active one needs."""
    if not config.spark_master.startswith("local"):
        raise ConfigError(
            "spark.master",
            f"a standby (`run --standby`) needs a local master (local[N]), not "
            f"{config.spark_master}: waiting, it would hold the cluster's executors",
        )
    if not CheckpointDir(config.checkpoint_location).is_local:
        raise ConfigError(
            "checkpoint.location",
            "a standby (`run --standby`) takes over through the checkpoint's lease, which needs "
            "a local or mounted directory; remote checkpoints have none, so run one instance",
        )


def wait_for(config: PipelineConfig, stop: threading.Event) -> Lease | None:
    """A standby's wait: the lease, as soon as the active instance's ends (released, expired,
    or its process gone from this host); None when `stop` is set first."""
    announced = False
    while not stop.is_set():
        try:
            return acquire(config)
        except CheckpointClaimError as held:
            if not announced:
                log.info("standby: waiting to take over (%s)", str(held).split(". ")[0])
                announced = True
        stop.wait(STANDBY_POLL_S)
    return None


def acquire(config: PipelineConfig) -> Lease | None:
    """Claim the pipeline's checkpoint for this instance (None: remote storage, which Spark
    guards; the sink's markers still check the checkpoint's identity)."""
    checkpoint = CheckpointDir(config.checkpoint_location)
    if not checkpoint.is_local:
        return None
    lease = Lease(checkpoint, config.app_id)
    try:
        checkpoint.path.mkdir(parents=True, exist_ok=True)
        lease.acquire()
    except OSError as exc:
        raise ConfigError(
            "checkpoint.location",
            f"{checkpoint.path} is not usable ({exc.strerror}); it must be a writable directory",
        ) from None
    return lease


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _started(pid: int) -> int | None:
    """The process' start time (clock ticks after boot): tells a reused pid from its first
    owner."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
