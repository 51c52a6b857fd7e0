"""Exactly-once with two inputs: a stream-stream join, and a stream-table lookup, under SIGKILL
at random moments.

Spark's offset log holds both inputs' offsets for each epoch, the join's state is restored
with the epoch, and the sink publishes an epoch once: the read_committed output must be
exactly the join the test computes from its own records, each pair once.
"""

from __future__ import annotations

import json
import random
import signal
from collections import Counter

import pytest
import yaml

from onceflow.connectors.topics import read_committed
from tests.fault.test_faults import BASE, Scenario, Service, kill_each_run_at_random
from tests.helpers import produce

pytestmark = pytest.mark.fault

BOUND_S = 10  # an auction joins its seller's person record up to 10 s after it
JOIN = f"""
    SELECT a.seller, p.name, a.id AS auction, a.dateTime AS opened
    FROM persons p JOIN auctions a
      ON p.id = a.seller
     AND a.event_time BETWEEN p.event_time AND p.event_time + INTERVAL {BOUND_S} SECONDS
"""


def test_a_two_input_join_is_exactly_once_under_random_sigkills(
    kafka_bootstrap, new_topic, tmp_path, request
):
    long = request.config.getoption("--long")
    Service.kills = 0
    people = 20_000 if long else 2_000
    topics = {n: new_topic(partitions=3, prefix=n) for n in ("persons", "auctions", "out")}
    topics |= {n: new_topic(partitions=1, prefix=n) for n in ("dlq", "late")}
    # Person i opens at BASE + 50 ms * i; auction j belongs to person j // 2 and opens 0-14 s
    # after its seller: about 2 in 3 fall inside the bound. Both inputs are in event-time
    # order per partition, so with a 10-minute watermark delay nothing is late.
    persons = [{"id": i, "name": f"p{i}", "dateTime": BASE + 50 * i} for i in range(people)]
    auctions = [
        {"id": j, "seller": j // 2, "dateTime": BASE + 50 * (j // 2) + (j * 3_001) % 15_000}
        for j in range(2 * people)
    ]
    auctions.sort(key=lambda a: a["dateTime"])
    bad = {"persons": b'{"id": "not a number"', "auctions": b"\x00binary"}
    for name, records in (("persons", persons), ("auctions", auctions)):
        values = [json.dumps(r).encode() for r in records]
        values.insert(len(values) // 2, bad[name])
        produce(kafka_bootstrap, topics[name], ((None, v, i % 3) for i, v in enumerate(values)))

    pipeline = tmp_path / "join.yaml"
    per_batch = len(auctions) // 24
    event_time = {"field": "dateTime", "watermark_delay": "10m"}
    pipeline.write_text(
        yaml.safe_dump(
            {
                "app_id": f"join-{topics['out']}",
                "kafka": {"bootstrap_servers": kafka_bootstrap},
                "sources": {
                    name: {
                        "topics": [topics[name]],
                        "starting_offsets": "earliest",
                        "schema": schema,
                        "event_time": event_time,
                        "max_records_per_batch": per_batch,
                    }
                    for name, schema in (
                        ("persons", "id LONG, name STRING, dateTime LONG"),
                        ("auctions", "id LONG, seller LONG, dateTime LONG"),
                    )
                },
                "sql": JOIN,
                "key": "seller",
                "sink": {
                    "topic": topics["out"],
                    "dead_letter_topic": topics["dlq"],
                    "late_topic": topics["late"],
                },
                "checkpoint": {"location": str(tmp_path / "checkpoint"), "interval": "200ms"},
                "spark": {"master": "local[2]"},
                "metrics": {"port": 0},
            }
        )
    )
    app = Scenario(kafka_bootstrap, topics, [], tmp_path, long)
    _killed_then_drained(app, pipeline, tmp_path, long, default_seed=20261126)

    by_id = {p["id"]: p for p in persons}
    expected = Counter(
        (a["seller"], by_id[a["seller"]]["name"], a["id"], a["dateTime"])
        for a in auctions
        if a["dateTime"] <= by_id[a["seller"]]["dateTime"] + BOUND_S * 1_000
    )
    published = Counter()
    for m in read_committed(kafka_bootstrap, topics["out"]):
        row = json.loads(m.value())
        assert m.key() == str(row["seller"]).encode()
        published[(row["seller"], row["name"], row["auction"], row["opened"])] += 1
    twice = {pair: n for pair, n in published.items() if n > 1}
    missing = expected - published
    unexpected = published - expected
    print(f"persons {len(persons)}, auctions {len(auctions)}, join pairs {sum(expected.values())}")
    print(f"service runs: {app.runs}, kills: {Service.kills}")
    print(f"published {sum(published.values())}: {len(twice)} twice, {len(missing)} missing")
    assert not twice and not missing and not unexpected, (
        f"twice {list(twice)[:5]}, missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}"
    )
    dead = sorted(m.value() for m in read_committed(kafka_bootstrap, topics["dlq"]))
    assert dead == sorted(bad.values())
    assert list(read_committed(kafka_bootstrap, topics["late"])) == []


def test_a_stream_table_lookup_is_exactly_once_and_joins_as_of_each_epoch_under_sigkills(
    kafka_bootstrap, new_topic, tmp_path, request
):
    """Auctions look up their seller in a persons table whose entries change (new names,
    deletions) while the auctions are read. Each auction must be published once, joined with
    the table as of its epoch: the test rebuilds every epoch's table from the offset log Spark
    wrote ahead (both inputs' ranges) and the records it produced, then compares."""
    long = request.config.getoption("--long")
    Service.kills = 0
    people, changes = (2_000, 12_000) if long else (300, 1_800)
    topics = {n: new_topic(partitions=3, prefix=n) for n in ("persons", "auctions", "out")}
    topics["dlq"] = new_topic(partitions=1, prefix="dlq")
    # The table's records: a new name or a deletion of a random person, keyed by its id
    # (partition id % 3, so each key's changes are in order); auctions of random sellers,
    # some of whom were never in the table.
    rng = random.Random(20261127)
    persons: list[tuple[bytes | None, bytes | None, int]] = []
    for change in range(changes):
        pid = rng.randrange(people)
        value = None if rng.random() < 0.1 else {"id": pid, "name": f"p{pid}-v{change}"}
        persons.append((str(pid).encode(), json.dumps(value).encode() if value else None, pid % 3))
    keyless = (None, json.dumps({"id": 1, "name": "keyless"}).encode(), 0)
    persons.insert(len(persons) // 2, keyless)
    auctions = [
        {"id": j, "seller": rng.randrange(people + people // 10)} for j in range(2 * changes)
    ]
    produce(kafka_bootstrap, topics["persons"], persons)
    produce(
        kafka_bootstrap,
        topics["auctions"],
        ((None, json.dumps(a).encode(), a["id"] % 3) for a in auctions),
    )

    pipeline = tmp_path / "lookup.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "app_id": f"lookup-{topics['out']}",
                "kafka": {"bootstrap_servers": kafka_bootstrap},
                "sources": {
                    "persons": {
                        "topics": [topics["persons"]],
                        "schema": "id LONG, name STRING",
                        "max_records_per_batch": changes // 16,
                    },
                    "auctions": {
                        "topics": [topics["auctions"]],
                        "starting_offsets": "earliest",
                        "schema": "id LONG, seller LONG",
                        "lookup": {"persons": "seller"},
                        "max_records_per_batch": len(auctions) // 24,
                    },
                },
                "sql": "SELECT id AS auction, seller, persons.name AS name FROM auctions",
                "key": "seller",
                "sink": {"topic": topics["out"], "dead_letter_topic": topics["dlq"]},
                "checkpoint": {"location": str(tmp_path / "checkpoint"), "interval": "200ms"},
                "spark": {"master": "local[2]"},
                "metrics": {"port": 0},
            }
        )
    )
    app = Scenario(kafka_bootstrap, topics, [], tmp_path, long)
    _killed_then_drained(app, pipeline, tmp_path, long, default_seed=20261127)

    expected = Counter(_joined_as_of_each_epoch(tmp_path / "checkpoint", persons, auctions))
    published = Counter()
    for m in read_committed(kafka_bootstrap, topics["out"]):
        row = json.loads(m.value())
        published[(row["auction"], row["seller"], row.get("name"))] += 1  # null: left out
    twice = {row: n for row, n in published.items() if n > 1}
    missing, unexpected = expected - published, published - expected
    named = sum(n for (_, _, name), n in expected.items() if name is not None)
    print(f"table changes {changes}, auctions {len(auctions)}, joined with an entry {named}")
    print(f"service runs: {app.runs}, kills: {Service.kills}")
    print(f"published {sum(published.values())}: {len(twice)} twice, {len(missing)} missing")
    assert not twice and not missing and not unexpected, (
        f"twice {list(twice)[:5]}, missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}"
    )
    dead = [m.value() for m in read_committed(kafka_bootstrap, topics["dlq"])]
    assert dead == [keyless[1]]


def _killed_then_drained(app: Scenario, pipeline, tmp_path, long: bool, default_seed: int) -> None:
    """First a kill between the Kafka commit of epoch 3 and Spark's commit log (the restart
    replays epoch 3 from both inputs' logged offsets and must find it published already),
    then kills at random moments, then a run that drains what is left."""
    crashed = app.service(pipeline, available_now=True, fault="after_kafka_commit@3")
    assert crashed.wait() == -signal.SIGKILL, crashed.report()
    Service.kills += 1
    kill_each_run_at_random(app, pipeline, 10 if long else 1, default_seed=default_seed)
    replay = (tmp_path / "run-2.log").read_text(errors="replace")
    assert "batch 3 is already published; replay skipped" in replay, replay[-3000:]
    drain = app.service(pipeline, available_now=True)
    assert drain.wait() == 0, drain.report()


def _joined_as_of_each_epoch(checkpoint, persons: list, auctions: list) -> list[tuple]:
    """(auction, seller, name) per auction: the name its seller had in the table after the
    table records of the auction's epoch were applied (the epochs' ranges from the offset log;
    the records by partition in the order produced, which is their offset order)."""
    table_log, stream_log = (
        _by_partition(persons),
        _by_partition([(None, a, a["id"] % 3) for a in auctions]),
    )
    table: dict[bytes, str | None] = {}
    applied = {p: 0 for p in table_log}
    joined_up_to = {p: 0 for p in stream_log}
    rows = []
    for batch in _batch_ends(checkpoint):
        for p, end in batch["persons"].items():
            for key, value, _ in table_log[p][applied[p] : end]:
                if key is not None:  # a keyless record is a dead letter
                    table[key] = json.loads(value)["name"] if value is not None else None
            applied[p] = max(applied[p], end)
        for p, end in batch["auctions"].items():
            for _, a, _ in stream_log[p][joined_up_to[p] : end]:
                rows.append((a["id"], a["seller"], table.get(str(a["seller"]).encode())))
            joined_up_to[p] = max(joined_up_to[p], end)
    assert all(joined_up_to[p] == len(stream_log[p]) for p in stream_log), joined_up_to
    return rows


def _by_partition(records: list) -> dict[int, list]:
    by: dict[int, list] = {0: [], 1: [], 2: []}
    for record in records:
        by[record[2]].append(record)
    return by


def _batch_ends(checkpoint) -> list[dict[str, dict[int, int]]]:
    """Every batch's end offsets per input and partition, in batch order, from Spark's
    offset log (all of it must still be there: Spark keeps the last 100 batches)."""
    ends = []
    files = sorted((checkpoint / "offsets").glob("[0-9]*"), key=lambda f: int(f.name))
    assert files and files[0].name == "0", "the offset log no longer starts at batch 0"
    for file in files:
        batch = {}
        for line in file.read_text().splitlines()[2:]:
            offsets = json.loads(line)
            (topic,) = [t for t in offsets if not t.startswith("@")]
            batch[offsets["@input"]] = {int(p): o for p, o in offsets[topic].items()}
        ends.append(batch)
    return ends
