"""Pure planning logic of the source: admission control, read tasks, option parsing."""

import itertools
import json

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from onceflow.connectors.options import OptionError, kafka_conf, parse_starting_offsets
from onceflow.connectors.source import MIN_TASK_RECORDS, OffsetRange, _admit, plan_tasks


def test_admit_takes_everything_without_a_limit():
    available = {("t", 0): 10, ("t", 1): 0}
    assert _admit(available, ReadAllAvailable()) == available


def test_admit_splits_the_limit_by_backlog_and_starves_no_partition():
    take = _admit({("t", 0): 9000, ("t", 1): 1000, ("t", 2): 1}, ReadMaxRows(100))
    assert take == {("t", 0): 89, ("t", 1): 9, ("t", 2): 1}
    assert sum(take.values()) <= 100


def test_without_parallelism_each_partition_is_a_task():
    ranges = [OffsetRange("t", 0, 0, 10), OffsetRange("t", 1, 5, 5), OffsetRange("t", 2, 3, 4)]
    tasks = plan_tasks(ranges, None)
    assert [t.ranges for t in tasks] == [(ranges[0],), (ranges[2],)]  # empty ranges skipped


@pytest.mark.parametrize("parallelism", [1, 2, 3, 4, 7, 50, 1343])
def test_parallelism_cuts_a_batch_into_equal_shares_covering_every_offset(parallelism):
    ranges = [
        OffsetRange("t", 0, 100, 1100),
        OffsetRange("t", 1, 0, 10),
        OffsetRange("u", 0, 7, 340),
    ]
    tasks = plan_tasks(ranges, parallelism, min_share=1)

    assert len(tasks) == parallelism
    sizes = [sum(r.size for r in t.ranges) for t in tasks]
    assert max(sizes) - min(sizes) <= 1
    for topic, partition, start, end in (("t", 0, 100, 1100), ("t", 1, 0, 10), ("u", 0, 7, 340)):
        pieces = sorted(
            (r.start, r.end)
            for t in tasks
            for r in t.ranges
            if (r.topic, r.partition) == (topic, partition)
        )
        assert pieces[0][0] == start and pieces[-1][1] == end
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))  # no gap, no overlap


def test_three_partitions_on_two_cores_make_two_tasks():
    ranges = [OffsetRange("t", p, 0, 33_333) for p in range(3)]
    tasks = plan_tasks(ranges, 2)
    assert [[(r.partition, r.start, r.end) for r in t.ranges] for t in tasks] == [
        [(0, 0, 33_333), (1, 0, 16_667)],
        [(1, 16_667, 33_333), (2, 0, 33_333)],
    ]
    assert plan_tasks([], 2) == []


def test_fewer_offsets_than_parallelism_make_one_task_per_offset():
    tasks = plan_tasks([OffsetRange("t", 0, 0, 3)], 8, min_share=1)
    assert [t.ranges for t in tasks] == [(OffsetRange("t", 0, i, i + 1),) for i in range(3)]


def test_a_small_epoch_is_one_task_and_a_larger_one_gets_shares_of_the_minimum():
    small = [OffsetRange("t", p, 10, 10 + MIN_TASK_RECORDS // 2 - 1) for p in range(2)]
    assert [t.ranges for t in plan_tasks(small, 2)] == [tuple(small)]
    larger = [OffsetRange("t", p, 0, MIN_TASK_RECORDS * 7 // 4) for p in range(2)]  # 3.5 shares
    sizes = [sum(r.size for r in t.ranges) for t in plan_tasks(larger, 8)]
    assert len(sizes) == 3 and min(sizes) >= MIN_TASK_RECORDS and sum(sizes) == 2 * larger[0].size


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


def test_topic_ids_are_written_in_kafkas_own_form_and_unknown_ones_are_left_out():
    from onceflow.connectors import offsets
    from onceflow.connectors.kafka_clients import _kafka_uuid

    assert _kafka_uuid(0, 1) == "AAAAAAAAAAAAAAAAAAAAAQ"
    assert _kafka_uuid(-1, -1) == "_____________________w"  # URL-safe base64, as Kafka prints
    assert _kafka_uuid(0, 0) is None  # brokers before 2.8 report no id
    logged = offsets.logged({("b", 1): 5, ("a", 0): 3}, {"b": "id-b", "a": None})
    assert json.dumps(logged) == '{"a": {"0": 3}, "b": {"1": 5}, "@topicIds": {"b": "id-b"}}'
    assert offsets.positions(logged) == {("a", 0): 3, ("b", 1): 5}
    assert offsets.topic_ids(logged) == {"b": "id-b"}


def test_starting_offsets_copied_from_the_offset_log_may_carry_topic_ids():
    raw = '{"a": {"0": 5}, "@topicIds": {"a": "AAAAAAAAAAAAAAAAAAAAAQ"}}'
    assert parse_starting_offsets(raw) == {"a": {"0": 5}}


def test_planning_looks_up_again_when_a_topic_is_recreated_meanwhile(monkeypatch):
    """Ids are read before and after the offsets: offsets of a topic recreated in between
    would belong to the new topic while the ids said the old one."""
    from onceflow.connectors import kafka_clients
    from onceflow.connectors.source import KafkaStreamReader

    answers = iter([{"t": "old"}, {"t": "new"}, {"t": "new"}, {"t": "new"}])
    monkeypatch.setattr(kafka_clients, "topic_ids", lambda conf, topics: next(answers))
    ends = iter([{("t", 0): (900, 4)}, {("t", 0): (7, 0)}])
    monkeypatch.setattr(kafka_clients, "earliest", lambda conf, tps: {tp: 0 for tp in tps})
    monkeypatch.setattr(kafka_clients, "stable_ends_and_epochs", lambda conf, tps: next(ends))
    reader = KafkaStreamReader({"kafka.bootstrap.servers": "x:1", "subscribe": "t"})
    monkeypatch.setattr(reader, "_partitions_now", lambda: [("t", 0)])
    assert reader._look_up_once() == (
        [("t", 0)],
        {"t": "new"},
        {("t", 0): 0},
        {("t", 0): 7},
        {("t", 0): 0},
    )


LEADER_EPOCH = 3


def _reader_over(monkeypatch, answers: list[dict], stable: int = 90, **options: str):
    """A reader of topic t whose broker answers topic ids from `answers`, one per call, and
    stable ends `stable` in leader epoch LEADER_EPOCH."""
    from onceflow.connectors import kafka_clients
    from onceflow.connectors.source import KafkaStreamReader

    queue = iter(answers)
    monkeypatch.setattr(kafka_clients, "topic_ids", lambda conf, topics: next(queue))
    monkeypatch.setattr(kafka_clients, "earliest", lambda conf, tps: {tp: 0 for tp in tps})
    monkeypatch.setattr(
        kafka_clients,
        "stable_ends_and_epochs",
        lambda conf, tps: {tp: (stable, LEADER_EPOCH) for tp in tps},
    )
    monkeypatch.setattr(
        kafka_clients, "high_watermarks", lambda conf, tps: dict.fromkeys(tps, stable)
    )
    reader = KafkaStreamReader(
        {"kafka.bootstrap.servers": "x:1", "subscribe": "t", "failOnDataLoss": "false", **options}
    )
    monkeypatch.setattr(reader, "_partitions_now", lambda: [("t", 0)])
    return reader


def test_a_stale_answer_with_a_retired_id_is_not_another_recreation(monkeypatch):
    """A broker whose metadata lags answers with the id the topic had before it was
    recreated: planning holds the topic for a batch, reading trusts the plan."""
    from onceflow.connectors import offsets

    start = offsets.logged({("t", 0): 30}, {"t": "B"}, {"t": ["A"]})
    reader = _reader_over(monkeypatch, [{"t": "A"}, {"t": "A"}])
    end = reader.latestOffset(start, ReadAllAvailable())
    assert offsets.positions(end) == {("t", 0): 30}  # held, not restarted from 0
    assert offsets.topic_ids(end) == {"t": "B"} and offsets.retired_ids(end) == {"t": ["A"]}

    planned = offsets.logged({("t", 0): 80}, {"t": "B"}, {"t": ["A"]})
    reader = _reader_over(monkeypatch, [{"t": "A"}])
    (task,) = reader.partitions(start, planned)
    assert task.ranges == (OffsetRange("t", 0, 30, 80),)  # read, not skipped as lost


def test_a_recreation_retires_the_old_id(monkeypatch):
    from onceflow.connectors import offsets

    start = offsets.logged({("t", 0): 30}, {"t": "A"})
    reader = _reader_over(monkeypatch, [{"t": "B"}, {"t": "B"}])
    end = reader.latestOffset(start, ReadAllAvailable())
    assert offsets.positions(end) == {("t", 0): 0}  # restarted from the earliest offset
    assert offsets.topic_ids(end) == {"t": "B"} and offsets.retired_ids(end) == {"t": ["A"]}


def test_a_log_that_seems_to_end_behind_the_query_is_asked_again_before_it_is_a_rewind(
    monkeypatch,
):
    """A leader that lost its partitions while paused answers, until it learns, from its own
    log, which ends below what the query read from the new leader meanwhile. Asked again,
    the new leader answers. (Taken at once for offsets that went backwards, the partition
    restarted from its earliest offset under failOnDataLoss=false: every record read twice;
    by default the query failed.) A log that stays behind is a rewind, as before."""
    from onceflow.connectors import kafka_clients, offsets, source

    monkeypatch.setattr(source, "BEHIND_LEADER_RETRY_S", 0.0)
    start = offsets.logged({("t", 0): 15}, {"t": "A"})
    reader = _reader_over(monkeypatch, [{"t": "A"}] * 4)  # ids before and after each look-up
    ends = iter([{("t", 0): (10, 2)}, {("t", 0): (20, 3)}])  # the paused leader's, the new one's
    monkeypatch.setattr(kafka_clients, "stable_ends_and_epochs", lambda conf, tps: next(ends))
    monkeypatch.setattr(kafka_clients, "high_watermarks", lambda conf, tps: {("t", 0): 10})
    end = reader.latestOffset(start, ReadAllAvailable())
    assert offsets.positions(end) == {("t", 0): 20}

    monkeypatch.setattr(source, "BEHIND_LEADER_WAIT_S", 0.0)
    reader = _reader_over(monkeypatch, [{"t": "A"}] * 2, stable=10)
    end = reader.latestOffset(start, ReadAllAvailable())
    assert offsets.positions(end) == {("t", 0): 0}  # restarted from the earliest offset


def test_a_log_cut_below_the_query_restarts_where_the_leader_says_it_was_cut(monkeypatch):
    """A log that stays below the checkpoint's offset under the same topic id was cut (an
    unclean leader election): below the cut it holds the records the query read, so the
    partition restarts at the cut, which the leader's answer for the logged epoch gives,
    and with the new epoch. Restarted from its earliest offset, every record below the cut
    was published twice. Where the leader cannot say, from the earliest offset."""
    from onceflow.connectors import offsets, source

    monkeypatch.setattr(source, "BEHIND_LEADER_WAIT_S", 0.0)
    asked = []

    def where_cut(conf, tp, offset, epoch):
        asked.append((tp, offset, epoch))
        return 12 if epoch is not None else None

    monkeypatch.setattr(source, "_where_cut", where_cut)
    start = offsets.logged({("t", 0): 15}, {"t": "A"}, epochs={("t", 0): 2})
    reader = _reader_over(monkeypatch, [{"t": "A"}] * 2, stable=13)
    end = reader.latestOffset(start, ReadAllAvailable())
    assert asked == [(("t", 0), 15, 2)]
    assert offsets.positions(end) == {("t", 0): 12}
    assert offsets.leader_epochs(end) == {("t", 0): LEADER_EPOCH}

    without_epoch = offsets.logged({("t", 0): 15}, {"t": "A"})
    reader = _reader_over(monkeypatch, [{"t": "A"}] * 2, stable=13)
    end = reader.latestOffset(without_epoch, ReadAllAvailable())
    assert offsets.positions(end) == {("t", 0): 0}


def test_a_stable_end_below_the_query_with_the_log_above_it_holds_the_partition(monkeypatch):
    """A stable end below the offset the query expects next, in a log that holds that offset:
    a transaction open there (an unclean election can cut its commit marker off, and the
    partition restarts at the cut, above it). The partition waits for it, not rewinds: taken
    for a rewind it restarted from its earliest offset, every record read twice."""
    from onceflow.connectors import kafka_clients, offsets, source

    monkeypatch.setattr(source, "BEHIND_LEADER_WAIT_S", 0.0)
    monkeypatch.setattr(source, "_where_cut", lambda conf, tp, offset, epoch: None)
    start = offsets.logged({("t", 0): 15}, {"t": "A"}, epochs={("t", 0): 2})
    reader = _reader_over(monkeypatch, [{"t": "A"}] * 2, stable=13)
    monkeypatch.setattr(kafka_clients, "high_watermarks", lambda conf, tps: {("t", 0): 16})
    end = reader.latestOffset(start, ReadAllAvailable())
    assert offsets.positions(end) == {("t", 0): 15}


def test_a_log_is_taken_for_cut_by_the_answer_planning_waited_on(monkeypatch, caplog):
    """Planning waits while a log ends below the query's offset, and judges by the answer it
    waited on: asked once more, a broker that is behind answered below at once, and the
    partition, held by an open transaction, was restarted from its earliest offset. A held
    partition is said once, not at every planning."""
    from onceflow.connectors import kafka_clients, offsets, source

    monkeypatch.setattr(source, "BEHIND_LEADER_RETRY_S", 0.0)
    monkeypatch.setattr(source, "_where_cut", lambda conf, tp, offset, epoch: None)
    start = offsets.logged({("t", 0): 15}, {"t": "A"}, epochs={("t", 0): 2})
    reader = _reader_over(monkeypatch, [{"t": "A"}] * 6, stable=13)
    answers = iter([10, 16, 10])  # behind (waited on), the leader's, a broker behind it
    monkeypatch.setattr(
        kafka_clients, "high_watermarks", lambda conf, tps: dict.fromkeys(tps, next(answers))
    )
    with caplog.at_level("WARNING", logger="onceflow.source"):
        assert offsets.positions(reader.latestOffset(start, ReadAllAvailable())) == {("t", 0): 15}
        monkeypatch.setattr(kafka_clients, "high_watermarks", lambda conf, tps: {("t", 0): 16})
        assert offsets.positions(reader.latestOffset(start, ReadAllAvailable())) == {("t", 0): 15}
    held = [r for r in caplog.records if "held there by an open transaction" in r.getMessage()]
    assert len(held) == 1


def test_a_log_of_a_checkpoint_without_topic_ids_is_waited_on_and_rewound(monkeypatch):
    """Offsets logged before topic ids were kept: a log below them is waited on and taken
    for cut as any other, not for one held by an open transaction."""
    from onceflow.connectors import offsets, source

    monkeypatch.setattr(source, "BEHIND_LEADER_WAIT_S", 0.0)
    monkeypatch.setattr(source, "_where_cut", lambda conf, tp, offset, epoch: 12)
    start = offsets.logged({("t", 0): 15}, {}, epochs={("t", 0): 2})
    reader = _reader_over(monkeypatch, [{"t": "A"}] * 2, stable=13)
    assert offsets.positions(reader.latestOffset(start, ReadAllAvailable())) == {("t", 0): 12}


def test_the_first_epochs_a_process_plans_take_a_share_of_the_limit_then_the_whole():
    from onceflow.connectors import offsets
    from onceflow.connectors.source import KafkaStreamReader

    reader = KafkaStreamReader({"subscribe": "t", "kafka.bootstrap.servers": "x:9092"})
    tps = [("t", 0), ("t", 1)]
    backlog = {("t", 0): 0, ("t", 1): 0}
    stable = {("t", 0): 100_000, ("t", 1): 100_000}
    reader._look_up_once = lambda: (tps, {"t": "id"}, backlog, dict(stable), {})

    def planned(start: dict, limit: int) -> dict:
        end = offsets.positions(reader.latestOffset(start, ReadMaxRows(limit)))
        return {tp: end[tp] - offsets.positions(start)[tp] for tp in tps}

    start = offsets.logged(backlog, {"t": "id"})
    idle = offsets.logged(stable, {"t": "id"})
    assert sum(planned(idle, 32_000).values()) == 0  # nothing to read yet: still cold
    assert sum(planned(start, 32_000).values()) == 2_000  # 1/16
    assert sum(planned(start, 32_000).values()) == 8_000  # 1/4
    assert sum(planned(start, 32_000).values()) == 32_000  # then the whole limit
    assert sum(planned(start, 32_000).values()) == 32_000


def test_a_limit_smaller_than_the_share_still_admits_a_record():
    from onceflow.connectors.source import ramp_limit

    assert ramp_limit(ReadMaxRows(5), 0).max_rows == 1
    assert isinstance(ramp_limit(ReadAllAvailable(), 0), ReadAllAvailable)


def test_an_input_handed_another_inputs_offsets_refuses_to_plan_or_read(monkeypatch):
    """Spark matches a query's sources to the offset log by their place in the query: after
    the sql's inputs changed places, input `persons` would get the offsets `auctions` logged
    and, finding none of its own topics there, read them all again from the earliest."""
    from onceflow.connectors import offsets
    from onceflow.connectors.errors import OnceflowError

    reader = _reader_over(monkeypatch, [{"t": "A"}] * 3, inputName="persons")
    own = reader.latestOffset(offsets.logged({("t", 0): 30}, {"t": "A"}), ReadAllAvailable())
    assert offsets.input_of(own) == "persons" and offsets.positions(own) == {("t", 0): 90}
    assert len(reader.partitions(own, own)) == 0  # its own offsets (an empty batch) are fine

    theirs = offsets.logged({("u", 0): 30}, {"u": "U"}, input_name="auctions")
    with pytest.raises(OnceflowError, match="'persons' was handed .* of input 'auctions'"):
        reader.latestOffset(theirs, ReadAllAvailable())
    with pytest.raises(OnceflowError, match="new checkpoint location"):
        reader.partitions(theirs, theirs)


def test_a_querys_only_input_writes_offsets_as_before(monkeypatch):
    from onceflow.connectors import offsets

    reader = _reader_over(monkeypatch, [{"t": "A"}, {"t": "A"}])
    end = reader.latestOffset(offsets.logged({("t", 0): 30}, {"t": "A"}), ReadAllAvailable())
    assert end == {"t": {"0": 90}, "@topicIds": {"t": "A"}, "@leaderEpochs": {"t": {"0": 3}}}


def test_a_named_input_without_initial_offsets_refuses_once_batch_0_was_planned(
    monkeypatch, tmp_path
):
    """Batch 0 is replayed from the initial offsets: an input renamed (or added) after it
    was planned must not choose new ones."""
    from onceflow.connectors.checkpoint import CheckpointDir
    from onceflow.connectors.errors import OnceflowError

    reader = _reader_over(
        monkeypatch, [{"t": "A"}] * 2, inputName="persons", checkpointLocation=str(tmp_path)
    )
    (tmp_path / "offsets").mkdir()
    (tmp_path / "offsets" / "0").write_text('v1\n{"batchWatermarkMs":0}\n{}\n')
    with pytest.raises(OnceflowError, match="'persons' has no initial offsets"):
        reader.initialOffset()
    CheckpointDir(tmp_path).save_initial_offsets({"t": {"0": 4}}, "persons")
    assert reader.initialOffset() == {"t": {"0": 4}}


def test_available_now_drains_a_partition_the_look_up_at_its_start_missed(monkeypatch):
    """`--available-now` fixes the backlog when it starts; a broker behind the others may
    leave out a partition the checkpoint reads. That partition's backlog was capped at its
    earliest offset: the run ended, exit 0, with its records unread."""
    from onceflow.connectors import kafka_clients, offsets

    reader = _reader_over(monkeypatch, [{"t": "A"}] * 4, stable=50)
    reader.prepareForTriggerAvailableNow()  # the look-up lists partition 0 only
    monkeypatch.setattr(reader, "_partitions_now", lambda: [("t", 0), ("t", 1)])
    start = offsets.logged({("t", 0): 10, ("t", 1): 10}, {"t": "A"})
    end = reader.latestOffset(start, ReadAllAvailable())
    assert offsets.positions(end) == {("t", 0): 50, ("t", 1): 50}
    more = {("t", 0): (80, 3), ("t", 1): (80, 3)}  # produced after the run started: not drained
    monkeypatch.setattr(kafka_clients, "stable_ends_and_epochs", lambda conf, tps: more)
    assert offsets.positions(reader.latestOffset(end, ReadAllAvailable())) == offsets.positions(end)


def test_an_end_that_moved_logs_its_answers_leader_epoch_and_one_that_did_not_keeps_its_own(
    monkeypatch,
):
    """KIP-320: the offset log keeps with each end offset the epoch of the leader whose log
    held it, and the batch that reads on from it validates it against that epoch. An end
    that did not move keeps the epoch it was planned in: a partition held back while its
    log was truncated (an unclean election) and grew back would otherwise be validated
    against the new log, which holds the offset again with other records."""
    from onceflow.connectors import offsets

    start = offsets.logged(
        {("t", 0): 30, ("t", 1): 90}, {"t": "A"}, epochs={("t", 0): 1, ("t", 1): 1}
    )
    reader = _reader_over(monkeypatch, [{"t": "A"}] * 3)  # stable ends 90 in epoch 3
    monkeypatch.setattr(reader, "_partitions_now", lambda: [("t", 0), ("t", 1)])
    end = reader.latestOffset(start, ReadAllAvailable())
    assert offsets.positions(end) == {("t", 0): 90, ("t", 1): 90}
    assert offsets.leader_epochs(end) == {("t", 0): LEADER_EPOCH, ("t", 1): 1}

    (task,) = reader.partitions(start, end)
    assert task.ranges == (OffsetRange("t", 0, 30, 90, 1, LEADER_EPOCH),)  # validated from 1


def test_a_share_that_starts_inside_a_range_validates_against_the_ranges_end_epoch():
    """Only the range's start is known in its start epoch; every offset up to its end was
    in the log of the end's epoch (a start epoch for an offset past that epoch's end would
    be taken for a truncation)."""
    first, second = plan_tasks([OffsetRange("t", 0, 0, 4_000, 1, 3)], 2)
    assert first.ranges == (OffsetRange("t", 0, 0, 2_000, 1, 3),)
    assert second.ranges == (OffsetRange("t", 0, 2_000, 4_000, 3, 3),)


def test_initial_offsets_in_the_log_carry_its_leader_epoch(monkeypatch):
    from onceflow.connectors import offsets

    reader = _reader_over(monkeypatch, [{"t": "A"}] * 2, startingOffsets="earliest")
    assert offsets.leader_epochs(reader.initialOffset()) == {("t", 0): LEADER_EPOCH}
    outside = {"t": {"0": 95}}  # past the log's end: in no epoch's log yet
    reader = _reader_over(monkeypatch, [{"t": "A"}] * 2, startingOffsets=json.dumps(outside))
    assert offsets.leader_epochs(reader.initialOffset()) == {}


def test_a_restarted_partition_takes_the_new_epoch_even_at_its_old_offset():
    """A partition of a recreated topic restarts at its earliest offset, which may equal the
    old one: keeping the old topic's epoch would fail every read of it ("No epoch found")."""
    from onceflow.connectors import offsets
    from onceflow.connectors.source import _end_epochs

    start = offsets.logged({("t", 0): 5}, {"t": "A"}, epochs={("t", 0): 7})
    assert _end_epochs(start, {("t", 0): 5}, {("t", 0): 0}, {("t", 0)}) == {("t", 0): 0}
    assert _end_epochs(start, {("t", 0): 5}, {("t", 0): 0}, set()) == {("t", 0): 7}


def test_starting_offsets_of_a_partition_the_look_up_does_not_list_get_no_epoch(monkeypatch):
    from onceflow.connectors import kafka_clients, offsets
    from onceflow.connectors.source import KafkaStreamReader

    monkeypatch.setattr(kafka_clients, "topic_ids", lambda conf, topics: {"t": "A"})
    monkeypatch.setattr(kafka_clients, "earliest", lambda conf, tps: {tp: 0 for tp in tps})
    monkeypatch.setattr(
        kafka_clients, "stable_ends_and_epochs", lambda conf, tps: {tp: (90, 3) for tp in tps}
    )
    spec = {"t": {"0": 5}, "gone": {"0": 7}}  # `gone` is not (no longer) in the metadata
    reader = KafkaStreamReader(
        {"kafka.bootstrap.servers": "x:1", "subscribePattern": "t|gone"}
        | {"startingOffsets": json.dumps(spec)}
    )
    monkeypatch.setattr(reader, "_partitions_now", lambda: [("t", 0)])
    chosen = reader.initialOffset()
    assert offsets.positions(chosen) == {("t", 0): 5, ("gone", 0): 7}
    assert offsets.leader_epochs(chosen) == {("t", 0): 3}
