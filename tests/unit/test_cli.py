"""The CLI's conventions: --version, --log-level, exit codes, verify's JSON report."""

from __future__ import annotations

import json
import logging
from importlib import metadata

import pytest
import yaml

from onceflow import cli, logs
from onceflow.verify import Report


@pytest.fixture(autouse=True)
def _not_the_service_after(monkeypatch):
    """cli.main sets this process up as the service (onceflow.logs): not past the test, or a
    Spark session built later in the same pytest run would take its logging settings."""
    monkeypatch.setattr(logs, "_service_level", None)


@pytest.fixture
def pipeline_file(tmp_path):
    path = tmp_path / "pipeline.yaml"
    raw = {
        "app_id": "cli",
        "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "source": {"topics": ["in"], "format": "raw"},
        "sink": {"topic": "out"},
        "checkpoint": {"location": str(tmp_path / "ck")},
    }
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_version_names_the_installed_package(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"onceflow {metadata.version('onceflow')}"


def test_log_level_comes_from_the_option_or_the_environment(pipeline_file, monkeypatch):
    assert cli.main(["--log-level", "debug", "validate", pipeline_file]) == 0
    assert logging.getLogger().level == logging.DEBUG
    monkeypatch.setenv("ONCEFLOW_LOG_LEVEL", "WARNING")
    assert cli.main(["validate", pipeline_file]) == 0
    assert logging.getLogger().level == logging.WARNING


def test_an_unknown_log_level_in_the_environment_is_a_config_error(
    pipeline_file, monkeypatch, capsys
):
    monkeypatch.setenv("ONCEFLOW_LOG_LEVEL", "loud")
    assert cli.main(["validate", pipeline_file]) == 2
    assert "ONCEFLOW_LOG_LEVEL='loud' is not one of debug, info" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["abc", "nan", "inf", "-1", "0"])
def test_a_bad_kafka_timeout_is_refused_before_anything_starts(
    pipeline_file, monkeypatch, capsys, timeout
):
    monkeypatch.setenv("ONCEFLOW_KAFKA_TIMEOUT", timeout)
    assert cli.main(["validate", pipeline_file]) == 2
    assert "ONCEFLOW_KAFKA_TIMEOUT" in capsys.readouterr().err


def test_ctrl_c_exits_130(monkeypatch, pipeline_file):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_validate", interrupted)
    assert cli.main(["validate", pipeline_file]) == 130


def test_the_json_report_has_every_count_and_the_verdict():
    report = Report(input_records=3, output_records=4, counted=3, duplicates=["in/0/1 x2"])
    as_json = json.loads(json.dumps(report.as_json()))
    assert as_json["ok"] is False and as_json["duplicates"] == ["in/0/1 x2"]
    assert as_json["unaccounted"] == 0 and as_json["why"].startswith("1 duplicates")
    assert Report(input_records=1, counted=1).as_json()["ok"] is True
