"""A fork server for Spark's Python processes, so that a restart does not wait for imports.

Spark starts a Python process (`python -m pyspark...`) for every kind of Python work: looking
data sources up, creating one, planning a read, planning a write, the source's runner, the
sink's commit, the tasks' workers. A restarted pipeline starts seven of them, one after
another on the micro-batch thread, and each spends most of its start importing pyspark (see
bench/results/first-epoch.md). This module is a shortcut with three parts:

- The server runs beside the driver from before the JVM starts. It imports what those
  processes import (only modules that start no thread: a fork copies no thread) and, when
  asked, forks a child that runs the asked module as `__main__` with the asking process'
  standard streams, environment, working directory, arguments and ignored signals.
- The launcher, a shell script beside the server's socket, is the Python that Spark runs
  (PYSPARK_PYTHON and PYSPARK_DRIVER_PYTHON while the JVM starts): it sends `-m pyspark...`
  to this module and runs everything else with the real interpreter.
- This module as `__main__` hands its standard streams to the server, forwards the signals
  Spark stops its processes with, and ends as its child ends. When the server cannot serve
  it (gone, or a request it must refuse: another interpreter, network namespace or start-up
  setting such as PYTHONHASHSEED) it runs the module itself, as Spark would have.

The child talks to the JVM over the same pipes and sockets as a process started by Spark;
the server only saves the imports. It exits when the driver closes its standard input. (In
`ps`, a child shows the server's command line: Python cannot rewrite its own.)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import resource
import select
import shlex
import signal
import socket
import struct
import sys

# What Spark's Python processes import. A fork copies no thread, so the server must start
# none: these start none. Not the streaming source's runner, which Spark runs as `__main__`:
# runpy executes it anew, and warns when it was imported. (pyspark.daemon, also run as
# `__main__`, is imported by its child: see run_as_main.)
PRELOAD = (
    "pyspark.serializers",
    "pyspark.worker",
    "pyspark.sql.worker.lookup_data_sources",
    "pyspark.sql.worker.create_data_source",
    "pyspark.sql.worker.write_into_data_source",
    "pyspark.sql.worker.commit_data_source_write",
    "pyspark.sql.worker.python_streaming_sink_runner",
    "onceflow.connectors.datasource",
    "onceflow.routing",
)
# What the read planner, the source's runner and every task's worker import besides: the
# biggest part of their start. These start threads when imported (OpenBLAS' pool through
# numpy, Arrow's jemalloc purger) unless told not to, so the server imports them with
# THREAD_FREE_SETTINGS, and only when the driver's environment sets none of those itself.
# Its children then run with one OpenBLAS thread and jemalloc purging as it allocates.
PRELOAD_NUMERIC = (
    "pyarrow",
    "pyarrow.compute",
    "pandas",
    "pyarrow.pandas_compat",
    "pyspark.sql.worker.plan_data_source_read",
    "pyspark.sql.datasource_internal",
)
# Also left to the children when the driver sets one of these (OpenBLAS reads them too).
BLAS_THREAD_SETTINGS = ("GOTO_NUM_THREADS", "OMP_NUM_THREADS")
THREAD_FREE_SETTINGS = {
    "OPENBLAS_NUM_THREADS": "1",
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
}
# Settings a process takes at its start (Python's own) or that preloaded modules read when
# imported: a request whose value differs from the server's is refused.
START_UP_SETTINGS = re.compile(
    r"PYTHON(?!PATH$|UNBUFFERED$)[A-Z]+|PYSPARK_ENABLE_NAMEDTUPLE_PATCH|SPARK_TESTING|"
    r"PY4J_SKIP_COLLECTIONS|TZ|LC_[A-Z]+|LANG|"
    r"OPENBLAS_[A-Z_]+|GOTO_NUM_THREADS|JE_ARROW_MALLOC_CONF|ARROW_[A-Z_]+|NPY_[A-Z_]+|"
    r"NUMPY_[A-Z_]+|PANDAS_[A-Z_]+"
)
# Signals the launched process forwards, and the child takes as it did: Spark stops its
# processes with SIGTERM; the JVM starts them with SIGINT ignored.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_DIRECTORY_PREFIX = "onceflow-forkserver-"
_HEADER = struct.Struct("!Q")
_INT = struct.Struct("!i")
_REFUSED = -1
_HANDSHAKE_TIMEOUT_S = 10.0
_UNLOCKED_GRACE_S = 60.0  # a directory not locked yet is younger than this
_server = None  # this process' server and its launcher, started once


def start_server() -> str | None:
    """Start this process' server (once); return its launcher, to be PYSPARK_PYTHON while
    the JVM starts (see `spark_python`). None when it cannot start."""
    global _server
    if _server is not None:
        return _server[1]
    import tempfile

    try:
        os.close(os.pidfd_open(os.getpid()))  # Linux 5.3+, and not refused by seccomp
        _remove_stale_directories(tempfile.gettempdir())
        directory = tempfile.mkdtemp(prefix=f"{_DIRECTORY_PREFIX}{os.getpid()}-")
        lock = _lock(directory)
    except (AttributeError, OSError):
        return None  # Spark starts its Python processes itself, as without the server
    path = os.path.join(directory, "socket")
    # A Unix socket's path must fit in 108 bytes; the JVM cannot run a launcher on noexec.
    if len(path.encode()) > 100 or os.statvfs(directory).f_flag & os.ST_NOEXEC:
        import shutil

        shutil.rmtree(directory)
        os.close(lock)
        return None
    launcher = os.path.join(directory, "python")
    _write_launcher(launcher, path)
    _server = (spawn(path), launcher, lock)
    return launcher


def _lock(directory: str) -> int:
    """The lock that keeps `directory` from other drivers' clean-up while this one lives
    (on the directory itself: no file in it that /tmp's cleaners could remove); the kernel
    drops it when this process ends, however it ends."""
    import fcntl

    lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def spawn(path: str):
    """The server process, serving at `path` until its standard input (a pipe) closes."""
    import subprocess

    # Spark's own default for its Python processes: hash() and set order repeat on replay.
    env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
    return subprocess.Popen(
        [sys.executable, "-m", "onceflow.forkserver", "--serve", path],
        stdin=subprocess.PIPE,
        env=env,
    )


@contextlib.contextmanager
def spark_python(launcher: str | None):
    """PYSPARK_PYTHON and PYSPARK_DRIVER_PYTHON are `launcher` inside: the SparkContext
    takes the one, the JVM started inside the other. Restored after, so that no process
    started later (a Spark worker, another pipeline) inherits this process' server."""
    names = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")
    before = {name: os.environ.get(name) for name in names}
    if launcher is not None:
        os.environ.update(dict.fromkeys(names, launcher))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _write_launcher(path: str, socket_path: str) -> None:
    python, server = shlex.quote(sys.executable), shlex.quote(socket_path)
    with open(path, "w") as out:
        out.write(
            "#!/bin/sh\n"
            "# Spark's Python for one onceflow process (onceflow.forkserver)\n"
            f'if [ "$1" = -m ] && [ "${{2#pyspark.}}" != "$2" ] && [ -S {server} ]; then\n'
            "    shift\n"
            f'    exec {python} -m onceflow.forkserver {server} "$@"\n'
            "fi\n"
            f'exec {python} "$@"\n'
        )
    os.chmod(path, 0o755)


def _remove_stale_directories(tmp: str) -> None:
    """Directories of servers whose driver was killed (a server removes its own as it ends,
    which a SIGKILL of the whole process group does not let it do). A driver holds a lock on
    its directory while it lives: a lock, not its pid, because a driver in another PID
    namespace that shares this /tmp has a pid this process cannot see. Spared: directories
    younger than a minute (being made, not locked yet) and unlocked ones whose pid lives
    here (made by an onceflow before the lock)."""
    import fcntl
    import shutil
    import time

    for name in os.listdir(tmp):
        owner = name[len(_DIRECTORY_PREFIX) :].split("-", 1)[0]
        if not (name.startswith(_DIRECTORY_PREFIX) and owner.isdigit()):
            continue
        directory = os.path.join(tmp, name)
        with contextlib.suppress(OSError):
            status = os.stat(directory)
            if status.st_uid != os.getuid() or time.time() - status.st_mtime < _UNLOCKED_GRACE_S:
                continue
            lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its driver lives
                if not _alive(int(owner)):
                    shutil.rmtree(directory)
            finally:
                os.close(lock)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the launched side: runs in the process Spark starts --------------------------------------


def run(path: str, module: str, args: list[str]) -> None:
    """Run `module` as `__main__` with `args`: in a child of the server at `path` when it
    serves this request, else here."""
    ignored = [s for s in SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
    server = _connect(path)
    pid, child = _ask_for_child(server, module, args, ignored) if server else (_REFUSED, None)
    if pid == _REFUSED:
        run_as_main(module, args)
        return
    assert server is not None
    # The JVM's pipes now belong to the child alone: Spark sees their end when it ends.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    for signum in set(SIGNALS) - set(ignored):
        signal.signal(signum, lambda received, _frame: _forward(child, received))
    code = _wait_for(server, child)
    if code < 0:  # the child was killed by a signal: so is this process, as Spark would see it
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def run_as_main(module: str, args: list[str]) -> None:
    """`python -m module args` for one of pyspark's modules, which ends quietly (exit 1) where
    the JVM has hung up on it.

    Spark closes a daemon's worker it kept idle after a minute without work, and stops its
    processes at its own stop; the process reads the end of its input, writes an error and
    flushes it. Over TCP that write went out unnoticed; over a Unix socket
    (spark_session.python_socket_conf) it fails at once, and pyspark printed the
    BrokenPipeError's traceback into the service's log, every minute a pipeline was idle.
    No one is left to read that process. A daemon's worker is wrapped because the daemon
    prints what its worker raises (re-raised from the final flush while
    `spark.python.daemon.killWorkerOnFlushFailure` is true, Spark's default).
    """
    import runpy

    sys.argv = [module, *args]
    try:
        if module == "pyspark.daemon":
            import pyspark.daemon as daemon

            if callable(getattr(daemon, "worker", None)) and callable(
                getattr(daemon, "manager", None)
            ):
                daemon.worker = _quiet_when_hung_up(daemon.worker)
                daemon.manager()  # what the module runs as __main__
                return
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except BrokenPipeError:  # the JVM closed this process' socket
        os._exit(1)


def _quiet_when_hung_up(worker):
    def quiet_worker(*args, **kwargs):
        try:
            return worker(*args, **kwargs)
        except BrokenPipeError:  # the JVM closed this worker's socket
            os._exit(1)

    return quiet_worker


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _ask_for_child(
    server: socket.socket, module: str, args: list[str], ignored: list
) -> tuple[int, int | None]:
    """The pid of the server's child that runs `module` and a pidfd of it, or _REFUSED."""
    request = {
        "module": module,
        "args": args,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "ignored": [int(s) for s in ignored],
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
        "umask": _umask(),
        "python": sys.executable,
        "home": os.path.dirname(os.path.abspath(__file__)),
        "netns": _network_namespace(),
    }
    data = json.dumps(request).encode()
    try:
        socket.send_fds(server, [_HEADER.pack(len(data))], [0, 1, 2])
        server.sendall(data)
    except OSError:  # the server is gone (its driver is going): nothing was forked
        return _REFUSED, None
    try:
        answer, fds, _, _ = socket.recv_fds(server, _INT.size, 1)
        if len(answer) != _INT.size:
            raise ConnectionError("the fork server closed the connection")
    except OSError as exc:  # a child may have been forked: running the module here too is
        sys.exit(f"onceflow fork server: no answer ({exc})")  # not safe
    return _INT.unpack(answer)[0], (fds[0] if fds else None)


def _wait_for(server: socket.socket, child: int | None) -> int:
    """The child's exit code from the server; if the server is gone first, 0 once the child
    has ended (its code was the server's to collect)."""
    while True:
        ready, _, _ = select.select([server, *([child] if child is not None else [])], [], [])
        if server in ready:
            try:
                return _INT.unpack(_read_exactly(server, _INT.size))[0]
            except OSError:
                if child is not None:
                    select.select([child], [], [])
                return 0
        # The child ended: the server's report follows at once, unless the server is gone.
        if not select.select([server], [], [], 5)[0]:
            return 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _forward(child: int | None, signum: int) -> None:
    if child is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(child, signum)


def _network_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the fork server closed the connection")
        data += chunk
    return data


# -- the server ------------------------------------------------------------------------------


def serve(path: str) -> None:
    """Fork children for whoever connects to `path` until standard input closes."""
    import gc

    # Its life is its driver's (standard input): a Ctrl-C or a SIGTERM to the process group
    # is for the driver, which stops the query first.
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # before importing: an early request waits instead of going alone
    listener.listen(64)
    _preload(PRELOAD)
    if not any(name in os.environ for name in [*THREAD_FREE_SETTINGS, *BLAS_THREAD_SETTINGS]):
        driver_environment = dict(os.environ)
        os.environ.update(THREAD_FREE_SETTINGS)
        _preload(PRELOAD_NUMERIC)
        os.environ.clear()  # what the children compare their start-up settings with
        os.environ.update(driver_environment)
    if _threads() != 1:
        print(
            "onceflow fork server: a preloaded module started a thread, so no process is "
            "forked (Spark starts them itself, more slowly). Please report this with "
            "`pip freeze`.",
            file=sys.stderr,
        )
    gc.freeze()  # what was imported stays shared with the children instead of being copied
    exited_r, exited_w = os.pipe()  # a child's exit wakes the loop at once
    os.set_blocking(exited_w, False)
    signal.set_wakeup_fd(exited_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # child pid -> the connection of the process Spark started (None once that one died)
    children: dict[int, socket.socket | None] = {}
    ended = False
    try:
        while True:
            watched = [sys.stdin, listener, exited_r, *(c for c in children.values() if c)]
            ready, _, _ = select.select(watched, [], [])
            if exited_r in ready:
                os.read(exited_r, 4096)
            _report_exits(children)
            if sys.stdin in ready and not os.read(0, 4096):
                ended = True  # the driver is gone: so may the launcher be
                return
            if listener in ready:
                _start_child(listener, children, [exited_r, exited_w])
            for pid, conn in list(children.items()):
                if conn is not None and conn in ready:
                    # What Spark started is gone (killed): so goes the child it stood for.
                    conn.close()
                    children[pid] = None
                    _forward_to_pid(pid, signal.SIGTERM)
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        # With the launcher, if start_server made it; after a failure the launcher stays, and
        # finds no socket: Spark's Python processes start as without the server.
        directory = os.path.dirname(path)
        if ended and os.path.basename(directory).startswith(_DIRECTORY_PREFIX):
            import shutil

            shutil.rmtree(directory, ignore_errors=True)


def _preload(modules: tuple[str, ...]) -> None:
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # the child imports it again and reports what is wrong
            print(f"onceflow fork server: could not preload {module}: {exc}", file=sys.stderr)


def _threads() -> int:
    """This process' threads; -1 when /proc cannot tell (then nothing is forked)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _start_child(
    listener: socket.socket, children: dict[int, socket.socket | None], pipe: list[int]
) -> None:
    conn, _ = listener.accept()
    conn.settimeout(_HANDSHAKE_TIMEOUT_S)
    fds: list[int] = []
    pid = _REFUSED
    try:
        header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
        if len(header) != _HEADER.size or len(fds) != 3:
            raise ConnectionError("incomplete request")
        request = json.loads(_read_exactly(conn, _HEADER.unpack(header)[0]))
        if _serves(request):
            # Blocked, a signal sent to the child before it takes its dispositions waits
            # instead of being dropped as the server's ignored ones are.
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            try:
                pid = os.fork()
            except OSError:  # e.g. a cgroup's process limit: the starter runs it itself
                pid = _REFUSED
            if pid == 0:
                open_sockets = [listener, conn, *(c for c in children.values() if c)]
                _become(request, fds, open_sockets, pipe)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        _answer(conn, pid)
    except (OSError, ValueError, KeyError) as exc:
        print(f"onceflow fork server: request failed ({exc})", file=sys.stderr)
        conn.close()
        if pid > 0:  # forked, but its starter cannot know: it must not run unseen
            _forward_to_pid(pid, signal.SIGKILL)
            children[pid] = None
        return
    finally:
        for fd in fds:
            os.close(fd)
    if pid == _REFUSED:  # the starter runs the module itself
        conn.close()
    else:
        conn.settimeout(None)
        children[pid] = conn


def _answer(conn: socket.socket, pid: int) -> None:
    """The child's pid, with a pidfd of it that the asker signals it through: opened here,
    before the child can be reaped, so it never stands for a process that took over the pid
    (as one the asker opened after reading the pid could)."""
    try:
        pidfd = os.pidfd_open(pid) if pid != _REFUSED else None
    except OSError:  # e.g. out of descriptors: the asker then cannot forward signals
        pidfd = None
    if pidfd is None:
        conn.sendall(_INT.pack(pid))
        return
    try:
        socket.send_fds(conn, [_INT.pack(pid)], [pidfd])
    finally:
        os.close(pidfd)


def _serves(request: dict) -> bool:
    """Only requests a child of this server can run exactly as a process of their own."""
    env = request["env"]
    settings = {n for n in [*env, *os.environ] if START_UP_SETTINGS.fullmatch(n)}
    return (
        _threads() == 1  # a fork copies no thread: whatever one held would stay held
        and request["python"] == sys.executable
        and request["home"] == os.path.dirname(os.path.abspath(__file__))
        and request["netns"] == _network_namespace()
        and all(env.get(n) == os.environ.get(n) for n in settings)
    )


def _report_exits(children: dict[int, socket.socket | None]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(_INT.pack(os.waitstatus_to_exitcode(status)))
            conn.close()


def _forward_to_pid(pid: int, signum: int) -> None:
    """Only to a child not yet reaped (its pid cannot have been reused)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _become(request: dict, fds: list[int], sockets: list[socket.socket], pipe: list[int]) -> None:
    """In the forked child: take the requester's streams, environment, directory, arguments
    and signal dispositions, then run its module. Never returns into the server's loop."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in pipe:
            os.close(fd)
        for sock in sockets:
            sock.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for signum in SIGNALS:
            if signum in request["ignored"]:
                signal.signal(signum, signal.SIG_IGN)
            elif signum == signal.SIGINT:
                signal.signal(signum, signal.default_int_handler)
            else:
                signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        os.umask(request["umask"])
        with contextlib.suppress(ValueError, OSError):  # a higher hard limit needs privilege
            resource.setrlimit(resource.RLIMIT_NOFILE, tuple(request["nofile"]))
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # As for `python -m`: the working directory first, then PYTHONPATH.
        sys.path[0] = request["cwd"]
        for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(1, entry)
        # As Spark starts them: unbuffered (PYTHONUNBUFFERED), and encoded as the server's
        # streams, which took the same start-up settings (PYTHONIOENCODING, the locale).
        encodings = [
            (getattr(stream, "encoding", None), getattr(stream, "errors", None))
            for stream in (sys.stdin, sys.stdout, sys.stderr)  # None: the server's fd was closed
        ]
        encoding, errors = encodings[0]
        sys.stdin = open(0, encoding=encoding, errors=errors, closefd=False)  # noqa: SIM115
        sys.stdout, sys.stderr = [
            io.TextIOWrapper(
                io.FileIO(fd, "w", closefd=False),
                encoding=encoding,
                errors=errors,
                write_through=True,
            )
            for fd, (encoding, errors) in ((1, encodings[1]), (2, encodings[2]))
        ]
        # The server imported onceflow.connectors without the service's logging settings;
        # the child has them now (its environment is its asker's).
        from onceflow import logs

        logs.configure_spark_process()
        # numpy's global random state was seeded once, in the server: each child its own,
        # as each process Spark starts has (Python's `random` reseeds itself on fork).
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        run_as_main(request["module"], request["args"])
        code = 0
    except SystemExit as exc:  # how Spark's Python processes end
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        run(sys.argv[1], sys.argv[2], sys.argv[3:])
