"""What the local broker and registry share: finding tools, ports and processes, a start lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# How long a SIGKILLed process may take to end (its threads to release its files).
EXIT_WAIT_S = 30.0


class LocalServiceError(RuntimeError):
    """A local service (broker, registry) could not be set up or started; the message says
    what to do."""


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (two `start`s at once start one process)."""
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pid_in(pid_file: Path, command_mark: bytes) -> int | None:
    """The pid in `pid_file` if that process is alive and its command line holds
    `command_mark` (a stale pid file, or a pid the system gave to another program: None).
    A process still exiting is waited for, then None: its threads may hold its ports."""
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):  # no file, or the process reaped as it was read
        return None
    if exiting(pid):  # no command line left to check; wait, so that its ports are free
        if not wait_exit(pid, EXIT_WAIT_S):
            raise LocalServiceError(
                f"the process of {pid_file} (pid {pid}) has been exiting for "
                f"{EXIT_WAIT_S:.0f} s; see `ps -L -p {pid}` for what it is stuck in"
            )
        return None
    return pid if command_mark in cmdline and alive(pid) else None


def require_tool(tool: str, what: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise LocalServiceError(f"`{tool}` is not on PATH: install {what}, then try again.")
    return path


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child (exited, not yet reaped) still answers kill(0); /proc tells the truth.
    try:
        return _state(pid) != "Z" or exiting(pid)
    except OSError:  # reaped meanwhile
        return False


def exiting(pid: int) -> bool:
    """Whether `pid`'s main thread has exited and its other threads not yet: a SIGKILLed JVM
    tearing down shows Z for its main thread while its threads still hold its files and
    listening sockets (and /proc no longer shows its command line)."""
    try:
        return _state(pid) == "Z" and len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:  # reaped meanwhile
        return False


def _state(pid: int) -> str:
    """The state letter of /proc/PID/stat (after the command name, which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log (read from its last 64 KB: a broker's log grows)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 65_536))
            end = fh.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(end.splitlines()[-lines:])


def stop(pid: int, name: str, timeout: float, progress: Callable[[str], None]) -> None:
    """SIGTERM `pid` (a clean shutdown), SIGKILL it if it outlives `timeout`."""
    progress(f"Stopping {name} (pid {pid}) ...")
    os.kill(pid, signal.SIGTERM)
    if not wait_exit(pid, timeout):
        progress(f"{_sentence(name)} did not stop within {timeout:.0f}s; killing it")
        os.kill(pid, signal.SIGKILL)
        if not wait_exit(pid, EXIT_WAIT_S):
            raise LocalServiceError(
                f"{name} (pid {pid}) outlived SIGKILL by {EXIT_WAIT_S:.0f} s; see "
                f"`ps -L -p {pid}` for what it is stuck in"
            )
    progress(f"{_sentence(name)} stopped")


def wait_ready(
    answers: Callable[[], bool],
    pid: int,
    name: str,
    log: Path,
    timeout: float,
    progress: Callable[[str], None],
    doing: Callable[[], str | None] = lambda: None,
) -> None:
    """Poll `answers` until it is true; LocalServiceError if the process exits first, or if
    `timeout` passes without an answer and without news from `doing` (what the process
    reports it is busy with, e.g. a broker loading thousands of partitions after a crash:
    it is waited for as long as it gets on). A note every 10 s shows it is still waiting."""
    deadline = time.monotonic() + timeout
    next_note = time.monotonic() + 10
    busy_with = doing()
    while time.monotonic() < deadline:
        if answers():
            return
        if not alive(pid):
            raise LocalServiceError(
                f"{_sentence(name)} exited during startup. Its log {log} ends with:\n{tail(log)}"
            )
        if (now_doing := doing()) != busy_with:  # news: it gets on, so wait on
            busy_with, deadline = now_doing, time.monotonic() + timeout
        if time.monotonic() > next_note:
            progress(f"  still waiting for {name} to answer{_aside(busy_with)} ...")
            next_note = time.monotonic() + 10
        time.sleep(0.2)
    raise LocalServiceError(
        f"{_sentence(name)} neither answered nor got on for {timeout:.0f}s{_aside(busy_with)}; "
        f"its log {log} ends with:\n{tail(log)}\nStop it, look into that log, and start it again."
    )


def _aside(text: str | None) -> str:
    return f" ({text})" if text else ""


def _sentence(name: str) -> str:
    return name[:1].upper() + name[1:]
