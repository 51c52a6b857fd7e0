"""librdkafka's log through Python logging: a line repeated many times a second is shown once
per window, with a count of those held back."""

from __future__ import annotations

import logging

from onceflow.connectors import kafka_clients


def test_repeated_lines_are_held_back_and_counted(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(kafka_clients.time, "monotonic", lambda: now[0])
    repeats = kafka_clients._RepeatFilter()

    def line(text: str) -> logging.LogRecord | None:
        record = logging.LogRecord("onceflow.librdkafka", logging.ERROR, "", 0, text, (), None)
        return record if repeats.filter(record) else None

    refused = "FAIL [rdkafka#producer-1] Connect to ipv4#127.0.0.1:1 failed (after {}ms)"
    assert line(refused.format(0)) is not None
    assert [line(refused.format(ms)) for ms in (3, 12, 7)] == [None, None, None]
    assert line("FAIL [rdkafka#producer-1] Failed to resolve 'nohost:9092'") is not None
    now[0] += kafka_clients.REPEAT_WINDOW_S
    shown = line(refused.format(5))
    assert shown is not None
    assert shown.getMessage().endswith("(after 5ms) (3 more like it held back)")


def test_the_retry_budget_is_a_setting(monkeypatch):
    monkeypatch.setenv("ONCEFLOW_KAFKA_TIMEOUT", "7.5")
    assert kafka_clients.retry_budget_s() == 7.5
    monkeypatch.delenv("ONCEFLOW_KAFKA_TIMEOUT")
    assert kafka_clients.retry_budget_s() == kafka_clients.DEFAULT_RETRY_BUDGET_S
