import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from onceflow.local_kafka import partition_logs_loaded
from onceflow.local_process import (
    LocalServiceError,
    alive,
    exiting,
    pid_in,
    port_open,
    wait_exit,
    wait_ready,
)

# A process whose main thread has exited while another thread lives on and holds a listening
# socket: what a SIGKILLed JVM looks like while its threads tear down.
MAIN_THREAD_GONE = textwrap.dedent(
    """
    import ctypes, socket, sys, threading
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    print(listener.getsockname()[1], flush=True)
    threading.Thread(target=sys.stdin.read).start()  # lives until stdin closes
    ctypes.CDLL(None).pthread_exit(None)
    """
)


def _main_thread_gone() -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [sys.executable, "-c", MAIN_THREAD_GONE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return process, int(process.stdout.readline())


def test_a_process_whose_main_thread_is_a_zombie_is_alive_while_its_threads_hold_its_port():
    process, port = _main_thread_gone()
    try:
        assert not wait_exit(process.pid, 1.0)  # the main thread is gone; the process is not
        assert alive(process.pid) and port_open(port)
        process.stdin.close()  # the last thread ends: now the process is dead and its port free
        assert wait_exit(process.pid, 10.0)
        assert not port_open(port)
    finally:
        process.kill()
        process.wait()


def test_a_pid_file_of_a_process_still_exiting_is_waited_for_until_its_port_is_free(tmp_path):
    """What `onceflow kafka start` sees right after a node was SIGKILLed: its command line is
    gone from /proc, its threads still listen. Seen as gone at once, the port would look taken
    by another program."""
    process, port = _main_thread_gone()
    try:
        pid_file = tmp_path / "broker.pid"
        pid_file.write_text(str(process.pid))
        assert not wait_exit(process.pid, 1.0) and exiting(process.pid)
        threading.Timer(1.0, process.stdin.close).start()  # its last thread ends a second later
        assert pid_in(pid_file, b"MAIN_THREAD_GONE") is None
        assert not port_open(port)
    finally:
        process.kill()
        process.wait()


def _clock_after(seconds: float):
    """True once `seconds` have passed since it was made."""
    start = time.monotonic()
    return lambda: time.monotonic() - start >= seconds


def test_a_start_that_keeps_reporting_progress_is_waited_for_past_the_timeout(tmp_path):
    steps = iter(range(1_000_000))
    ready = _clock_after(1.5)  # three times the timeout below
    # Progress the first 1.2 s (a broker loading its partitions), then an answer at 1.5 s.
    busy = _clock_after(1.2)
    wait_ready(
        ready,
        os.getpid(),
        "Kafka",
        tmp_path / "broker.log",
        0.5,
        lambda note: None,
        lambda: "loaded all" if busy() else f"loaded {next(steps)}",
    )


def test_a_start_with_no_answer_and_no_progress_fails_naming_what_it_did_last_and_its_log(
    tmp_path,
):
    log = tmp_path / "broker.log"
    log.write_text("[2026-11-27] WARN the last thing the broker said\n")
    started = time.monotonic()
    with pytest.raises(LocalServiceError) as failure:
        wait_ready(
            lambda: False, os.getpid(), "Kafka", log, 0.5, lambda note: None, lambda: "loaded 7"
        )
    assert time.monotonic() - started < 5
    message = str(failure.value)
    assert "(loaded 7)" in message and "the last thing the broker said" in message
    assert "start it again" in message


def test_a_brokers_progress_in_loading_partition_logs_is_read_from_what_its_log_gains(tmp_path):
    log = tmp_path / "broker.log"
    log.write_text("... (9/9 completed in /old/data)\n")  # an earlier start's line
    loaded = partition_logs_loaded(log)
    assert loaded() is None
    with open(log, "a") as fh:
        fh.write("[t] INFO Completed load of Log(dir=/d/t-0) (1/4642 completed in /d)\n")
        fh.write("[t] INFO Completed load of Log(dir=/d/t-1) (2/4642 completed in /d)\n")
        fh.write("[t] INFO Completed load of Log(dir=/d/t-2) (3/46")  # still being written
        fh.flush()
        assert loaded() == "loaded 2 of 4,642 partitions' logs"
        fh.write("42 completed in /d)\n")
    assert loaded() == "loaded 3 of 4,642 partitions' logs"
    assert loaded() == "loaded 3 of 4,642 partitions' logs"
