"""Peer: Quix Streams with processing_guarantee="exactly-once" on the benchmark queries.

Runs in a virtualenv of its own (bench/.venv-quix: Quix pins an older confluent-kafka than
onceflow), so it imports nothing from onceflow:

    bench/.venv-quix/bin/python bench/quix_app.py --query q5 --bootstrap B --source T \
        --sink S --records N --state-dir DIR

Stops after `--records` input records have been processed (Quix commits on stop) and prints
one JSON line: records and seconds from the first record to the end of the final commit.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

from quixstreams import Application

BOUND_S = 10  # bench/joins.py's (this process imports nothing of onceflow's)
Q3_CATEGORY, Q3_STATES = 10, ("OR", "ID", "CA")  # bench/joins.py's too


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("query", "bootstrap", "source", "sink", "state-dir"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--records", type=int, required=True)
    args = parser.parse_args()

    app = Application(
        broker_address=args.bootstrap,
        consumer_group=f"quix-bench-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        processing_guarantee="exactly-once",
        state_dir=args.state_dir,
        commit_interval=1.0,
    )
    sink = app.topic(args.sink, key_serializer="str", value_serializer="json")
    seen = {"records": 0, "start": None}

    def count(_value) -> None:
        seen["start"] = seen["start"] or time.perf_counter()
        seen["records"] += 1
        if seen["records"] == args.records:
            app.stop()

    if args.query == "q8":
        sdf = _q8(app, args.source, count)
    elif args.query == "q3":
        sdf = _q3(app, args.source, count)
    else:
        sdf = _bids(app, app.dataframe(_topic(app, args.source)), args.query, count)
    sdf.to_topic(sink)
    app.run()
    end = time.perf_counter()
    print(json.dumps({"records": seen["records"], "seconds": end - (seen["start"] or end)}))


def _topic(app: Application, name: str):
    """A topic of JSON records with string keys, in event time `dateTime`."""
    return app.topic(
        name,
        key_deserializer="str",
        value_deserializer="json",
        timestamp_extractor=lambda value, headers, ts, kind: value["dateTime"],
    )


def _q8(app: Application, topics: str, count):
    """bench/joins.py's join: each auction with its seller's person record, when the auction
    opened within BOUND_S after the person joined. `topics`: people's, a comma, auctions'."""
    persons, auctions = (app.dataframe(_topic(app, t)).update(count) for t in topics.split(","))
    joined = auctions.join_interval(
        persons,
        how="inner",
        on_merge=lambda a, p: {"seller": a["seller"], "name": p["name"], "auction": a["id"]},
        backward_ms=BOUND_S * 1000,
    )
    return joined


def _q3(app: Application, topics: str, count):
    """bench/joins.py's Q3: each auction of the category with its seller's latest person
    record at or before it (`join_asof`), kept when the seller lives in one of the states.
    `topics`: people's, a comma, auctions'."""
    persons, auctions = (app.dataframe(_topic(app, t)).update(count) for t in topics.split(","))
    auctions = auctions.filter(lambda a: a["category"] == Q3_CATEGORY)
    joined = auctions.join_asof(
        persons,
        how="inner",
        on_merge=lambda a, p: {
            "seller": a["seller"],
            "name": p["name"],
            "state": p["state"],
            "auction": a["id"],
        },
    )
    return joined.filter(lambda row: row["state"] in Q3_STATES)


def _bids(app: Application, sdf, query: str, count):
    if query == "q1":
        sdf = sdf.update(count).apply(
            lambda b: {
                "auction": b["auction"],
                "bidder": b["bidder"],
                "price": int(b["price"] * 0.908),
                "dateTime": b["dateTime"],
            }
        )
    elif query == "q5":  # the key is the auction already
        sdf = sdf.update(count).hopping_window(10_000, 2_000, grace_ms=1_000).count().final()
    elif query == "q7":
        sdf = sdf.group_by("channel").update(count).apply(lambda b: b["price"])
        sdf = sdf.tumbling_window(10_000, grace_ms=1_000).max().final()
    elif query == "q11":
        sdf = sdf.group_by("bidder").update(count)
        sdf = sdf.session_window(10_000, grace_ms=1_000).count().final()
    return sdf


if __name__ == "__main__":
    main()
