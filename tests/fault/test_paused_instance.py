"""A zombie: an instance paused (SIGSTOP) past its lease and its transaction timeout while a
second instance takes over the same checkpoint, then resumed. Exactly one publishes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time

import pytest

from onceflow.connectors.checkpoint import CLAIM
from onceflow.connectors.topics import read_committed
from onceflow.lease import LEASE_S
from tests.fault.test_faults import _descendants, app  # noqa: F401  (the fixture)
from tests.helpers import wait_until

pytestmark = pytest.mark.fault


def _signal_service(service, sig: int) -> None:
    """Send `sig` to every process group of the service: driver, JVM, Python workers."""
    groups = {os.getpgid(p) for p in [service.process.pid, *_descendants(service.process.pid)]}
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)


def test_a_paused_instance_stops_on_resume_and_exactly_one_publishes(app):  # noqa: F811
    pipeline = app.pipeline(windowed=False, sink={"transaction_timeout": "5s"})
    first = app.service(pipeline)
    out = app.topics["out"]
    wait_until(lambda: len(read_committed(app.bootstrap, out)) > 0, 120, "first committed epoch")
    _signal_service(first, signal.SIGSTOP)
    claim_file = app.tmp / "checkpoint" / CLAIM

    def lease_expired() -> bool:
        return time.time() - json.loads(claim_file.read_text())["heartbeat"] > LEASE_S

    wait_until(lease_expired, LEASE_S + 30, "the paused instance's lease to expire")
    second = app.service(pipeline, available_now=True)
    assert second.wait() == 0, second.tail()
    published = len(read_committed(app.bootstrap, out))

    _signal_service(first, signal.SIGCONT)
    assert first.wait(120) == 1, first.tail()
    last_line = first.tail().strip().splitlines()[-1]
    assert re.match(
        r"onceflow: (CheckpointClaimError|FencedError|TransactionTimedOutError): ", last_line
    ), first.tail()
    assert len(read_committed(app.bootstrap, out)) == published  # the zombie published nothing
    app.check_pass_through()
