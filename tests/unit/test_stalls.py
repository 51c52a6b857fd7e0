"""A stalled Kafka call is said in the log once while it lasts, and again when it ends."""

from __future__ import annotations

import logging

from onceflow.connectors.stalls import reported_if_stalled
from tests.helpers import wait_until


def test_a_stalled_call_is_logged_once_while_it_lasts_and_when_it_ends(caplog):
    caplog.set_level(logging.WARNING, logger="onceflow.kafka")
    with reported_if_stalled("epoch 3: the Kafka commit", after_s=0.05):
        wait_until(lambda: caplog.records, 10, "the stall to be reported")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0] == "epoch 3: the Kafka commit has waited 0.05 s so far (a broker down or hung?)"
    assert lines[1].startswith("epoch 3: the Kafka commit ended after 0.")


def test_a_call_that_ends_in_time_logs_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger="onceflow.kafka")
    with reported_if_stalled("epoch 3: the Kafka commit", after_s=10):
        pass
    assert caplog.records == []
