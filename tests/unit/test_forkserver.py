"""The fork server's plumbing, with real processes (no Spark): a launched module runs in a
child of the server exactly as if it had been started directly, or directly when the
server cannot serve it."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from onceflow import forkserver
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def serving():
    """A server started with this process' environment; its process and socket path."""
    path = os.path.join(tempfile.mkdtemp(prefix="forkserver-test-"), "socket")  # short
    process = forkserver.spawn(path)
    try:
        wait_until(lambda: os.path.exists(path), 30, "the server's socket")
        yield process, path
    finally:
        process.stdin.close()
        process.wait(30)


@pytest.fixture
def server():
    with serving() as started:
        yield started


def launch(path: str, cwd: Path, *args: str, env: dict | None = None, **popen):
    """What the launcher runs for `python -m tests.apps.report_process ARGS`."""
    env = {
        **os.environ,
        "REPORT_MARKER": "from the launcher",
        "PYTHONPATH": str(REPO),
        "PYTHONHASHSEED": "0",  # as Spark starts its Python processes
        **(env or {}),
    }
    command = [sys.executable, "-m", "onceflow.forkserver", path, "tests.apps.report_process"]
    return subprocess.Popen(
        [*command, *args], env=env, cwd=cwd, stdout=subprocess.PIPE, stdin=subprocess.PIPE, **popen
    )


def report_of(launched: subprocess.Popen, stdin: bytes = b"") -> dict:
    out, _ = launched.communicate(stdin, timeout=60)
    return json.loads(out)


def test_a_launched_module_runs_in_a_child_of_the_server_as_if_started_directly(server, tmp_path):
    process, path = server
    launched = launch(path, tmp_path, "3")
    report = report_of(launched, b"input from the launcher")
    assert report["ppid"] == process.pid
    assert report["pid"] != launched.pid
    assert report["cwd"] == report["path0"] == str(tmp_path)
    assert (report["argv"], report["marker"], report["stdin"]) == (
        ["3"],
        "from the launcher",
        "input from the launcher",
    )
    assert launched.returncode == 3


def test_a_child_starts_with_pyarrow_and_pandas_from_a_server_without_threads(server, tmp_path):
    """A task's worker would import them itself, its longest step; a thread in the server
    would make every fork unsafe."""
    process, path = server
    assert report_of(launch(path, tmp_path, "0"))["preloaded"] == ["pandas", "pyarrow"]
    assert len(os.listdir(f"/proc/{process.pid}/task")) == 1


def test_a_driver_that_sets_a_thread_setting_has_children_import_pyarrow_themselves(
    monkeypatch, tmp_path
):
    """The server cannot keep the user's OpenBLAS threads out of a fork: it leaves those
    modules to the children, which take the setting as Spark's processes would."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    with serving() as (process, path):
        report = report_of(launch(path, tmp_path, "0"))
    assert (report["ppid"], report["preloaded"]) == (process.pid, [])


def test_children_draw_different_numpy_random_numbers(server, tmp_path):
    """numpy's global state was seeded in the server; a fork would repeat its sequence."""
    _, path = server
    draws = [report_of(launch(path, tmp_path, "0"))["numpy_draw"] for _ in range(2)]
    assert draws[0] != draws[1], draws


def test_a_childs_streams_take_pythonioencoding_as_a_started_process_would(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONIOENCODING", "latin-1:replace")
    with serving() as (process, path):
        report = report_of(launch(path, tmp_path, "0"))
    assert report["ppid"] == process.pid
    assert report["encodings"] == [
        ["iso8859-1", "replace"],
        ["iso8859-1", "replace"],
        ["iso8859-1", "backslashreplace"],  # Python's for stderr, whatever the setting
    ]


ASKER = """
import os, sys
from onceflow import forkserver
server = forkserver._connect(sys.argv[1])
pid, pidfd = forkserver._ask_for_child(server, "tests.apps.report_process", ["0"], [])
fdinfo = dict(line.split(":", 1) for line in open(f"/proc/self/fdinfo/{pidfd}") if ":" in line)
print("ASKER", pid, fdinfo["Pid"].strip(), flush=True)
forkserver._wait_for(server, pidfd)
"""


def test_the_asker_gets_a_pidfd_of_its_child_from_the_server(server, tmp_path):
    """Opened by the server before it can reap the child: a pidfd the asker opened from the
    pid could be of another process by then, which a forwarded SIGTERM would then stop."""
    _, path = server
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [sys.executable, "-c", ASKER, path],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    asker = [line.split() for line in done.stdout.splitlines() if line.startswith("ASKER")]
    assert asker, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    _, pid, pidfd_of = asker[0]
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert pid == pidfd_of == str(report["pid"])


def test_a_child_hashes_as_a_process_started_with_sparks_hash_seed(server, tmp_path):
    """hash() and the order of sets must repeat when a failed epoch is replayed."""
    direct = subprocess.run(
        [sys.executable, "-c", "print(hash('onceflow'))"],
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    report = report_of(launch(server[1], tmp_path, "0"))
    assert report["ppid"] == server[0].pid
    assert report["hash"] == int(direct.stdout)


def test_another_start_up_setting_is_refused_and_runs_where_launched(server, tmp_path):
    launched = launch(server[1], tmp_path, "0", env={"PYTHONHASHSEED": "7"})
    report = report_of(launched)
    assert report["pid"] == launched.pid
    assert launched.returncode == 0


def test_an_ignored_sigint_stays_ignored_in_the_child(server, tmp_path):
    """The JVM starts its Python processes with SIGINT ignored: a Ctrl-C is the driver's."""

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    ignoring = report_of(launch(server[1], tmp_path, "0", preexec_fn=ignore_sigint))
    assert ignoring["ppid"] == server[0].pid and ignoring["sigint_ignored"]
    assert not report_of(launch(server[1], tmp_path, "0"))["sigint_ignored"]


def test_a_child_has_the_umask_and_open_file_limit_of_its_asker(server, tmp_path):
    """The JVM raises its soft limit of open files to the hard one; the driver may not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def as_the_jvm_starts_it() -> None:
        os.umask(0o077)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))

    report = report_of(launch(server[1], tmp_path, "0", preexec_fn=as_the_jvm_starts_it))
    assert report["ppid"] == server[0].pid
    assert (report["umask"], report["nofile"]) == (0o077, soft - 1)


def test_a_child_killed_by_sigkill_is_reported_as_such(server, tmp_path):
    launched = launch(server[1], tmp_path, "0", "wait")
    os.kill(json.loads(launched.stdout.readline())["pid"], signal.SIGKILL)
    assert launched.wait(30) == -signal.SIGKILL


def test_without_a_server_the_module_runs_in_the_launched_process(tmp_path):
    launched = launch(str(tmp_path / "no-server"), tmp_path, "4")
    assert report_of(launched)["pid"] == launched.pid
    assert launched.returncode == 4


def test_a_server_refuses_another_installation_whose_modules_may_differ(server, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/opt/other/bin/python")
    connection = forkserver._connect(server[1])
    assert connection is not None
    with connection:
        answer = forkserver._ask_for_child(connection, "tests.apps.report_process", ["0"], [])
    assert answer == (forkserver._REFUSED, None)  # and the launched process runs it itself


def test_sigterm_to_the_launched_process_ends_its_child_as_spark_stops_a_daemon(server, tmp_path):
    launched = launch(server[1], tmp_path, "0", "wait")
    child = json.loads(launched.stdout.readline())["pid"]
    launched.send_signal(signal.SIGTERM)
    assert launched.wait(30) == -signal.SIGTERM
    wait_until(lambda: not Path(f"/proc/{child}").exists(), 30, "the child to be gone")


def test_the_child_of_a_killed_launcher_is_stopped(server, tmp_path):
    launched = launch(server[1], tmp_path, "0", "wait")
    child = json.loads(launched.stdout.readline())["pid"]
    launched.kill()
    launched.wait(30)
    wait_until(lambda: not Path(f"/proc/{child}").exists(), 30, "the child to be gone")


def test_the_server_ignores_a_ctrl_c_and_leaves_when_its_driver_closes_its_input(server):
    process, path = server
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(1)
    process.stdin.close()
    assert process.wait(30) == 0
    assert not os.path.exists(path)


def test_spark_python_is_the_launcher_only_while_the_jvm_starts(monkeypatch):
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.delenv("PYSPARK_DRIVER_PYTHON", raising=False)
    with forkserver.spark_python("/tmp/x/python"):
        assert (
            os.environ["PYSPARK_PYTHON"] == os.environ["PYSPARK_DRIVER_PYTHON"] == ("/tmp/x/python")
        )
    assert os.environ["PYSPARK_PYTHON"] == sys.executable
    assert "PYSPARK_DRIVER_PYTHON" not in os.environ


def test_a_server_started_for_a_driver_removes_its_directory_as_it_ends():
    directory = tempfile.mkdtemp(prefix="onceflow-forkserver-0-")
    (Path(directory) / "python").write_text("the launcher")
    process = forkserver.spawn(os.path.join(directory, "socket"))
    wait_until(lambda: os.path.exists(os.path.join(directory, "socket")), 30, "the socket")
    process.stdin.close()
    assert process.wait(30) == 0
    assert not os.path.exists(directory)


def test_directories_of_killed_drivers_are_removed_and_no_other(tmp_path):
    """A driver's lock says whether it lives; its pid cannot in another PID namespace."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    dead, alive = ended.pid, os.getpid()
    dirs = {
        "killed": tmp_path / f"onceflow-forkserver-{dead}-killed",
        "elsewhere": tmp_path / f"onceflow-forkserver-{dead}-elsewhere",  # locked, pid unseen
        "making": tmp_path / f"onceflow-forkserver-{dead}-making",  # not locked yet
        "older_onceflow": tmp_path / f"onceflow-forkserver-{alive}-older",  # no lock, pid lives
    }
    long_ago = time.time() - 2 * forkserver._UNLOCKED_GRACE_S
    for name, directory in dirs.items():
        directory.mkdir()
        (directory / "python").write_text("")
        if name != "making":
            os.utime(directory, (long_ago, long_ago))
    held = forkserver._lock(str(dirs["elsewhere"]))
    try:
        forkserver._remove_stale_directories(str(tmp_path))
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        dirs[name].name for name in ("elsewhere", "making", "older_onceflow")
    )


def test_a_started_server_locks_its_directory_while_its_driver_lives(monkeypatch):
    tmp = tempfile.mkdtemp(prefix="fs-")  # short: the socket's path must fit
    script = "from onceflow import forkserver\nprint(forkserver.start_server(), flush=True)\n"
    monkeypatch.setenv("TMPDIR", tmp)
    monkeypatch.setattr(forkserver, "_UNLOCKED_GRACE_S", 0.0)
    driver = subprocess.Popen(
        [sys.executable, "-c", script + "input()\n"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    launcher = driver.stdout.readline().strip()
    assert launcher.startswith(tmp), launcher
    monkeypatch.setattr(forkserver, "_alive", lambda pid: False)  # as from another namespace
    forkserver._remove_stale_directories(tmp)
    assert os.path.exists(launcher)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and its server: neither cleans up
    driver.wait(30)
    forkserver._remove_stale_directories(tmp)
    assert os.listdir(tmp) == []
