import subprocess
import sys
import textwrap
import threading

from onceflow.local_process import alive, exiting, pid_in, port_open, wait_exit

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
