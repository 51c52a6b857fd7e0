"""Side records with no topic configured: kept out of the transaction, counted, and
summarised in one log line per kind and epoch, with every position."""

from __future__ import annotations

import logging

import pyarrow as pa

from connectors.records import LATE_REASON, side_record, staged_schema
from connectors.sink import _log_unpublished, _Records, offset_ranges


def _staged(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=staged_schema(pa))


def test_offset_ranges_are_runs_per_partition():
    sources = ["clicks/0/9", "clicks/0/7", "clicks/1/3", "clicks/0/8", "clicks/0/12"]
    assert offset_ranges(sources) == "clicks/0 offsets 7-9, 12; clicks/1 offsets 3"


def test_offset_ranges_list_the_first_runs_and_count_the_rest():
    sources = [f"clicks/0/{offset}" for offset in range(0, 30, 2)]  # 15 runs of one
    listing = offset_ranges(sources, listed=3)
    assert listing == "clicks/0 offsets 0, 2, 4; and 12 more runs"


def test_records_of_no_topic_are_kept_out_and_logged_once_per_kind(caplog):
    late = [side_record(None, b"k", b"v", [], f"clicks/0/{o}", LATE_REASON) for o in range(5)]
    bad = [
        side_record(None, None, b"x", [], "clicks/1/40", "value is not JSON"),
        side_record(None, None, b"y", [], "clicks/1/41", "value is not JSON"),
    ]
    kept = side_record("clicks.late", b"k", b"v", [], "clicks/1/7", LATE_REASON)
    records = _Records([_staged([*late, *bad, kept])])

    published = list(records)
    published_again = list(records)  # a retried transaction iterates once more

    assert published == published_again == [("clicks.late", None, b"k", b"v", None)]
    assert records.counts == {"late": 1, "dropped_late": 5, "dropped_dead_letter": 2}
    with caplog.at_level(logging.WARNING, logger="onceflow.sink"):
        _log_unpublished(records.unpublished, 7)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "epoch 7: 5 late records not published, since no late_topic is configured (set it to "
        "keep them): clicks/0 offsets 0-4; reasons: late (5)",
        "epoch 7: 2 dead-letter records not published, since no dead_letter_topic is "
        "configured (set it to keep them): clicks/1 offsets 40-41; reasons: value is not JSON (2)",
    ]


def test_a_position_staged_twice_is_kept_out_once():
    twice = side_record(None, b"k", b"v", [], "clicks/0/3", LATE_REASON)
    records = _Records([_staged([twice]), _staged([twice])])
    assert list(records) == []
    assert records.unpublished == {"late": [("clicks/0/3", LATE_REASON)]}
