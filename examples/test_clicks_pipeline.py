"""A pipeline test with onceflow's pytest plugin: copy it beside your own pipeline file, then
change the records and the results you expect.

`onceflow_run` runs the pipeline file with `--available-now` on fresh topics of a real Kafka
(KAFKA_BOOTSTRAP_SERVERS, a container, or onceflow's local broker) and returns what it
published; `assert_published` compares multisets, so a window published twice fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from onceflow.testing import assert_published

pytestmark = pytest.mark.integration  # a real Kafka and a real Spark session

PIPELINE = Path(__file__).resolve().parents[1] / "deploy" / "pipeline.yaml"  # yours here
T0 = 1_700_000_000_000  # a window boundary (10 s windows)


def click(user: str, ts: int, size: int = 10) -> dict:
    return {"user": user, "url": "/", "bytes": size, "ts": ts}


def test_clicks_per_user_in_ten_second_windows(onceflow_run):
    published = onceflow_run(
        PIPELINE,
        [
            click("ann", T0),
            click("ann", T0 + 4_000, size=5),
            click("bob", T0 + 9_999),
            click("ann", T0 + 10_000),
            b"{not json",
            click("zed", T0 + 60_000),  # moves the watermark past the windows above
        ],
    )
    assert_published(
        published.results,
        [
            {"key": "ann", "window_start": T0, "window_end": T0 + 10_000, "clicks": 2, "bytes": 15},
            {"key": "bob", "window_start": T0, "window_end": T0 + 10_000, "clicks": 1, "bytes": 10},
            {
                "key": "ann",
                "window_start": T0 + 10_000,
                "window_end": T0 + 20_000,
                "clicks": 1,
                "bytes": 10,
            },
        ],
    )
    assert [d.reason for d in published.dead_letters] == [
        "value is not valid JSON: Expecting property name enclosed in double quotes at character 1"
    ]
    assert published.late == []
