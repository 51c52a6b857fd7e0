"""The source's offsets as Spark's offset log keeps them, and the only code that reads them.

An offset is `{"topic": {"partition": next offset}}` as in Spark's Kafka source, plus the
id of every topic under the key `@topicIds`. Kafka gives a topic that is deleted and created
again a new id and restarts its offsets at 0: with the id written ahead beside the offsets,
the source recognises a recreated topic even when the new one already holds more records than
the checkpoint's offset ('@' cannot appear in a topic name, so the key names no topic).
Ids a topic had before it was recreated are kept under `@retiredTopicIds`: a broker whose
metadata lags may still answer with one, and that answer must not count as another recreation.
A named input of a query with several (`sources:`) writes its name under `@input`: Spark
hands each source the offsets at its place in the query, and a query whose inputs changed
places must not read one input from another's offsets.
Under `@leaderEpochs` each offset has the epoch of the partition's leader whose log held it
when it was planned (KIP-320). The batch that reads on from an offset asks the leader where
that epoch's log ends now: below the offset, the log was truncated since (an unclean leader
election), even when it has grown back past the offset with other records.
"""

from __future__ import annotations

from collections.abc import Mapping

TP = tuple[str, int]
TOPIC_IDS = "@topicIds"
RETIRED_IDS = "@retiredTopicIds"
INPUT = "@input"
LEADER_EPOCHS = "@leaderEpochs"
RETIRED_KEPT = 5  # per topic, the newest


def positions(logged: Mapping) -> dict[TP, int]:
    """{(topic, partition): offset} of a logged offset."""
    return {
        (topic, int(p)): int(o)
        for topic, partitions in logged.items()
        if not topic.startswith("@")
        for p, o in partitions.items()
    }


def topic_ids(logged: Mapping) -> dict[str, str]:
    """{topic: id} of a logged offset; empty for one logged before ids were kept."""
    return dict(logged.get(TOPIC_IDS, {}))


def retired_ids(logged: Mapping) -> dict[str, list[str]]:
    """{topic: ids it had before it was recreated, oldest first} of a logged offset."""
    return {t: list(ids) for t, ids in logged.get(RETIRED_IDS, {}).items()}


def leader_epochs(logged: Mapping) -> dict[TP, int]:
    """{(topic, partition): leader epoch} of a logged offset; empty for one logged before
    epochs were kept (its reads validate nothing)."""
    return {
        (topic, int(p)): int(e)
        for topic, partitions in logged.get(LEADER_EPOCHS, {}).items()
        for p, e in partitions.items()
    }


def input_of(logged: Mapping) -> str | None:
    """The input a logged offset was written by; None for a query's only input."""
    return logged.get(INPUT)


def logged(
    offsets: Mapping[TP, int],
    ids: Mapping[str, str | None] | None = None,
    retired: Mapping[str, list[str]] | None = None,
    input_name: str | None = None,
    epochs: Mapping[TP, int | None] | None = None,
) -> dict:
    """The JSON-able offset Spark writes ahead: offsets nested per topic, then the topic ids
    (None: the broker reports no id), the retired ones, the input's name and the offsets'
    leader epochs (None: not known). Spark compares offsets as text, so the order is fixed."""
    nested: dict = {}
    for (t, p), o in sorted(offsets.items()):
        nested.setdefault(t, {})[str(p)] = int(o)
    known = {t: ids[t] for t in sorted(ids or {}) if ids[t] is not None}
    if known:
        nested[TOPIC_IDS] = known
    kept = {t: list(retired[t])[-RETIRED_KEPT:] for t in sorted(retired or {}) if retired[t]}
    if kept:
        nested[RETIRED_IDS] = kept
    if input_name is not None:
        nested[INPUT] = input_name
    known_epochs: dict = {}
    for (t, p), e in sorted((epochs or {}).items()):
        if e is not None and (t, p) in offsets:
            known_epochs.setdefault(t, {})[str(p)] = int(e)
    if known_epochs:
        nested[LEADER_EPOCHS] = known_epochs
    return nested
