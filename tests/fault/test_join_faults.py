"""Exactly-once with two inputs: a stream-stream join under SIGKILL at random moments.

Spark's offset log holds both inputs' offsets for each epoch, the join's state is restored
with the epoch, and the sink publishes an epoch once: the read_committed output must be
exactly the join the test computes from its own records, each pair once.
"""

from __future__ import annotations

import json
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
    # First a kill between the Kafka commit of epoch 3 and Spark's commit log: the restart
    # replays epoch 3 from both inputs' logged offsets and must find it published already.
    crashed = app.service(pipeline, available_now=True, fault="after_kafka_commit@3")
    assert crashed.wait() == -signal.SIGKILL, crashed.tail()
    Service.kills += 1
    kill_each_run_at_random(app, pipeline, 10 if long else 2, default_seed=20261126)
    replay = (tmp_path / "run-2.log").read_text(errors="replace")
    assert "batch 3 is already published; replay skipped" in replay, replay[-3000:]
    drain = app.service(pipeline, available_now=True)
    assert drain.wait() == 0, drain.tail()

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
