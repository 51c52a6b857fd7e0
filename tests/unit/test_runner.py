"""When a query is started again, and the query's failure as the one line the CLI prints."""

from __future__ import annotations

from types import SimpleNamespace

from onceflow.connectors.errors import FencedError
from onceflow.pipeline import missed_its_start
from onceflow.runner import failure

LATE = (
    "[STREAM_FAILED] Query [id = 1] terminated with exception: "
    "Python worker failed to connect back. SQLSTATE: XXKST"
)


def query(active: bool = False, progress: dict | None = None, error: str | None = LATE):
    return SimpleNamespace(
        isActive=active, lastProgress=progress, exception=lambda: error and Exception(error)
    )


def test_only_a_query_that_ended_late_before_its_first_epoch_missed_its_start():
    assert missed_its_start(query())
    assert not missed_its_start(query(active=True, error=None))  # still running
    assert not missed_its_start(query(progress={"batchId": 0}))  # had planned an epoch
    assert not missed_its_start(query(error="onceflow.FencedError: another instance"))
    assert not missed_its_start(query(error=None))  # an available-now run that ended


def test_an_onceflow_error_comes_back_typed_and_anything_else_as_its_first_line():
    typed = failure("StreamingQueryException: onceflow.FencedError: another took over\n  at x")
    assert isinstance(typed.cause, FencedError)
    assert str(failure("\n  boom\nat java.lang.Thread")) == "  boom"
