"""The checkpoint's lease: one running instance per checkpoint, refused at start otherwise.

Kafka fencing and Spark's logs already keep a second instance from publishing twice, but
only once it reaches a commit; a lease refuses it at start, with a message naming the
holder. The holder renews its heartbeat every LEASE_S / 3 seconds, and holds a kernel lock
(`flock`) on a file beside the claim for as long as its process lives. A lease is free when
it was released, when its heartbeat is older than LEASE_S, or when its holder locked on a
local file system of this kernel (the same boot: any container of this host) and its lock
is free: the kernel drops a dead process' locks, whatever its host name, pid or pid
namespace. Any other holder (another host's, one on a network file system) is free only
when its heartbeat expires: for a start, by the wall clock; for a standby, which watches it,
by its own monotonic clock (HeartbeatWatch).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
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
STANDBY_POLL_S = 0.25
LOCK_FILE = ".lease.lock"  # never removed: a holder's lock is on this file's inode
# File systems whose flock only this kernel keeps, for every process on it (any container).
LOCAL_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "tmpfs", "overlay"}
)


class HeartbeatWatch:
    """A standby's record of the holder's heartbeat: which one it saw, since when on its own
    monotonic clock. A heartbeat that stood unchanged for LEASE_S of that clock has missed
    three renewals whatever either host's wall clock says, so a standby whose clock is
    stepped forward, or runs ahead of the holder's host, takes no live holder's lease."""

    def __init__(self) -> None:
        self._seen: tuple | None = None
        self._since = 0.0

    def unchanged_for(self, held: dict, heartbeat: float, asked_mono: float) -> float:
        """Seconds the heartbeat had stood at `asked_mono` (taken before the claim was read,
        as Lease.acquire explains)."""
        seen = (held.get("instance"), heartbeat)
        if seen != self._seen:
            self._seen, self._since = seen, time.monotonic()
        return asked_mono - self._since


class Lease:
    """This instance's hold on a checkpoint; `release` it on exit. A standby passes the
    HeartbeatWatch it keeps across its polls."""

    def __init__(
        self, checkpoint: CheckpointDir, app_id: str, watch: HeartbeatWatch | None = None
    ) -> None:
        self.checkpoint = checkpoint
        self.app_id = app_id
        self.watch = watch
        self.holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "instance": uuid.uuid4().hex,
            "since": time.time(),
            "lock": None,  # the lock file's identity and this kernel's boot, while held
            # Read by the lease of earlier builds, which knew no lock: such a standby beside
            # this one (a rolling upgrade) must not take this process for a dead one.
            "pid_namespace": _pid_namespace(),
            "pid_started": _started(os.getpid()),
        }
        self._lock_fd: int | None = None
        self._fd_guard = threading.Lock()  # the renewal thread and release() both drop it
        self._unopenable_logged = False
        self._stop = threading.Event()
        self.lost = threading.Event()  # set when another instance took the lease over
        self.lost_to: dict = {}

    def acquire(self) -> None:
        """Take the lease, or raise CheckpointClaimError naming its live holder.

        While this instance holds the claim's lock, the holder cannot renew. Paused there
        (SIGSTOP, a frozen container) past LEASE_S, it would find a live holder's heartbeat
        expired. So:
        1. The heartbeat is judged as of now, before the lock is asked for.
        2. The lease is judged first from the claim as last written, without the lock: a
           standby that polls beside a live holder never takes the lock at all.
        3. Only a lease that looks free is judged again, and taken, under the lock.
        """
        asked_at, asked_mono = time.time(), time.monotonic()
        try:
            self._claim(self.checkpoint.read_claim(), asked_at, asked_mono)
            # Its lock was only probed: held outside the claim's lock, it could keep a
            # lockless holder (one that took over from a paused one) from taking it.
            self._drop_lock()
            with self.checkpoint.claim() as claim:
                self._claim(claim, asked_at, asked_mono)
        except BaseException:
            self._drop_lock()  # a lock kept without the lease would keep out every other
            raise
        threading.Thread(target=self._renew, name="onceflow-lease", daemon=True).start()

    def _claim(self, claim: dict, asked_at: float, asked_mono: float) -> None:
        owner = claim.get("app_id", self.app_id)
        if owner != self.app_id:
            raise ConfigError(
                "checkpoint.location",
                f"{self.checkpoint.path} belongs to app {owner!r}, not {self.app_id!r}; "
                "point this app at its own checkpoint directory",
            )
        held = claim.get("holder")
        self._take_lock()
        if held and not self._is_free(held, claim.get("heartbeat", 0.0), asked_at, asked_mono):
            self._drop_lock()  # the next claimer must find it free
            age = time.time() - claim.get("heartbeat", 0.0)
            raise CheckpointClaimError(
                f"checkpoint {self.checkpoint.path} is held by another instance of app "
                f"{self.app_id!r} (host {held.get('host')}, pid {held.get('pid')}, last "
                f"heartbeat {age:.0f} s ago). Stop that instance; if it is gone, its lease "
                f"expires {max(0.0, LEASE_S - age):.0f} s from now."
            )
        claim.update(app_id=self.app_id, holder=self.holder, heartbeat=time.time())

    def _is_free(self, held: dict, heartbeat: float, asked_at: float, asked_mono: float) -> bool:
        """Free when it held its lock on this kernel and this instance could take that lock
        (of the same file): its process is gone. Else (another host's, or a holder that could
        not lock: its predecessor, paused, still held the lock) when its heartbeat had expired
        when this instance asked: as the standby's watch saw it stand, or by the wall clock."""
        mine = self.holder["lock"]
        if mine is not None and mine["boot"] is not None and held.get("lock") == mine:
            return True
        if self.watch is not None:
            return self.watch.unchanged_for(held, heartbeat, asked_mono) > LEASE_S
        return min(asked_at, time.time()) - heartbeat > LEASE_S  # a clock set back: as of now

    def _take_lock(self) -> None:
        """Lock the lease's file if no live process holds it; record what was locked. A
        lock that cannot be taken (held, or the file not openable) is no lock: the
        heartbeat tells."""
        with self._fd_guard:
            if self._lock_fd is not None or self._stop.is_set():
                return
            try:
                fd = os.open(self.checkpoint.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                if not self._unopenable_logged:
                    log.warning(
                        "cannot open the lease's lock file %s (%s): an instance that takes "
                        "over after this one dies waits for its heartbeat to expire (%.0f s)",
                        self.checkpoint.path / LOCK_FILE,
                        exc.strerror,
                        LEASE_S,
                    )
                    self._unopenable_logged = True
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                stat = os.fstat(fd)
            except OSError:
                os.close(fd)
                return
            self._lock_fd = fd
            # Only a local file system's lock is the kernel's alone. One shared over a network
            # may lock per client (NFS `local_lock`, FUSE), and two VMs cloned from one memory
            # snapshot share a boot id: such a lock proves nothing, the heartbeat tells.
            local = _file_system_type(fd) in LOCAL_FILE_SYSTEMS
            boot = _boot_id() if local else None
            self.holder["lock"] = {"boot": boot, "device": stat.st_dev, "inode": stat.st_ino}

    def _drop_lock(self) -> None:
        with self._fd_guard:
            fd, self._lock_fd = self._lock_fd, None
            self.holder["lock"] = None
        if fd is not None:
            os.close(fd)

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_S / 3):
            try:
                self.renew_once()
            except Exception as exc:  # the next renewal tries again; the lease lasts LEASE_S
                log.warning("could not renew the checkpoint lease: %s", exc)
            if self.lost.is_set():
                return

    def renew_once(self) -> None:
        """Renew the heartbeat, and take the lock if a paused predecessor held it when this
        instance took over; or find the lease lost to another instance."""
        with self.checkpoint.claim() as claim:
            if self._stop.is_set():  # released meanwhile: its lock is gone, record nothing
                return
            if (claim.get("holder") or {}).get("instance") != self.holder["instance"]:
                self.lost_to = claim.get("holder") or {}
                self._drop_lock()
                self.lost.set()
                return
            self._take_lock()
            claim["holder"] = self.holder
            claim["heartbeat"] = time.time()

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
                self._drop_lock()  # inside the claim: the next claimer finds the lock free
        except (OSError, CheckpointClaimError) as exc:  # its heartbeat expires; the lock goes
            self._drop_lock()
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
    or its process gone from this kernel: any container of this host); None when `stop` is
    set first."""
    announced, watch = "", HeartbeatWatch()
    while not stop.is_set():
        try:
            return acquire(config, watch)
        except CheckpointClaimError as refused:
            why = str(refused).split(". ")[0]
            if _kind(why) != _kind(announced):  # once per reason, not per poll
                log.info("standby: waiting to take over (%s)", why)
                announced = why
        stop.wait(STANDBY_POLL_S)
    return None


def _kind(refusal: str) -> str:
    """A refusal without its numbers (a heartbeat's age, the seconds left)."""
    return re.sub(r"\d+", "#", refusal)


def acquire(config: PipelineConfig, watch: HeartbeatWatch | None = None) -> Lease | None:
    """Claim the pipeline's checkpoint for this instance (None: remote storage, which Spark
    guards; the sink's markers still check the checkpoint's identity)."""
    checkpoint = CheckpointDir(config.checkpoint_location)
    if not checkpoint.is_local:
        return None
    lease = Lease(checkpoint, config.app_id, watch)
    try:
        checkpoint.path.mkdir(parents=True, exist_ok=True)
        lease.acquire()
    except OSError as exc:
        raise ConfigError(
            "checkpoint.location",
            f"{checkpoint.path} is not usable ({exc.strerror}); it must be a writable directory",
        ) from None
    return lease


def _file_system_type(fd: int) -> str | None:
    """The type of the file system that open file `fd` is on, found by its mount (the mount
    id in /proc/self/fdinfo): a btrfs subvolume's or an overlay's device number is not its
    mount's. None when it cannot be told."""
    try:
        info = Path(f"/proc/self/fdinfo/{fd}").read_bytes().splitlines()
        mount = next(line.split()[1] for line in info if line.startswith(b"mnt_id:"))
        for line in Path("/proc/self/mountinfo").read_bytes().splitlines():
            fields = line.split()
            if fields and fields[0] == mount and b"-" in fields[1:]:
                return fields[fields.index(b"-", 1) + 1].decode("ascii", "replace")
    except (OSError, StopIteration, IndexError):
        return None
    return None


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _started(pid: int) -> int | None:
    """The process' start time (clock ticks after boot), as earlier builds' lease reads it."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    """This kernel's boot: the same in every container of a host, new after a reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None
