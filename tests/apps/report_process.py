"""Run as `-m tests.apps.report_process CODE [wait]`: prints what the process was started
with as JSON, then (with `wait`) blocks on standard input, and exits with CODE."""

import json
import os
import resource
import signal
import sys

if __name__ == "__main__":
    preloaded = sorted(m for m in ("pyarrow", "pandas") if m in sys.modules)
    report = {
        "preloaded": preloaded,
        "numpy_draw": float(__import__("numpy").random.random()),
        "encodings": [(s.encoding, s.errors) for s in (sys.stdin, sys.stdout, sys.stderr)],
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "argv": sys.argv[1:],
        "marker": os.environ.get("REPORT_MARKER"),
        "hash": hash("onceflow"),
        "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
        "umask": os.umask(0o022),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "stdin": "" if sys.argv[2:] == ["wait"] else sys.stdin.read(),
    }
    print(json.dumps(report), flush=True)
    if sys.argv[2:] == ["wait"]:
        sys.stdin.read()
    sys.exit(int(sys.argv[1]))
