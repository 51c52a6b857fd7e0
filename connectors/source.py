"""The Kafka source: every micro-batch is an offset range per topic-partition.

Spark writes the end-offset map that `latestOffset` returns to its offset log before the batch
runs, so the batch boundary *is* the checkpoint barrier, aligned to Kafka offsets. Executors
then read exactly `[start, end)` of each partition with `isolation.level=read_committed`.

Offsets are kept as Spark's Kafka source keeps them, {"topic": {"partition": offset}}, with
each topic's id beside them (see `offsets`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from . import kafka_clients, offsets
from .checkpoint import DEFAULT_SOURCE, CheckpointDir
from .errors import DataLossError, OnceflowError, OptionError
from .options import (
    RESERVED_CONSUMER_KEYS,
    get_bool,
    get_positive_int,
    kafka_conf,
    parse_starting_offsets,
    parse_topic_list,
)
from .records import SOURCE_COLUMNS, headers_type

log = logging.getLogger("onceflow.source")

Offsets = dict[str, dict[str, int]]
TP = offsets.TP
EARLIEST, LATEST = -2, -1  # as in Spark's startingOffsets JSON
# One Arrow batch per librdkafka prefetch queue's worth of messages.
ARROW_BATCH_ROWS = kafka_clients.PREFETCH_MESSAGES
READ_STALL_TIMEOUT_S = 120.0
# A read that got no record of its range for this long, though the plan saw them committed,
# is likely fetching from a leader that hangs; it goes on with a new consumer (see
# _from_a_new_consumer), and again after twice as long each time while it still gets none,
# so that a slow broker or a slow new connection still gets time to answer.
FETCH_STALL_S = 2.0
FETCH_RENEW_MAX_S = 16.0
# How long a read waits for a leader whose log holds its range before the range counts as
# lost, and how often it asks again meanwhile (see _out_of_range).
BEHIND_LEADER_WAIT_S = 30.0
BEHIND_LEADER_RETRY_S = 0.5
LOOKUP_ATTEMPTS = 3
SEEK_WAIT_S = 2.0  # for a consumer to take its assignment (see _fetch_from)
# The first epochs a process plans take 1/16, then 1/4 of maxOffsetsPerTrigger, then all of it.
RAMP_SHARES = (16, 4)
MIN_TASK_RECORDS = 1_000  # an epoch's offsets per read task at least (see plan_tasks)


@dataclass(frozen=True)
class OffsetRange:
    """`[start, end)` of one topic-partition, and the leader epochs the offset log has for
    `start` and `end` (None: not known, nothing validated): a read validates `start`
    against `start_epoch` before it takes a record (see `_fetch_from`)."""

    topic: str
    partition: int
    start: int
    end: int
    start_epoch: int | None = None
    end_epoch: int | None = None

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ReadTask(InputPartition):
    """One Spark task's work: offset ranges, read one after the other."""

    ranges: tuple[OffsetRange, ...]


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans offset-range batches on the driver and reads them on executors."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.conf = kafka_conf(options, RESERVED_CONSUMER_KEYS)
        self.topics = parse_topic_list(options)
        pattern = options.get("subscribePattern")
        if bool(self.topics) == bool(pattern):
            raise OptionError("set exactly one of the options 'subscribe' or 'subscribePattern'")
        try:
            self.pattern = re.compile(pattern) if pattern else None
        except re.error as exc:
            raise OptionError(f"option 'subscribePattern' is not a valid regex: {exc}") from None
        self.starting = parse_starting_offsets(options.get("startingOffsets", "latest"))
        self.max_offsets = get_positive_int(options, "maxOffsetsPerTrigger")
        self.parallelism = get_positive_int(options, "parallelism")
        self.fail_on_data_loss = get_bool(options, "failOnDataLoss", True)
        self.group_id = options.get("group.id") or options.get("groupId")
        # onceflow's pipelines pass the query's checkpoint: the initial offsets are kept there,
        # and offsets lost with failOnDataLoss=false are counted there for the metrics.
        location = options.get("checkpointLocation")
        self.checkpoint = CheckpointDir(location) if location else None
        # A named input (of `sources:`) keeps its own initial offsets and writes its name into
        # its offsets (see offsets.INPUT); a pipeline's one `source:` has no name option.
        self._tag = options.get("inputName")
        self.input_name = self._tag or DEFAULT_SOURCE
        self._latest: Offsets | None = None
        self._epochs_planned = 0  # epochs with records this process planned
        self._held: set[TP] = set()  # partitions an open transaction holds (_warn_held)
        self._available_now_target: dict[tuple[str, int], int] | None = None

    # Clients live in module-level caches (kafka_clients), never on the instance: the reader
    # is pickled to executors for every batch.

    # -- planning (driver) ---------------------------------------------------------------

    def _partitions_now(self) -> list[tuple[str, int]]:
        metadata = kafka_clients.metadata(self.conf)
        if self.pattern is not None:
            topics = sorted(
                t for t in metadata.topics if not t.startswith("__") and self.pattern.fullmatch(t)
            )
        else:
            missing = [t for t in self.topics if t not in metadata.topics]
            if missing:
                raise OptionError(
                    f"option 'subscribe': topic(s) {', '.join(missing)} do not exist on "
                    f"{self.conf['bootstrap.servers']}; create them first"
                )
            topics = self.topics
        return [(t, p) for t in topics for p in sorted(metadata.topics[t].partitions)]

    def initialOffset(self) -> dict:
        """Where the query starts, chosen once: Spark asks again when it replays batch 0, and
        "latest" (or "earliest", after retention) would answer differently."""
        if self.checkpoint is not None and (
            chosen := self.checkpoint.initial_offsets(self.input_name)
        ):
            return chosen
        if self._tag is not None and self.checkpoint is not None and self.checkpoint.planned(0):
            # Batch 0 is replayed from these offsets: choosing them anew (for an input that
            # was renamed, or added) could skip or repeat records of its first run.
            raise OnceflowError(
                f"input {self.input_name!r} has no initial offsets in checkpoint "
                f"{self.checkpoint.location}, which planned its first batch already: the input "
                "was renamed or added since. Restore its name, or start with a new checkpoint "
                "location."
            )
        tps, ids, earliest, stable, epochs = self._look_up_once()
        if isinstance(self.starting, dict):
            starts = self._specific_offsets(tps, self.starting)
        elif self.starting == "earliest":
            starts = earliest
        else:
            starts = stable
        # Each offset from the earliest to the stable end was in the log of the leader's epoch.
        in_log = {
            tp: epochs[tp]
            for tp, o in starts.items()
            if tp in stable and earliest[tp] <= o <= stable[tp]
        }
        chosen = offsets.logged(starts, ids, input_name=self._tag, epochs=in_log)
        if self.checkpoint is not None:
            self.checkpoint.save_initial_offsets(chosen, self.input_name)
        return chosen

    def _specific_offsets(self, tps: list[TP], spec: Offsets) -> dict[TP, int]:
        given = {(t, int(p)) for t, parts in spec.items() for p in parts}
        if self.pattern is None and given != set(tps):
            missing = sorted(set(tps) - given)
            unknown = sorted(given - set(tps))
            raise OptionError(
                "option 'startingOffsets' must name every partition of the subscribed topics; "
                f"missing {missing}, unknown {unknown}"
            )
        earliest = kafka_clients.earliest(self.conf, sorted(given))
        latest = kafka_clients.stable_ends(self.conf, sorted(given))
        chosen = {}
        for t, p in sorted(given):
            offset = spec[t][str(p)]
            special = {EARLIEST: earliest[(t, p)], LATEST: latest[(t, p)]}
            chosen[(t, p)] = special.get(offset, offset)
        return chosen

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_offsets) if self.max_offsets else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The end of the next batch: never past the last stable offset, bounded by `limit`.

        Spark logs this end before the batch runs and makes it the next batch's start, so
        every range's start is in the offset log: a partition that appears is added here
        with its earliest offset as its end (nothing to read in this batch), and one whose
        offsets went backwards, or whose topic was recreated, is restarted the same way.
        """
        self._check_input(start)
        starts, ids = offsets.positions(start), offsets.topic_ids(start)
        tps, ids_now, earliest, stable, epochs, below = self._look_up(starts, ids)
        retired = offsets.retired_ids(start)
        stale = {t for t, i in ids_now.items() if i in retired.get(t, [])}
        if stale:  # held at their offsets this batch, as unlisted partitions are
            log.warning("a broker answered with a retired id of topic(s) %s", sorted(stale))
            tps = [tp for tp in tps if tp[0] not in stale]
            ids_now = {t: i for t, i in ids_now.items() if t not in stale}
        changed = {t for t, i in ids.items() if ids_now.get(t) not in (None, i)}
        recreated = self._check_recreated(starts, changed, ids, ids_now, earliest, stable)
        unlisted = self._keep_unlisted(starts, set(tps))
        below = {tp: e for tp, e in below.items() if tp in starts}  # not recreated, listed
        rewound = self._check_rewound(starts, earliest, below, offsets.leader_epochs(start))
        self._warn_held(starts, stable, below)
        self._check_retention(starts, earliest)
        if self._available_now_target is not None:
            target = self._available_now_target
            for tp in tps:  # one the look-up at the start left out: as of now
                target.setdefault(tp, stable[tp])
            stable = {tp: min(o, target.get(tp, earliest[tp])) for tp, o in stable.items()}
        available = {tp: max(0, stable[tp] - o) for tp, o in starts.items() if tp not in rewound}
        take = _admit(available, ramp_limit(limit, self._epochs_planned))
        self._epochs_planned += any(take.values())
        end = {tp: starts[tp] + n for tp, n in take.items()}
        joined = [tp for tp in tps if tp not in starts and tp not in recreated]
        if joined:
            log.info("new partitions join from their earliest offset: %s", joined)
        end |= {tp: earliest[tp] for tp in [*joined, *recreated]} | rewound | unlisted
        self._latest = offsets.logged(stable)
        read_topics = {t for t, _ in end}
        retired |= {t: [*retired.get(t, []), ids[t]] for t in changed}
        return offsets.logged(
            end,
            {t: i for t, i in (ids | ids_now).items() if t in read_topics},
            {t: r for t, r in retired.items() if t in read_topics},
            self._tag,
            _end_epochs(start, end, epochs, {*joined, *recreated, *rewound}),
        )

    def _check_input(self, *logged: dict) -> None:
        """Spark gives each source the offsets at its place in the query: a query whose
        inputs changed places would read one input from another's offsets (from the earliest
        offsets of its own topics, a replay of everything)."""
        for offset in logged:
            found = offsets.input_of(offset)
            if found is not None and found != self.input_name:
                raise OnceflowError(
                    f"input {self.input_name!r} was handed the checkpoint's offsets of input "
                    f"{found!r}: Spark matches a query's inputs to its checkpoint by their place "
                    "in the query, and they moved (another order in the sql's FROM and JOINs) "
                    "or were renamed. Restore the query and its input names as they were, or "
                    "start it with a new checkpoint location."
                )

    def _look_up(
        self, starts: dict[TP, int], ids: dict[str, str]
    ) -> tuple[list[TP], dict, dict[TP, int], dict[TP, int], dict[TP, int | None], dict]:
        """What `_look_up_once` answers, and the logs that end below the offset the query
        expects next under the same topic id (`_logs_ending_below`), asked again while there
        are any, up to BEHIND_LEADER_WAIT_S: that is how a leader that lost its partitions
        while paused answers until it learns (see `_out_of_range`). Only a log that stays
        behind is taken for offsets that went backwards (`_check_rewound`), by the last
        answer waited on: asked once more, a broker that is behind could skip the wait."""
        since = time.monotonic()
        while True:
            tps, ids_now, earliest, stable, epochs = self._look_up_once()
            same = {
                tp: o for tp, o in starts.items() if ids.get(tp[0]) in (None, ids_now.get(tp[0]))
            }
            behind = self._logs_ending_below(same, stable)
            waited = time.monotonic() - since
            if not behind or waited >= BEHIND_LEADER_WAIT_S:
                return tps, ids_now, earliest, stable, epochs, behind
            if waited < BEHIND_LEADER_RETRY_S:  # said once per wait
                log.warning(
                    "the log of %s ends below the offset the query expects next (%s); asking "
                    "again for up to %.0f s before taking it for offsets that went backwards",
                    ", ".join(f"{t}[{p}] at {end}" for (t, p), end in behind.items()),
                    ", ".join(str(starts[tp]) for tp in behind),
                    BEHIND_LEADER_WAIT_S,
                )
            time.sleep(BEHIND_LEADER_RETRY_S)

    def _logs_ending_below(self, starts: dict[TP, int], stable: dict[TP, int]) -> dict[TP, int]:
        """The partitions whose log ends below the offset the query expects next, and where
        each ends. A stable end below it may be a transaction still open there (one whose
        commit marker an unclean election cut off, see `_check_rewound`), which holds the
        partition, not rewinds it: the end of the log, open transactions included, decides.
        Asked only for partitions whose stable end is below."""
        below = sorted(tp for tp, offset in starts.items() if stable.get(tp, offset) < offset)
        if not below:
            return {}
        ends = kafka_clients.high_watermarks(self.conf, below)
        return {tp: ends[tp] for tp in below if ends.get(tp, starts[tp]) < starts[tp]}

    def _look_up_once(
        self,
    ) -> tuple[list[TP], dict, dict[TP, int], dict[TP, int], dict[TP, int | None]]:
        """The partitions, topic ids, earliest and stable offsets to plan with, and the leader
        epoch each stable offset was answered in, all of one incarnation of each topic: the
        ids are read before and after the offsets, and all again if a topic was recreated in
        between. A topic deleted since the metadata answer is left out (its partitions are
        held at their offsets, as unlisted ones are)."""
        for attempt in range(LOOKUP_ATTEMPTS):
            time.sleep(0.5 * attempt)
            tps = self._partitions_now()
            ids = kafka_clients.topic_ids(self.conf, {t for t, _ in tps})
            tps = [tp for tp in tps if tp[0] in ids]
            earliest = kafka_clients.earliest(self.conf, tps)
            listed = kafka_clients.stable_ends_and_epochs(self.conf, tps)
            again = kafka_clients.topic_ids(self.conf, ids)
            if again == ids:
                stable = {tp: offset for tp, (offset, _) in listed.items()}
                return tps, ids, earliest, stable, {tp: e for tp, (_, e) in listed.items()}
            moved = sorted(t for t in ids if again.get(t) != ids[t])
            log.warning("the ids of topic(s) %s changed while the batch was planned", moved)
        raise OnceflowError(
            f"the ids of topic(s) {', '.join(moved)} changed between two answers "
            f"{LOOKUP_ATTEMPTS} times in a row (being recreated, or brokers disagree): the "
            "query stops rather than plan a batch over two versions of a topic. Start it again "
            "when the topics are stable."
        )

    def _data_loss(self, tp: tuple[str, int], what: str, fix: str, lost: int) -> None:
        _data_loss(tp, what, fix, lost, self.fail_on_data_loss, self.checkpoint)

    def _check_recreated(
        self, starts: dict, changed: set, ids: dict, ids_now: dict, earliest: dict, stable: dict
    ) -> list:
        """Partitions of topics deleted and created again since the last batch: the topics
        in `changed`, whose id changed. Their offsets start over, so the checkpoint's offset
        means nothing in the new topic, even when it already holds more records. They are
        taken out of `starts`; returned are those the new topic still has, to restart from
        their earliest offset."""
        restarted = []
        for tp, offset in sorted(starts.items()):
            if tp[0] not in changed:
                continue
            old, new = ids[tp[0]], ids_now[tp[0]]
            del starts[tp]
            what = (
                f"the topic was deleted and created again (topic id {old} is now {new}): the "
                f"query expected offset {offset} next of the old topic; "
            )
            if tp in stable:
                self._data_loss(
                    tp,
                    what + f"the new one holds offsets [{earliest[tp]}, {stable[tp]}).",
                    f"restart the partition from its earliest offset {earliest[tp]}",
                    max(0, offset - earliest[tp]),
                )
                restarted.append(tp)
            else:
                self._data_loss(
                    tp, what + f"the new one has no partition {tp[1]}.", "drop it", offset
                )
        return restarted

    def _keep_unlisted(self, starts: dict[tuple[str, int], int], now: set) -> dict:
        """Partitions the query reads that this metadata answer does not list: a broker whose
        metadata lags, or a topic recreated with fewer partitions. They stay at their offset
        (forgetting them would re-read them from their earliest offset when they are listed
        again); if one returns with its log below that offset, that is caught as a rewind."""
        unlisted = {tp: o for tp, o in starts.items() if tp not in now}
        for tp, offset in sorted(unlisted.items()):
            log.warning(
                "topic %s partition %d is not in the broker's metadata; it stays at offset %d "
                "until it is listed again",
                *tp,
                offset,
            )
            del starts[tp]
        return unlisted

    def _warn_held(self, starts: dict, stable: dict, below: dict) -> None:
        """Say, once, which partitions wait on an open transaction below their offset: one
        whose commit marker a cut took is complete for its coordinator and never ends by
        itself, and the lag shows nothing (it counts from the stable end)."""
        held = {tp for tp, o in starts.items() if stable[tp] < o and tp not in below}
        if held - self._held:
            log.warning(
                "%s: the stable end is below the offset the query expects next, held there by "
                "an open transaction; the partition waits for it. A transaction whose commit "
                "marker an unclean leader election cut off never ends by itself: find and "
                "abort it with kafka-transactions.sh (find-hanging, abort)",
                ", ".join(
                    f"{t}[{p}] at {stable[(t, p)]} < {starts[(t, p)]}" for t, p in sorted(held)
                ),
            )
        self._held = held

    def _check_rewound(
        self, starts: dict, earliest: dict, below: dict, epochs: dict[TP, int]
    ) -> dict[TP, int]:
        """Partitions whose offsets went backwards: the broker's log ends below the offset
        the query expects next (an unclean leader election, a broker that lost its data), and
        the offset each restarts from. A leader elected without the last records holds, below
        where its log was cut, the records the query read: the partition restarts there, so
        each record written since is published once (`_where_cut`). Where that is not known,
        from its earliest offset. The cut may lie above the stable end, in a transaction whose
        commit marker was cut off: the partition waits there (`_logs_ending_below`)."""
        restarts = {}
        for tp, end in sorted(below.items()):
            offset = starts[tp]
            what = (
                f"the query expected offset {offset} next, but the broker holds offsets "
                f"[{earliest[tp]}, {end}) only"
            )
            cut = _where_cut(self.conf, tp, offset, epochs.get(tp))
            if cut is None:
                restarts[tp] = earliest[tp]
                what += ": the topic was recreated or the broker lost data."
                lost = offset - earliest[tp]
            else:
                restarts[tp] = max(cut, earliest[tp])
                what += (
                    f": its leader's log was cut at offset {cut} (an unclean leader election or "
                    "a broker that lost its data). The query read the records below the cut "
                    f"before; those the log holds from {cut} on were written since."
                )
                lost = restarts[tp] - cut  # deleted since (retention)
            fix = f"restart the partition from offset {restarts[tp]}"
            self._data_loss(tp, what, fix, lost)
        return restarts

    def _check_retention(self, starts: dict, earliest: dict) -> None:
        for tp, offset in starts.items():
            if earliest[tp] > offset:
                self._data_loss(
                    tp,
                    f"the query expected offset {offset} next, but the earliest available "
                    f"offset is {earliest[tp]}; {earliest[tp] - offset} offsets were deleted "
                    "(retention or compaction) before they were read.",
                    f"skip ahead to {earliest[tp]}",
                    0,  # counted by the task that finds them gone (read_range)
                )
                starts[tp] = earliest[tp]

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the backlog to drain: what is readable now, and nothing produced later. A
        partition this look-up misses (a broker whose metadata is behind, a partition added
        meanwhile) is drained to where it ends when planning first sees it."""
        tps = self._partitions_now()
        self._available_now_target = kafka_clients.stable_ends(self.conf, tps)

    def reportLatestOffset(self) -> dict | None:
        return self._latest

    def partitions(self, start: dict, end: dict) -> list[ReadTask]:
        """The batch's ranges, from the offset log alone, so a replay reads what the first run
        read. A partition missing from `start` joined in this batch with its start as its
        end; an end below its start, or a new topic id in `end`, restarts the partition:
        none of these reads anything now."""
        self._check_input(start, end)
        starts = offsets.positions(start)
        start_ids, end_ids = offsets.topic_ids(start), offsets.topic_ids(end)
        start_epochs, end_epochs = offsets.leader_epochs(start), offsets.leader_epochs(end)
        ranges = []
        for (t, p), e in offsets.positions(end).items():
            old, new = start_ids.get(t), end_ids.get(t)
            restarted = old is not None and new is not None and old != new
            first = e if restarted else starts.get((t, p), e)
            ranges.append(
                OffsetRange(t, p, first, e, start_epochs.get((t, p)), end_epochs.get((t, p)))
            )
        retired = offsets.retired_ids(end)
        return plan_tasks(self._of_logged_topics(ranges, end_ids, retired), self.parallelism)

    def _of_logged_topics(
        self, ranges: list[OffsetRange], logged: dict, retired: dict
    ) -> list[OffsetRange]:
        """The ranges whose topic still has the id the batch was planned with. A topic
        recreated since (while the app was down, before this batch is replayed) holds other
        records at those offsets: its ranges are data loss, skipped with failOnDataLoss=false,
        and the next batch restarts it from its earliest offset."""
        planned = {r.topic for r in ranges if r.size > 0 and logged.get(r.topic)}
        ids_now = kafka_clients.topic_ids(self.conf, planned)
        recreated = {
            t
            for t in planned
            if ids_now.get(t) not in (None, logged[t], *retired.get(t, []))  # a new id
        }
        for r in ranges:
            if r.topic in recreated and r.size > 0:
                self._data_loss(
                    (r.topic, r.partition),
                    f"the topic was deleted and created again (topic id {logged[r.topic]} is "
                    f"now {ids_now[r.topic]}) after this batch planned to read offsets "
                    f"[{r.start}, {r.end}) of the old topic.",
                    "skip the range (the next batch restarts the partition from its earliest "
                    "offset)",
                    0,  # counted once, by the next batch that restarts the partition
                )
        return [r for r in ranges if r.topic not in recreated]

    def commit(self, end: dict) -> None:
        """Publish progress to the consumer group so standard lag tooling sees it."""
        if self.group_id:
            kafka_clients.commit_group_offsets(self.conf, self.group_id, offsets.positions(end))

    # -- reading (executors) -------------------------------------------------------------

    def read(self, partition: ReadTask) -> Iterator:
        for offset_range in partition.ranges:
            yield from read_range(self.conf, offset_range, self.fail_on_data_loss, self.checkpoint)


def read_range(
    conf: dict[str, str],
    r: OffsetRange,
    fail_on_data_loss: bool,
    checkpoint: CheckpointDir | None = None,
) -> Iterator:
    """Arrow record batches of every committed record in `[r.start, r.end)`, and no other.

    Done when the consumer *position* reaches `r.end`: transaction markers and aborted
    records leave offset gaps, so waiting for a record at `end - 1` could wait forever.
    Offsets of the range that are gone (deleted while the batch ran, or cut off a log that
    was truncated) are data loss: they fail the task, or (failOnDataLoss=false) are counted
    and skipped, never replaced.
    """
    import pyarrow as pa
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    consumer = kafka_clients.range_consumer(conf)
    tp = TopicPartition(r.topic, r.partition, r.start)
    refused = not _fetch_from(consumer, r, r.start, _epoch_at(r, r.start))
    columns = _Columns()
    position = r.start
    last_progress = time.monotonic()
    renew_after = renew_wait = FETCH_STALL_S  # seconds without progress
    out_of_range_since: float | None = None  # when a broker first said `position` is not in it
    try:
        while position < r.end:
            before = position
            messages = consumer.consume(
                min(ARROW_BATCH_ROWS, r.end - position), kafka_clients.CONSUME_WAIT_S
            )
            for msg in messages:
                err = msg.error()
                if err is None:
                    if refused:  # the seek that asks the leader: now that records come
                        refused = not _ask_leader(consumer, r, position, _epoch_at(r, position))
                        break  # this record and those fetched with it are fetched again
                    if position <= msg.offset() < r.end:
                        if _written_after_planning(msg, r):
                            position = _truncated(
                                r, msg.offset(), _rewritten(msg, r), fail_on_data_loss, checkpoint
                            )
                            break
                        columns.add(msg)
                        position = msg.offset() + 1
                elif err.code() == KafkaError._AUTO_OFFSET_RESET and _log_truncated(msg):
                    if _before_this_batch(r, position):
                        # The batch was planned on the new log: what is lost lies below its
                        # start. Fails, or is counted and the range read from the new log.
                        _truncated_before(r, err, fail_on_data_loss, checkpoint)
                        r = dataclasses.replace(r, start_epoch=r.end_epoch)
                        refused = not _fetch_from(consumer, r, position, r.end_epoch)
                        break
                    how = f"librdkafka: {err.str()}"
                    position = _truncated(r, position, how, fail_on_data_loss, checkpoint)
                    break
                elif err.code() == KafkaError._AUTO_OFFSET_RESET:
                    out_of_range_since = out_of_range_since or time.monotonic()
                    position = _out_of_range(
                        consumer,
                        r,
                        position,
                        fail_on_data_loss,
                        checkpoint,
                        out_of_range_since,
                        msg,
                    )
                    break
                elif err.code() == KafkaError._PARTITION_EOF:
                    # Every record before the partition's stable end came before this event.
                    # Aborted records just before another producer's open transaction move
                    # the position no further: none is delivered, and their abort marker
                    # lies past the stable end.
                    position = max(position, msg.offset())
                else:
                    raise KafkaException(err)
            else:  # past gaps (transaction markers, aborted records) the position says more
                position = max(position, consumer.position([tp])[0].offset)
            stalled = time.monotonic() - last_progress
            if position > before:
                last_progress, out_of_range_since = time.monotonic(), None
                renew_after = renew_wait = FETCH_STALL_S
            elif stalled > READ_STALL_TIMEOUT_S:
                raise KafkaException(
                    f"reading {r.topic}[{r.partition}] made no progress for "
                    f"{READ_STALL_TIMEOUT_S:.0f}s at offset {position} (range ends at {r.end}); "
                    "is the broker reachable?"
                )
            elif stalled >= renew_after:
                first = renew_wait == FETCH_STALL_S
                consumer = _from_a_new_consumer(conf, consumer, r, position, stalled, first)
                renew_wait = min(2 * renew_wait, FETCH_RENEW_MAX_S)
                renew_after = stalled + renew_wait
            if len(columns) >= ARROW_BATCH_ROWS:
                yield columns.to_arrow(pa)
                columns = _Columns()
        if len(columns):
            yield columns.to_arrow(pa)
    finally:
        consumer.unassign()


def _from_a_new_consumer(
    conf: dict[str, str], stale, r: OffsetRange, position: int, stalled: float, first: bool
):
    """A new consumer, assigned at `position`, in place of one whose fetches brought nothing.

    A fetch sent to a leader that hangs (SIGSTOP, a frozen host) waits for librdkafka's
    request timeout, and the metadata request that would name the new leader goes to the
    same hung broker (librdkafka asks the broker it last sent to). Kafka moves a silent
    node's partitions after its session timeout; a new consumer learns that from a broker
    that answers. A slow broker costs only a reconnection. Said once per stall (`first`)."""

    (log.warning if first else log.info)(
        "reading %s[%d]: no record for %.1f s at offset %d, though the batch was planned with "
        "committed records up to %d; its leader may hang (Kafka moves a silent broker's "
        "partitions within its session timeout): reading on with a new consumer",
        r.topic,
        r.partition,
        stalled,
        position,
        r.end,
    )
    consumer = kafka_clients.renewed_range_consumer(conf, stale)
    _fetch_from(consumer, r, position, _epoch_at(r, position))
    return consumer


def _epoch_at(r: OffsetRange, position: int) -> int | None:
    """The leader epoch whose log held `position` when the batch was planned: `start_epoch`
    is for the range's start alone; every offset up to its end was in the log of `end_epoch`
    (that of the stable end it was planned from). None: not known."""
    if position == r.start and r.start_epoch is not None:
        return r.start_epoch
    return r.end_epoch


def _fetch_from(
    consumer, r: OffsetRange, position: int, epoch: int | None, wait: float = SEEK_WAIT_S
) -> bool:
    """Have `consumer` fetch `r`'s partition from `position`, once its leader has said where
    its log of leader epoch `epoch` ends (KIP-320; None: ask nothing): a log that ends below
    `position` was truncated since the batch was planned (or since the last one, for its
    start), though it may have grown back past it with other records. librdkafka reports
    that as `_log_truncated`. False if the leader could not be asked (see `_ask_leader`)."""
    from confluent_kafka import TopicPartition

    consumer.assign([TopicPartition(r.topic, r.partition, position)])
    return epoch is None or _ask_leader(consumer, r, position, epoch, wait)


def _ask_leader(
    consumer, r: OffsetRange, position: int, epoch: int, wait: float = SEEK_WAIT_S
) -> bool:
    """Seek to `position` in `epoch`: librdkafka validates on a seek only, never on an
    assignment, and refuses a seek until the assignment has reached the partition (_STATE;
    _PREV_IN_PROGRESS while an earlier read's unassignment ends), so it is asked again
    meanwhile. What was fetched before the seek is dropped (its op version is older). A fetch
    that failed first (an offset out of range) leaves the partition stopped, refusing every
    seek until its error is handled: after `wait` seconds this returns False, and the read
    meets that error, or asks again at its first record."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    deadline = time.monotonic() + wait
    while True:
        try:
            consumer.seek(TopicPartition(r.topic, r.partition, position, leader_epoch=epoch))
            return True
        except KafkaException as exc:
            if exc.args[0].code() not in (KafkaError._STATE, KafkaError._PREV_IN_PROGRESS):
                raise
            if time.monotonic() > deadline:
                log.info(
                    "reading %s[%d]: the consumer refused to seek to offset %d for %.0f s (%s); "
                    "the leader is asked about epoch %d once the partition fetches",
                    r.topic,
                    r.partition,
                    position,
                    wait,
                    exc.args[0].str(),
                    epoch,
                )
                return False
            time.sleep(0.001)


def _written_after_planning(msg, r: OffsetRange) -> bool:
    """Whether a record of the range was written in a leader epoch newer than the one its
    batch was planned in: every offset below the range's end was written by then, so this
    one was written again after its log was truncated (librdkafka validates its position
    only on a seek or a leader change, and may have fetched the new records first)."""
    epoch = msg.leader_epoch()
    return r.end_epoch is not None and epoch is not None and epoch > r.end_epoch


def _rewritten(msg, r: OffsetRange) -> str:
    return (
        f"offset {msg.offset()} holds a record written in leader epoch {msg.leader_epoch()}, "
        f"after the batch was planned in epoch {r.end_epoch}"
    )


def _before_this_batch(r: OffsetRange, position: int) -> bool:
    """Whether a truncation was found at the range's start against the epoch of the last
    batch (what `_epoch_at` asks about there), older than this batch's: the log was
    truncated between the two, and this batch was planned on the new log."""
    return (
        position == r.start
        and r.start_epoch is not None
        and r.end_epoch is not None
        and r.end_epoch != r.start_epoch
    )


def _truncated_before(r: OffsetRange, err, fail: bool, checkpoint) -> None:
    """Fail naming what a truncation before this batch lost, or count and log it: the
    records the new leader holds below the range's start, which no batch reads. Their first
    offset is in librdkafka's message only ("broker end offset is N"); unknown, none is
    counted."""
    cut = _broker_end_offset(err)
    lost = max(0, r.start - cut) if cut is not None else 0
    what = (
        f"its leader's log was truncated below offset {r.start} after the last batch read up "
        f"to it (librdkafka: {err.str()}); the records the leader holds now below {r.start} "
        f"({lost if cut is not None else 'how many is not known'}) are never read. An unclean "
        "leader election or a broker that lost its data does this: check the topic's "
        "unclean.leader.election.enable and min.insync.replicas."
    )
    fix = "read the batch on from the new log"
    _data_loss((r.topic, r.partition), what, fix, lost, fail, checkpoint)


def _broker_end_offset(err) -> int | None:
    """Where the leader's log of the asked epoch ends, from librdkafka's report of a truncated
    log ("broker end offset is N"), the only place it gives it; None if not there."""
    found = re.search(r"broker end offset is (\d+)", err.str() or "")
    return int(found.group(1)) if found else None


def _end_of_epoch(err, epoch: int) -> int | None:
    """Where the leader's log of leader epoch `epoch` ends, from librdkafka's report of a
    truncated log; None if the leader answered for another epoch ("offset leader epoch M"):
    Kafka answers for the newest epoch it has at or below the one asked."""
    answered = re.search(r"offset leader epoch (-?\d+)", err.str() or "")
    if answered is None or int(answered.group(1)) != epoch:
        return None
    return _broker_end_offset(err)


def _where_cut(conf: dict[str, str], tp: TP, offset: int, epoch: int | None) -> int | None:
    """Where the partition's log was cut below `offset`, which its leader of epoch `epoch`
    held: the end of that epoch's log on the leader now (KIP-320's OffsetsForLeaderEpoch,
    asked by librdkafka's validating seek). Below it the log holds the records the old
    leader held there. None if the leader does not say so: no epoch logged; an answer for an
    older epoch than `epoch` (a leader that never had it, whose own records past that older
    epoch's end may differ from those read); none it knows ("No epoch found": a broker
    that keeps no epochs); a log of that epoch that does not end below `offset`; no answer
    within ATTEMPT_TIMEOUT_S. A wiped log that leads again answers 0: for an epoch older
    than all it has, Kafka answers where its first epoch starts."""
    from confluent_kafka import KafkaError

    if epoch is None:
        return None
    deadline = time.monotonic() + kafka_clients.ATTEMPT_TIMEOUT_S

    def left() -> float:  # every wait within the deadline
        return max(0.0, min(SEEK_WAIT_S, deadline - time.monotonic()))

    consumer = kafka_clients.range_consumer(conf)
    r = OffsetRange(*tp, offset, offset, epoch, epoch)
    try:
        asked = _fetch_from(consumer, r, offset, epoch, left())
        while time.monotonic() < deadline:
            for msg in consumer.consume(1, kafka_clients.CONSUME_WAIT_S):
                if (msg.topic(), msg.partition()) != tp:
                    continue  # an error librdkafka left from an earlier partition's question
                err = msg.error()
                if err is None and not asked:  # fetched unvalidated: ask now (ACTIVE)
                    asked = _ask_leader(consumer, r, offset, epoch, left())
                    continue
                if err is None or err.code() != KafkaError._AUTO_OFFSET_RESET:
                    return None  # a record there: the log holds `offset` again
                if _log_truncated(msg):
                    return _end_of_epoch(err, epoch)
                if _log_truncated_cause(msg):
                    return None  # "No epoch found"
                # Out of range: the fetch the assignment started before the seek asked.
                # librdkafka stopped the partition (FETCH_NONE), refusing every seek with
                # _STATE: only a new assignment starts it again.
                asked = _fetch_from(consumer, r, offset, epoch, left())
        return None
    finally:
        consumer.unassign()


def _out_of_range(
    consumer, r: OffsetRange, position: int, fail: bool, checkpoint, since: float, msg
) -> int:
    """A broker answered that offset `position` of the range is not in its log; returns the
    position to read on from.

    That broker may no longer be the partition's leader: one paused past its session timeout
    (a long GC pause, a hung host) answers as the leader it was until it learns otherwise,
    with a log that lacks what the new leader took meanwhile. So the leader is asked again,
    after a metadata refresh, and its answer decides:
    - its log starts after `position`: the offsets were deleted (retention, deleteRecords)
      while the batch ran: data loss (`_skip_lost`);
    - its log holds `position`: the broker that answered was behind; read on;
    - its log ends at or before `position`: the batch was planned when these offsets were
      committed, so a leader that holds them is waited for, up to BEHIND_LEADER_WAIT_S since
      the first such answer; after that they count as lost (a topic recreated, or an unclean
      leader election, while the batch ran);
    - it did not answer: it is asked again; a leader that never answers fails the read as
      stalled (READ_STALL_TIMEOUT_S), never as data loss.
    A truncated log, which librdkafka reports with the same error code, never comes here
    (see `_log_truncated`): its leader may hold the offsets again, but not the same records.
    Its "No epoch found" answer (`msg`'s offset is the position) does: a leader that is behind
    gives it too. From a leader that holds the position for BEHIND_LEADER_WAIT_S, the read
    goes on without asking: a broker that keeps no epochs answers so for ever, and so does a
    topic recreated while the batch ran (its epochs start again), which the next batch's
    planning finds by its topic id.
    """
    from confluent_kafka import KafkaException, TopicPartition

    waited = time.monotonic() - since
    low = high = None
    try:
        consumer.list_topics(r.topic, timeout=kafka_clients.ATTEMPT_TIMEOUT_S)  # leaders moved?
        low, high = consumer.get_watermark_offsets(
            TopicPartition(r.topic, r.partition), kafka_clients.ATTEMPT_TIMEOUT_S
        )
    except KafkaException as exc:
        if not kafka_clients.retriable(exc):
            raise
    if low is not None and low > position:
        return _skip_lost(consumer, r, position, low, high, fail, checkpoint)
    if high is None:
        pass  # no answer: ask again
    elif high > position and _log_truncated_cause(msg) and waited >= BEHIND_LEADER_WAIT_S:
        log.warning(
            "the leader of %s[%d] holds offset %d but no leader epoch as new as the batch's, "
            "for %.0f s (librdkafka: %s): a topic recreated while the batch ran, or a broker "
            "that keeps no epochs (a message format before 0.11); reading on without asking",
            r.topic,
            r.partition,
            position,
            waited,
            msg.error().str(),
        )
        _fetch_from(consumer, r, position, None)
        return position
    elif high > position:
        log.warning(
            "a broker answered that offset %d of %s[%d] is not in its log, but the leader "
            "holds [%d, %d): that broker was behind (a leader that lost its leadership while "
            "paused); reading on from the leader",
            position,
            r.topic,
            r.partition,
            low,
            high,
        )
    elif waited >= BEHIND_LEADER_WAIT_S:
        return _skip_lost(consumer, r, position, low, high, fail, checkpoint)
    elif waited < BEHIND_LEADER_RETRY_S:  # said once per wait
        log.warning(
            "offset %d of %s[%d] was committed when the batch was planned, but the leader "
            "holds [%d, %d); waiting up to %.0f s for a leader that holds it",
            position,
            r.topic,
            r.partition,
            low,
            high,
            BEHIND_LEADER_WAIT_S,
        )
    time.sleep(BEHIND_LEADER_RETRY_S)  # a stale broker may answer the next fetch too
    _fetch_from(consumer, r, position, _epoch_at(r, position))
    return position


def _log_truncated(msg) -> bool:
    """Whether an _AUTO_OFFSET_RESET error reports a truncated log, not an offset out of range.

    With auto.offset.reset=error librdkafka reports both with that one code: its
    rd_kafka_offset_reset (src/rdkafka_offset.c) gives the application the code, an offset
    and the string "<reason>: <err2str(cause)>", followed by " (broker <id>)" when a broker
    answered. KIP-320's offset validation reports two things with the cause
    RD_KAFKA_RESP_ERR__LOG_TRUNCATION (a fetch's answer has OFFSET_OUT_OF_RANGE):
    - "Partition log truncation detected": the leader's log of the read position's leader
      epoch ends below it. The offset is OFFSET_INVALID. This is the truncation.
    - "No epoch found": the leader knows no epoch as new as the position's (Kafka's
      LeaderEpochFileCache.endOffsetFor), as a leader that is behind answers. The offset is
      the position: asked again like an out-of-range answer, never loss at once.
    The cause's description is taken from the linked librdkafka (KafkaError(code).str() is its
    rd_kafka_err2str), never from the reason's wording, which is free text."""
    # Message.offset() is None for a negative offset, OFFSET_INVALID included.
    return msg.offset() is None and _log_truncated_cause(msg)


def _log_truncated_cause(msg) -> bool:
    """Whether an error's cause is KIP-320's validation (RD_KAFKA_RESP_ERR__LOG_TRUNCATION),
    by the cause's description from the linked librdkafka."""
    from confluent_kafka import KafkaError

    truncation = KafkaError(KafkaError._LOG_TRUNCATION).str()
    return truncation in (msg.error().str() or "")


def _truncated(r: OffsetRange, position: int, how: str, fail: bool, checkpoint) -> int:
    """The partition's log was found truncated where the read was, at `position` (an unclean
    leader election, a broker that lost its disk, a recreated topic), as `how` says: the
    records of the range from there on are gone, though the leader may hold the offsets
    again with other records, which the read must not take for them. Fail, or count the
    range's unread offsets and end the range. Returns the new position."""
    what = (
        f"its leader's log was truncated while the batch read offsets [{r.start}, {r.end}), at "
        f"offset {position} ({how}); offsets [{position}, {r.end}) of the "
        "batch are gone, and those the leader holds again hold other records. An unclean "
        "leader election, a broker that lost its data or a recreated topic does this: check "
        "the topic's unclean.leader.election.enable and min.insync.replicas."
    )
    fix = "skip the rest of the range"
    _data_loss((r.topic, r.partition), what, fix, r.end - position, fail, checkpoint)
    return r.end


def _data_loss(tp: TP, what: str, fix: str, lost: int, fail: bool, checkpoint) -> None:
    """Fail naming the loss, or (failOnDataLoss=false) log it and count `lost` offsets."""
    message = f"data loss on topic {tp[0]} partition {tp[1]}: {what}"
    if fail:
        raise DataLossError(
            f"{message} Set failOnDataLoss=false to {fix} and continue, or restore the input topic."
        )
    log.warning("%s Continuing: %s (failOnDataLoss=false).", message, fix)
    if checkpoint is not None and lost:
        checkpoint.add_source_data_loss(*tp, lost)


def _skip_lost(
    consumer, r: OffsetRange, position: int, low: int, high: int, fail: bool, checkpoint
) -> int:
    """Offset `position` of the range is gone: fail, or count the gone offsets and go on
    from the first one still stored (the range's end if none is). Returns the new position."""

    resume = low if position < low < r.end and high > low else r.end
    what = (
        f"offset {position} of the batch's range [{r.start}, {r.end}) is gone (the broker holds "
        f"[{low}, {high})); it was deleted or the topic was recreated while the batch was read."
    )
    fix = f"skip the gone offsets to {resume}"
    _data_loss((r.topic, r.partition), what, fix, resume - position, fail, checkpoint)
    _fetch_from(consumer, r, resume, _epoch_at(r, resume))
    return resume


class _Columns:
    """Column buffers for one Arrow batch in the schema of Spark's Kafka source."""

    def __init__(self) -> None:
        self.key: list = []
        self.value: list = []
        self.topic: list = []
        self.partition: list = []
        self.offset: list = []
        self.timestamp: list = []
        self.timestamp_type: list = []
        self.headers: list = []

    def __len__(self) -> int:
        return len(self.offset)

    def add(self, msg) -> None:
        ts_type, ts = msg.timestamp()
        self.key.append(msg.key())
        self.value.append(msg.value())
        self.topic.append(msg.topic())
        self.partition.append(msg.partition())
        self.offset.append(msg.offset())
        # librdkafka: 0 none, 1 create time, 2 log append time; Spark: -1, 0, 1.
        self.timestamp.append(ts * 1000 if ts_type else None)
        self.timestamp_type.append(ts_type - 1)
        headers = msg.headers()
        self.headers.append([{"key": k, "value": v} for k, v in headers] if headers else None)

    def to_arrow(self, pa):
        return pa.RecordBatch.from_arrays(
            [
                pa.array(self.key, pa.binary()),
                pa.array(self.value, pa.binary()),
                pa.array(self.topic, pa.string()),
                pa.array(self.partition, pa.int32()),
                pa.array(self.offset, pa.int64()),
                pa.array(self.timestamp, pa.timestamp("us", tz="UTC")),
                pa.array(self.timestamp_type, pa.int32()),
                pa.array(self.headers, headers_type(pa)),
            ],
            names=SOURCE_COLUMNS,
        )


def _end_epochs(
    start: dict, end: dict[TP, int], epochs: dict[TP, int | None], restarted: set[TP]
) -> dict[TP, int | None]:
    """The leader epoch to log with each end offset of a batch. An end that moved, or that
    restarts its partition (`restarted`: joined, recreated, rewound), was in the log of the
    epoch its look-up answered in: every offset up to the stable end is. One that did not
    move keeps the epoch it had, so that the batch that reads on from it validates it against
    the log it was planned in, however many batches later: a log truncated meanwhile (an
    unclean leader election) and grown back past it is still seen."""
    before, before_epochs = offsets.positions(start), offsets.leader_epochs(start)
    return {
        tp: before_epochs.get(tp)
        if before.get(tp) == offset and tp not in restarted
        else epochs.get(tp)
        for tp, offset in end.items()
    }


def ramp_limit(limit: ReadLimit, epochs_planned: int) -> ReadLimit:
    """The first epochs a process plans take a share of the limit (RAMP_SHARES), as TCP's slow
    start does: the first runs while Spark's Python processes, RocksDB and the JIT are still
    cold, so a crash loop's replays stay small enough to commit; the second is the one that
    publishes the windows the first one's watermark closed, so after a restart they come
    seconds sooner. Then every epoch takes the whole limit."""
    if not isinstance(limit, ReadMaxRows) or epochs_planned >= len(RAMP_SHARES):
        return limit
    return ReadMaxRows(max(1, limit.max_rows // RAMP_SHARES[epochs_planned]))


def _admit(available: dict[tuple[str, int], int], limit: ReadLimit) -> dict[tuple[str, int], int]:
    """How many offsets each partition may advance: all, or `maxRows` split by backlog."""
    total = sum(available.values())
    if not isinstance(limit, ReadMaxRows) or total <= limit.max_rows:
        return available
    budget = limit.max_rows
    # Proportional to backlog (as Spark's Kafka source does), at least one offset for every
    # partition with a backlog so that none starves.
    take = {tp: min(n, max(1, n * budget // total)) if n else 0 for tp, n in available.items()}
    return take


def plan_tasks(
    ranges: list[OffsetRange], parallelism: int | None, min_share: int = MIN_TASK_RECORDS
) -> list[ReadTask]:
    """A batch's offset ranges as Spark tasks: one per partition, or up to `parallelism` equal
    shares of at least `min_share` offsets.

    Equal shares keep every core busy to the end of the epoch: three partitions on two cores
    otherwise run as two tasks and then one alone (Q1 of the benchmark: 17% slower). A share
    takes the ranges in order and cuts one only at its edge, so a task reads few partitions.
    A small epoch is one task: a task's fixed cost (its Python workers' round trips) is more
    than what a second core would save on a few records.
    """
    ranges = [r for r in ranges if r.size > 0]
    if not parallelism or not ranges:
        return [ReadTask((r,)) for r in ranges]
    total = sum(r.size for r in ranges)
    tasks = max(1, min(parallelism, total // min_share))
    shares = iter(total // tasks + (1 if i < total % tasks else 0) for i in range(tasks))
    planned: list[ReadTask] = []
    current: list[OffsetRange] = []
    room = next(shares)
    for r in ranges:
        start = r.start
        while start < r.end:
            end = min(r.end, start + room)
            epoch = _epoch_at(r, start)
            current.append(OffsetRange(r.topic, r.partition, start, end, epoch, r.end_epoch))
            room -= end - start
            start = end
            if room == 0:  # this share is full
                planned.append(ReadTask(tuple(current)))
                current, room = [], next(shares, 0)
    return planned
