"""Finding a sink's last marker from its topic's end, and naming a sink's marker topic."""

from __future__ import annotations

import re
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from onceflow.connectors import markers
from onceflow.connectors.errors import OnceflowError
from onceflow.connectors.markers import (
    FIRST_SPAN,
    MAX_TOPIC_NAME,
    marker_topic_for,
    newest_with_key,
)


class Record:
    def __init__(self, offset: int, key: bytes) -> None:
        self.offset, self._key = offset, key

    def key(self) -> bytes:
        return self._key


class Partition:
    """A partition whose offset o holds a record with key `key_at(o)` (None: no record, a
    transaction marker); `read` notes which offsets were read."""

    def __init__(self, key_at: Callable[[int], bytes | None]) -> None:
        self.key_at = key_at
        self.read_offsets: list[int] = []

    def read(self, lo: int, hi: int) -> list[Record]:
        self.read_offsets += range(lo, hi)
        keyed = ((o, self.key_at(o)) for o in range(lo, hi))
        return [Record(o, k) for o, k in keyed if k is not None]


def test_a_sinks_own_topic_costs_one_short_read_however_long_its_history():
    # Every other offset is a transaction marker (no record), as in a sink's own topic.
    partition = Partition(lambda o: b"me" if o % 2 == 0 else None)
    found = newest_with_key(partition.read, b"me", 0, 10_000_000)
    assert found.offset == 9_999_998
    assert len(partition.read_offsets) == FIRST_SPAN


def test_the_newest_record_of_the_key_is_found_behind_other_keys():
    partition = Partition(lambda o: b"me" if o in (77, 1_234) else b"other")
    assert newest_with_key(partition.read, b"me", 0, 5_000).offset == 1_234
    # Backwards, each offset at most once: never more than one pass over the partition.
    assert len(partition.read_offsets) == len(set(partition.read_offsets)) <= 5_000
    assert min(partition.read_offsets) > 77


def test_an_absent_key_reads_each_offset_once_from_the_log_start():
    partition = Partition(lambda o: b"other")
    assert newest_with_key(partition.read, b"me", 100, 3_000) is None
    assert sorted(partition.read_offsets) == list(range(100, 3_000))


def test_an_empty_partition_is_not_read():
    partition = Partition(lambda o: b"me")
    assert newest_with_key(partition.read, b"me", 42, 42) is None
    assert partition.read_offsets == []


def test_a_marker_topic_name_is_the_transactional_id_where_kafka_allows_it():
    txn_id = "onceflow-clicks-out.v2_a"
    assert marker_topic_for(txn_id) == f"onceflow.commits.{txn_id}"


def test_an_id_kafka_does_not_allow_in_a_topic_name_gets_a_legal_distinct_name():
    names = {
        marker_topic_for(txn_id)
        for txn_id in ("my app/sink", "my app:sink", "x" * 300, "x" * 301, "ünïcode")
    }
    assert len(names) == 5
    for name in names:
        assert len(name) <= MAX_TOPIC_NAME
        assert re.fullmatch(r"[A-Za-z0-9._-]+", name)
    assert marker_topic_for("my app/sink") == marker_topic_for("my app/sink")


def test_an_end_before_the_sinks_own_acknowledged_marker_is_asked_again(monkeypatch, caplog):
    """A leader that hung past its session timeout answers, once resumed and until it learns
    it was replaced, with the ends its log had then: read up to there, a commit that landed
    would look missing and its epoch be published again."""
    tp = ("markers", 0)
    leaders = Leaders([7, 7, 9])  # the stale leader twice, then the new one
    leaders.patch(monkeypatch)
    with caplog.at_level("WARNING", logger="onceflow.sink"):
        assert markers._settled_ends({}, "markers", [tp], 60, floor={tp: 8}) == {tp: 9}
    assert leaders.asked == 3
    assert leaders.afresh == 2  # each time through a new client: the old one asks the stale
    assert [r.getMessage() for r in caplog.records] == [
        "the leader of markers [0] says it ends at offset 7, before offset 8, which a broker "
        "acknowledged to this sink: a leader that was replaced and does not know it yet; "
        "asking again, through a client that looks the leader up afresh"
    ]
    # Without a floor, the first answer is taken.
    Leaders([7]).patch(monkeypatch)
    assert markers._settled_ends({}, "markers", [tp], 60) == {tp: 7}


def test_a_log_that_stays_before_the_sinks_acknowledged_marker_stops_the_read(monkeypatch):
    Leaders([7] * 1000).patch(monkeypatch)
    with pytest.raises(OnceflowError, match="broker acknowledged this sink's record at offset 8"):
        markers._settled_ends({}, "markers", [("markers", 0)], 60, floor={("markers", 0): 8})


class Leaders:
    """The marker partition's leader as the look-ups see it: each answer gives the end of
    its log, high watermark and stable end alike (no transaction open)."""

    def __init__(self, ends: list[int]) -> None:
        self.ends, self.asked, self.clock = ends, 0, 0.0
        self.afresh = 0  # new admin clients asked for

    def ask_afresh(self, conf) -> None:
        self.afresh += 1

    def high_watermarks(self, conf, tps) -> dict:
        self.asked += 1
        return {tps[0]: self.ends[self.asked - 1]}

    def stable_ends(self, conf, tps) -> dict:
        return {tps[0]: self.ends[self.asked - 1]}

    def sleep(self, seconds: float) -> None:
        self.clock += seconds

    def patch(self, monkeypatch) -> None:
        monkeypatch.setattr(markers.kafka_clients, "high_watermarks", self.high_watermarks)
        monkeypatch.setattr(markers.kafka_clients, "stable_ends", self.stable_ends)
        monkeypatch.setattr(markers.kafka_clients, "ask_afresh", self.ask_afresh)
        clock = SimpleNamespace(sleep=self.sleep, monotonic=lambda: self.clock)
        monkeypatch.setattr(markers, "time", clock)
