"""A Kafka call that takes far longer than it should is said in the log once while it lasts
(what waits, on what, since when), and again when it ends: a hung broker or a coordinator
moving stalls the pipeline, and an operator must see that from the log, not guess it from a
flat throughput graph."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("onceflow.kafka")

STALL_REPORT_S = 5.0


@contextlib.contextmanager
def reported_if_stalled(what: str, after_s: float = STALL_REPORT_S) -> Iterator[None]:
    """Log `what` once if it has not finished `after_s` seconds after it began, and how long
    it took when it finishes (or fails) after that."""
    began = time.monotonic()
    reported = threading.Event()

    def report() -> None:
        reported.set()
        log.warning("%s has waited %g s so far (a broker down or hung?)", what, after_s)

    timer = threading.Timer(after_s, report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if reported.is_set():
            log.warning("%s ended after %.1f s", what, time.monotonic() - began)
