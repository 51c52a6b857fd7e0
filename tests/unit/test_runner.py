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


def test_a_python_workers_error_is_named_by_the_line_that_raised_it_not_traceback():
    text = (
        "[PYTHON_STREAMING_DATA_SOURCE_RUNTIME_ERROR] Failed when Python streaming data "
        "source perform latestOffset: Traceback (most recent call last):\n"
        '  File "/x/source.py", line 9, in latestOffset\n'
        "    tps = self._partitions_now()\n"
        "KeyError: ('in', 0) SQLSTATE: 38000\n"
        "\tat org.apache.spark.sql.execution.python.PythonStreamingSourceRunner.x(Runner.scala:1)"
    )
    assert str(failure(text)) == (
        "[PYTHON_STREAMING_DATA_SOURCE_RUNTIME_ERROR] Failed when Python streaming data "
        "source perform latestOffset: KeyError: ('in', 0) SQLSTATE: 38000"
    )
