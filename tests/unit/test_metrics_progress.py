"""A query's progress in metrics, including the first epoch after a restart."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.metrics import PipelineListener, PipelineMetrics

ENDS = {"in": {"0": 120, "1": 80}}


def progress(latest: str) -> SimpleNamespace:
    source = SimpleNamespace(
        description="onceflow-kafka[in]", endOffset=json.dumps(ENDS), latestOffset=latest
    )
    state = SimpleNamespace(numRowsTotal=7, memoryUsedBytes=4096, numRowsDroppedByWatermark=0)
    return SimpleNamespace(
        batchId=3,
        numInputRows=200,
        batchDuration=900,
        durationMs={"addBatch": 700, "latestOffset": 50, "queryPlanning": 30},
        sources=[source],
        eventTime={"watermark": "2023-11-14T22:13:20.000Z"},
        stateOperators=[state],
    )


def scrape(metrics: PipelineMetrics) -> str:
    return generate_latest(metrics.registry).decode()


# What PySpark hands a listener for an offset Spark did not report: "None" from the JVM's
# progress object, "null" from its JSON. A replayed batch after a restart reports no latest.
@pytest.mark.parametrize("latest", ["None", "null"])
def test_a_replayed_epoch_without_a_latest_offset_is_recorded_whole(tmp_path, caplog, latest):
    metrics = PipelineMetrics("replayed")
    listener = PipelineListener(metrics, str(tmp_path / "ck"))
    with caplog.at_level(logging.ERROR, logger="onceflow.metrics"):
        listener.onQueryProgress(SimpleNamespace(progress=progress(latest)))
    assert "could not record query progress" not in caplog.text
    text = scrape(metrics)
    assert 'onceflow_input_records_total{app="replayed"} 200.0' in text
    assert 'onceflow_state_rows{app="replayed"} 7.0' in text
    assert listener.processed_ends == {("in", 0): 120, ("in", 1): 80}


def test_lag_is_the_latest_offset_past_the_epochs_end(tmp_path):
    metrics = PipelineMetrics("lag")
    listener = PipelineListener(metrics, str(tmp_path / "ck"))
    listener.onQueryProgress(
        SimpleNamespace(progress=progress(json.dumps({"in": {"0": 150, "1": 80}})))
    )
    text = scrape(metrics)
    assert 'onceflow_source_lag_records{app="lag",partition="0",topic="in"} 30.0' in text
    assert 'onceflow_source_lag_records{app="lag",partition="1",topic="in"} 0.0' in text


def test_offsets_lost_before_and_during_this_process_count_only_once(tmp_path):
    checkpoint = CheckpointDir(str(tmp_path / "ck"))
    checkpoint.add_source_data_loss("in", 1, 4)  # counted by the process before this one
    metrics = PipelineMetrics("lost")
    listener = PipelineListener(metrics, str(tmp_path / "ck"))
    checkpoint.add_source_data_loss("in", 1, 6)
    checkpoint.add_source_data_loss("in", 0, 2)
    listener.onQueryProgress(SimpleNamespace(progress=progress("None")))
    text = scrape(metrics)
    lost = 'onceflow_source_data_loss_offsets_total{app="lost",partition="%d",topic="in"} %.1f'
    assert lost % (1, 6) in text
    assert lost % (0, 2) in text
