import subprocess
import sys
import textwrap

from onceflow.local_process import alive, port_open, wait_exit

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


def test_a_process_whose_main_thread_is_a_zombie_is_alive_while_its_threads_hold_its_port():
    process = subprocess.Popen(
        [sys.executable, "-c", MAIN_THREAD_GONE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(process.stdout.readline())
        assert not wait_exit(process.pid, 1.0)  # the main thread is gone; the process is not
        assert alive(process.pid) and port_open(port)
        process.stdin.close()  # the last thread ends: now the process is dead and its port free
        assert wait_exit(process.pid, 10.0)
        assert not port_open(port)
    finally:
        process.kill()
        process.wait()
