"""Side records with no topic configured: left out of the transaction, counted, and
summarised in one warning per kind at the end of each pass over the epoch's records."""

from __future__ import annotations

import logging

import pyarrow as pa

from onceflow.connectors.records import LATE_REASON, side_record, staged_schema
from onceflow.connectors.sink import _Records, offset_ranges


def _staged(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=staged_schema(pa))


def test_offset_ranges_are_runs_per_partition():
    sources = ["clicks/0/9", "clicks/0/7", "clicks/1/3", "clicks/0/8", "clicks/0/12"]
    assert offset_ranges(sources) == "clicks/0 offsets 7-9, 12; clicks/1 offsets 3"


def test_offset_ranges_name_every_partition_in_order_and_count_what_is_not_listed():
    scattered = [f"clicks/2/{offset}" for offset in range(0, 30, 2)]  # 15 runs of one
    sources = ["clicks/10/5", *scattered, "clicks/0/4", "clicks/0/5"]
    assert offset_ranges(sources, listed=3) == (
        "clicks/0 offsets 4-5; clicks/2: 15 records between offsets 0 and 28; clicks/10 offsets 5"
    )


def test_offset_ranges_show_positions_of_another_form_as_they_are():
    odd = ["lookup:users", None, "t/0/\u00b2", "t/0/" + "9" * 5000]  # "²".isdigit()
    listing = offset_ranges(["clicks/0/1", "t/\u00b2/5", *odd])
    assert listing == "; ".join(["clicks/0 offsets 1", "t/\u00b2/5", *map(str, odd)])


def test_records_of_no_topic_are_left_out_and_warned_about_once_per_kind_and_pass(caplog):
    late = [side_record(None, b"k", b"v", [], f"clicks/0/{o}", LATE_REASON) for o in range(5)]
    bad = [
        side_record(None, None, b"x", [], "clicks/1/40", "value is not JSON"),
        side_record(None, None, b"y", [], "clicks/1/41", "value is not JSON"),
        side_record(None, None, b"z", [], "clicks/1/44", "field 'ts' is missing"),
    ]
    kept = side_record("clicks.late", b"k", b"v", [], "clicks/1/7", LATE_REASON)
    records = _Records([_staged([*late, *bad, kept])], batch_id=7)

    with caplog.at_level(logging.WARNING, logger="onceflow.sink"):
        published = list(records)
    first_pass = [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onceflow.sink"):
        published_again = list(records)  # a retried transaction passes over them again

    assert published == published_again == [("clicks.late", None, b"k", b"v", None)]
    assert records.counts == {"late": 1, "dropped_late": 5, "dropped_dead_letter": 3}
    assert first_pass == [
        "epoch 7: 5 late records not published, since sink.late_topic is not set (set it to "
        "keep them): clicks/0 offsets 0-4. Why: late (5, the first at clicks/0/0)",
        "epoch 7: 3 dead-letter records not published, since sink.dead_letter_topic is not "
        "set (set it to keep them): clicks/1 offsets 40-41, 44. Why: value is not JSON (2, "
        "the first at clicks/1/40); field 'ts' is missing (1, the first at clicks/1/44)",
    ]
    assert [r.getMessage() for r in caplog.records] == first_pass


def test_a_position_staged_twice_is_left_out_once():
    twice = side_record(None, b"k", b"v", [], "clicks/0/3", LATE_REASON)
    records = _Records([_staged([twice]), _staged([twice])], batch_id=1)
    assert list(records) == []
    assert records.unpublished == {"late": [("clicks/0/3", LATE_REASON)]}


def test_a_position_reads_back_as_it_was_written_and_nothing_else_reads_as_one():
    from onceflow.connectors.records import parse_position, position

    assert parse_position(position("clicks.v2", 3, 17)) == ("clicks.v2", 3, 17)
    for odd in ["lookup:users", None, "", "t/0/\u00b2", "t//5", "/0/1", "t/0/-1", "t/0"]:
        assert parse_position(odd) is None, odd
