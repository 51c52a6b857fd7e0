"""When a query is started again, and the query's failure as the one line the CLI prints."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from onceflow.config import parse
from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.connectors.errors import FencedError
from onceflow.pipeline import missed_its_start
from onceflow.runner import _python_sockets, failure, session_conf
from tests.unit.test_config import BASE, join_with, lookup_with, with_

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


def test_a_python_error_with_a_message_of_several_lines_or_notes_is_named_by_its_first():
    text = (
        "[PYTHON_DATA_SOURCE_ERROR] Failed: Traceback (most recent call last):\n"
        '  File "/x/a.py", line 3, in f\n'
        "    raise KeyError('x')\n"
        "KeyError: 'x'\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "/x/a.py", line 5, in f\n'
        "    raise ValueError('bad offset\\nfor partition 0')\n"
        "ValueError: bad offset\n"
        "for partition 0\n"
        "a note added to it\n"
        "\tat org.apache.spark.api.python.X(X.scala:1)"
    )
    assert str(failure(text)) == "[PYTHON_DATA_SOURCE_ERROR] Failed: ValueError: bad offset"


TCP = {"spark.python.unix.domain.socket.enabled": "false"}


@pytest.mark.parametrize(
    "raw, conf",
    [
        (BASE, {}),  # windows in append mode
        (with_(event_time=None, window=None), {}),  # pass-through
        (join_with(), {}),  # sql
        (with_(window={"output_mode": "update"}), TCP),  # each batch goes to the driver
        (lookup_with(), TCP),  # transformWithState
        ({**with_(window=None), "transform": "my_app:transform"}, TCP),  # it may use one
        # Without the daemon every task and commit opens one.
        (with_(spark={"conf": {"spark.python.use.daemon": "false"}}), TCP),
    ],
)
def test_pipelines_whose_epochs_open_a_socket_server_in_the_jvm_keep_sparks_tcp(raw, conf):
    """Over Unix sockets the JVM keeps each such server's path for good (deleteOnExit)."""
    assert _python_sockets(parse(raw)) == conf


def test_the_session_keeps_tcp_for_such_a_pipeline_unless_its_own_setting_says_otherwise(
    tmp_path,
):
    update = with_(window={"output_mode": "update"}, checkpoint={"location": str(tmp_path)})
    checkpoint = CheckpointDir(str(tmp_path))
    setting = "spark.python.unix.domain.socket.enabled"
    assert session_conf(parse(update), checkpoint)[setting] == "false"
    own = parse({**update, "spark": {"conf": {setting: "true"}}})
    assert session_conf(own, checkpoint)[setting] == "true"
