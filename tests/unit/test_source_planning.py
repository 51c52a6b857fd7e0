"""Pure planning logic of the source: admission control, range splitting, option parsing."""

import itertools

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from onceflow.connectors.options import OptionError, kafka_conf, parse_starting_offsets
from onceflow.connectors.source import OffsetRange, _admit, _split


def test_admit_takes_everything_without_a_limit():
    available = {("t", 0): 10, ("t", 1): 0}
    assert _admit(available, ReadAllAvailable()) == available


def test_admit_splits_the_limit_by_backlog_and_starves_no_partition():
    take = _admit({("t", 0): 9000, ("t", 1): 1000, ("t", 2): 1}, ReadMaxRows(100))
    assert take == {("t", 0): 89, ("t", 1): 9, ("t", 2): 1}
    assert sum(take.values()) <= 100


def test_split_makes_at_least_min_partitions_contiguous_ranges():
    ranges = _split([OffsetRange("t", 0, 100, 1100), OffsetRange("t", 1, 0, 10)], 6)
    assert len(ranges) >= 6
    for p in (0, 1):
        parts = sorted((r.start, r.end) for r in ranges if r.partition == p)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    assert sum(r.size for r in ranges) == 1010


def test_starting_offsets_json_is_parsed_like_spark():
    assert parse_starting_offsets('{"a": {"0": 5, "1": -2}}') == {"a": {"0": 5, "1": -2}}
    assert parse_starting_offsets(" Earliest ") == "earliest"


@pytest.mark.parametrize(
    "raw, message",
    [
        ('{"a": ', "not valid JSON"),
        ('{"a": [1]}', "must map partition -> offset"),
        ('{"a": {"x": 1}}', "a\\[x\\] = 1"),
        ('{"a": {"0": -5}}', "a\\[0\\] = -5"),
    ],
)
def test_bad_starting_offsets_name_the_option(raw, message):
    with pytest.raises(OptionError, match="startingOffsets") as info:
        parse_starting_offsets(raw)
    assert info.match(message)


def test_kafka_conf_strips_the_prefix_and_guards_exactly_once_settings():
    conf = kafka_conf({"kafka.bootstrap.servers": "b:1", "kafka.compression.type": "lz4"}, set())
    assert conf == {"bootstrap.servers": "b:1", "compression.type": "lz4"}
    with pytest.raises(OptionError, match="kafka.isolation.level"):
        kafka_conf(
            {"kafka.bootstrap.servers": "b", "kafka.isolation.level": "x"}, {"isolation.level"}
        )
    with pytest.raises(OptionError, match="kafka.bootstrap.servers"):
        kafka_conf({}, set())
