"""The fork server's plumbing, with real processes (no Spark): a launched module runs in a
child of the server exactly as if it had been started directly, or directly when the
server cannot serve it."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from onceflow import forkserver
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def server():
    path = os.path.join(tempfile.mkdtemp(prefix="forkserver-test-"), "socket")  # short
    process = forkserver.spawn(path)
    wait_until(lambda: os.path.exists(path), 30, "the server's socket")
    yield process, path
    process.stdin.close()
    process.wait(30)


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
        pid = forkserver._ask_for_child(connection, "tests.apps.report_process", ["0"], [])
    assert pid == forkserver._REFUSED  # and the launched process runs the module itself


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


def test_directories_of_killed_drivers_are_removed(tmp_path):
    ended = subprocess.Popen(["true"])
    ended.wait()
    stale = tmp_path / f"onceflow-forkserver-{ended.pid}-abc"
    live = tmp_path / f"onceflow-forkserver-{os.getpid()}-abc"
    for directory in (stale, live):
        directory.mkdir()
        (directory / "python").write_text("")
    forkserver._remove_stale_directories(str(tmp_path))
    assert not stale.exists() and live.exists()
