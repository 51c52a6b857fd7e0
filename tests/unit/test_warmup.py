"""A warm-up that fails is logged and costs the pipeline nothing."""

from __future__ import annotations

import logging

from onceflow.warmup import start_warm_up


class BrokenSession:
    @property
    def _jvm(self):
        raise RuntimeError("the JVM is gone")


def test_a_failed_warm_up_is_logged_and_never_raised(caplog):
    with caplog.at_level(logging.INFO, logger="onceflow.run"):
        thread = start_warm_up(BrokenSession())
        thread.join(10)
    assert not thread.is_alive()
    assert "warm-up skipped (the JVM is gone)" in caplog.text
