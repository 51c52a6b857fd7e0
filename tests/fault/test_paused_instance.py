"""Paused instances (SIGSTOP): a zombie, paused past its lease and its transaction timeout
while a second instance takes over the same checkpoint, then resumed (exactly one
publishes); and a lone instance paused past its transaction timeout with a transaction open."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections import Counter

import pytest

from onceflow.connectors import kafka_clients
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
    assert second.wait() == 0, second.report()
    published = len(read_committed(app.bootstrap, out))

    _signal_service(first, signal.SIGCONT)
    assert first.wait(120) == 1, first.report()
    last_line = first.tail().strip().splitlines()[-1]
    assert re.match(
        r"onceflow: (CheckpointClaimError|FencedError|TransactionTimedOutError|"
        r"OnceflowError: this process was paused in)",
        last_line,
    ), first.report()
    assert len(read_committed(app.bootstrap, out)) == published  # the zombie published nothing
    app.check_pass_through()


def test_a_driver_paused_past_its_transaction_timeout_stops_and_its_restart_is_exactly_once(
    app,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """The whole service is paused (SIGSTOP) with epoch 3's transaction open and produced,
    until the broker aborts it on its timeout; no other instance runs. On SIGCONT the epoch
    must not become visible in any form, the run must end naming the timeout (not a raw
    librdkafka error, not "another instance fenced you"), and its restart is exactly once."""
    pipeline = app.pipeline(windowed=False, sink={"transaction_timeout": "5s"})
    out = app.topics["out"]
    held = tmp_path / "held"
    monkeypatch.setenv("ONCEFLOW_FAULT_HOLD_FILE", str(held))
    service = app.service(pipeline, fault="hold:before_kafka_commit@3")
    wait_until(lambda: held.exists() or service.process.poll() is not None, 180, "epoch 3")
    assert service.process.poll() is None, service.report()
    outputs = [(out, p) for p in range(3)]
    conf = {"bootstrap.servers": app.bootstrap}
    # The pause lands where it matters: epoch 3's records are produced, not committed.
    assert kafka_clients.stable_ends(conf, outputs) != kafka_clients.high_watermarks(conf, outputs)
    visible = Counter(m.value() for m in read_committed(app.bootstrap, out))

    _signal_service(service, signal.SIGSTOP)
    held.unlink()  # the driver commits as soon as it runs again

    def aborted_by_the_broker() -> bool:  # its abort markers end the open transaction
        return kafka_clients.stable_ends(conf, outputs) == kafka_clients.high_watermarks(
            conf, outputs
        )

    try:
        wait_until(aborted_by_the_broker, 60, "the broker to abort the paused transaction")
    finally:
        _signal_service(service, signal.SIGCONT)
    assert service.wait(120) == 1, service.report()
    last_line = service.tail().strip().splitlines()[-1]
    assert last_line.startswith("onceflow: TransactionTimedOutError: "), service.report()
    assert Counter(m.value() for m in read_committed(app.bootstrap, out)) == visible

    app.drain(pipeline)
    app.check_pass_through()
