"""A real Prometheus server (Debian's `prometheus` package) scraping one target, for tests.

`deploy/run-tests.sh` installs the package when it can; without it the tests that need it
skip and say how to install it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tests.helpers import free_port

INSTALL_HINT = "apt-get install prometheus (deploy/run-tests.sh does this when run as root)"


class PrometheusServer:
    """`prometheus` scraping `target` every `interval`, with its data in `workdir`."""

    def __init__(self, binary: str, workdir: Path, target: str, interval: str = "1s") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            f"global: {{scrape_interval: {interval}, evaluation_interval: {interval}}}\n"
            "scrape_configs:\n"
            f"  - job_name: onceflow\n    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    @staticmethod
    def binary() -> str | None:
        return shutil.which("prometheus")

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout}s; see {self.log}")

    def query(self, expr: str) -> float | None:
        """The value of an instant query that yields one series (None: no series)."""
        result = self._api("query", query=expr)
        if not result:
            return None
        if len(result) > 1:
            raise AssertionError(f"{expr} yields {len(result)} series; aggregate it")
        return float(result[0]["value"][1])

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list:
        return self._api("query_range", query=expr, start=start, end=end, step=step)

    def _api(self, endpoint: str, **params) -> list:
        url = f"{self.url}/api/v1/{endpoint}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        if body["status"] != "success":
            raise AssertionError(f"prometheus {endpoint} {params}: {body}")
        return body["data"]["result"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
