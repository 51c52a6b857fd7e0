"""A stream joined to a table (`lookup:`), against a real broker and Spark: the table is a
topic read as the latest value per key, a null value deletes; each stream record joins the
table as of its epoch, and the table survives restarts in the checkpoint.

Expectations are computed from the records, independently of Spark, and compared as
multisets: a row published twice fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from onceflow import cli
from onceflow.config import parse
from onceflow.connectors.topics import read_committed
from onceflow.runner import run
from onceflow.testing import assert_published
from tests.helpers import produce

pytestmark = pytest.mark.integration

PERSON = "id LONG, name STRING, state STRING"
AUCTION = "id LONG, seller LONG, reserve LONG"
SQL = "SELECT id, seller, persons.name AS name, persons.state AS state FROM auctions"


def lookup_pipeline(sql: str = SQL, **auctions) -> dict:
    return {
        "app_id": "lookup",
        "sources": {
            "persons": {"topics": ["persons"], "schema": PERSON},
            "auctions": {
                "topics": ["auctions"],
                "schema": AUCTION,
                "lookup": {"persons": "seller"},
                **auctions,
            },
        },
        "sql": sql,
        "key": "seller",
        "sink": {"topic": "out", "dead_letter_topic": "dlq"},
        "checkpoint": {"location": "unused"},
    }


def person(pid: int, name: str, state: str = "OR") -> tuple[str, dict]:
    return (str(pid), {"id": pid, "name": name, "state": state})


def auction(aid: int, seller: int | None) -> dict:
    return {"id": aid, "seller": seller, "reserve": aid * 10}


def joined(a: dict, entry: dict | None) -> dict:
    """The result row as published: JSON results leave null columns out (Spark's to_json)."""
    row = {
        "id": a["id"],
        "seller": a["seller"],
        "name": entry["name"] if entry else None,
        "state": entry["state"] if entry else None,
    }
    return {column: value for column, value in row.items() if value is not None}


def test_each_stream_record_gets_the_tables_latest_entry_for_its_key_or_null(onceflow_run):
    # One epoch: the table's records apply first, in offset order, then the stream joins.
    persons = [
        person(1, "ann"),
        person(2, "bob"),
        person(2, "bob-renamed", "CA"),  # a later value of key 2 wins
        person(3, "cid"),
        ("3", None),  # a null value deletes key 3
        (None, json.dumps({"id": 9, "name": "keyless"})),  # a table record needs a key
        ("5", "{not json"),
        (b"\x00\x00\x00\xc8", json.dumps({"id": 200, "name": "long-key"})),  # not text
    ]
    auctions = [auction(10, 1), auction(11, 2), auction(12, 3), auction(13, 4), auction(14, None)]
    auctions.append(auction(15, 200))  # the key 200 as text: not the serialized long above
    published = onceflow_run(lookup_pipeline(), {"persons": persons, "auctions": auctions})
    table = {"1": persons[0][1], "2": persons[2][1]}
    expected = [joined(a, table.get(str(a["seller"]))) for a in auctions]
    assert_published(published.results, expected, key=lambda r: r["id"])
    reasons = [d.reason for d in published.dead_letters]
    assert len(reasons) == 2, reasons
    assert any(r.startswith("a table's record has no key") for r in reasons), reasons
    assert any("not valid JSON" in r for r in reasons), reasons


def test_an_inner_lookup_is_a_filter_on_the_tables_column(onceflow_run):
    sql = SQL + " WHERE persons IS NOT NULL"
    persons = [person(1, "ann"), person(2, "bob")]
    auctions = [auction(10, 1), auction(11, 7), auction(12, 2), auction(13, 1)]
    published = onceflow_run(lookup_pipeline(sql), {"persons": persons, "auctions": auctions})
    table = dict(persons)
    expected = [joined(a, table[str(a["seller"])]) for a in auctions if str(a["seller"]) in table]
    assert_published(published.results, expected, key=lambda r: r["id"])


def test_the_table_is_kept_in_the_checkpoint_and_later_epochs_join_its_later_values(
    kafka_bootstrap, spark, new_topic, tmp_path
):
    """Three runs on one checkpoint. The later runs read only their own new records, so their
    joins can only be right if the table read by the earlier runs was restored."""
    topics = {name: new_topic(prefix=name) for name in ("persons", "auctions", "out", "dlq")}
    raw = lookup_pipeline()
    raw["sources"]["persons"]["topics"] = [topics["persons"]]
    raw["sources"]["auctions"]["topics"] = [topics["auctions"]]
    raw["sources"]["auctions"]["starting_offsets"] = "earliest"
    raw |= {
        "app_id": f"lookup-{topics['out']}",
        "kafka": {"bootstrap_servers": kafka_bootstrap},
        "sink": {"topic": topics["out"], "dead_letter_topic": topics["dlq"]},
        "checkpoint": {"location": str(tmp_path / "ck")},
        "spark": {"master": "local[2]"},
        "metrics": {"port": 0},
    }
    config = parse(raw)

    def feed(persons: list, auctions: list) -> None:
        produce(kafka_bootstrap, topics["persons"], [_kafka(k, v) for k, v in persons])
        stream = [(None, json.dumps(a).encode(), 0) for a in auctions]
        produce(kafka_bootstrap, topics["auctions"], stream)
        run(config, available_now=True)

    expected = []
    first = [person(1, "ann"), person(2, "bob")]
    feed(first, [auction(10, 1), auction(11, 2)])
    expected += [joined(auction(10, 1), first[0][1]), joined(auction(11, 2), first[1][1])]
    # Run 2: key 1 deleted, key 2 unchanged (only in the restored table), key 3 new.
    feed([("1", None), person(3, "cid")], [auction(20, 1), auction(21, 2), auction(22, 3)])
    expected += [
        joined(auction(20, 1), None),
        joined(auction(21, 2), first[1][1]),
        joined(auction(22, 3), person(3, "cid")[1]),
    ]
    # Run 3: no table records at all: every join is with the table as restored.
    feed([], [auction(30, 2), auction(31, 3), auction(32, 1)])
    expected += [
        joined(auction(30, 2), first[1][1]),
        joined(auction(31, 3), person(3, "cid")[1]),
        joined(auction(32, 1), None),
    ]
    published = [json.loads(m.value()) for m in read_committed(kafka_bootstrap, topics["out"])]
    assert_published(published, expected, key=lambda r: r["id"])
    assert read_committed(kafka_bootstrap, topics["dlq"]) == []


def _kafka(key: str, value: dict | None) -> tuple[bytes, bytes | None, int]:
    return (key.encode(), json.dumps(value).encode() if value is not None else None, 0)


def test_validate_accepts_the_example_and_points_a_query_of_the_table_to_its_column(
    tmp_path, capsys
):
    example = Path(__file__).parents[2] / "examples" / "auction-sellers.yaml"
    assert cli.main(["validate", str(example)]) == 0, capsys.readouterr()
    raw = yaml.safe_load(example.read_text())
    raw["sql"] = "SELECT a.id, p.name FROM auctions a JOIN persons p ON a.seller = p.id"
    file = tmp_path / "pipeline.yaml"
    file.write_text(yaml.safe_dump(raw))
    assert cli.main(["validate", str(file)]) == 2
    assert "read it as the column auctions.persons" in capsys.readouterr().err
    raw = yaml.safe_load(example.read_text())
    raw["sources"]["auctions"]["schema"] = "id LONG, seller DOUBLE, category LONG, dateTime LONG"
    file.write_text(yaml.safe_dump(raw))
    assert cli.main(["validate", str(file)]) == 2
    error = capsys.readouterr().err
    assert "sources.auctions.lookup.persons: field 'seller' is double" in error, error


def test_a_window_over_looked_up_records_keeps_the_streams_watermark(onceflow_run):
    """The lookup carries the stream's watermark over: a window after it closes, and a
    record behind the watermark goes to the late topic."""
    sql = """
        SELECT persons.state AS state, unix_millis(window.start) AS window_start,
               count(*) AS auctions
        FROM auctions GROUP BY persons.state, window(event_time, '10 seconds')
    """
    pipeline = lookup_pipeline(
        sql,
        schema="id LONG, seller LONG, reserve LONG, dateTime LONG",
        event_time={"field": "dateTime", "watermark_delay": "5s"},
        max_records_per_batch=4,
    )
    pipeline["key"] = "state"
    pipeline["sink"]["late_topic"] = "late"
    t0 = 1_700_000_000_000
    persons = [person(1, "ann", "OR"), person(2, "bob", "CA")]
    timed = [(10, 1, 0), (11, 2, 1_000), (12, 1, 9_000), (13, 1, 12_000), (14, 2, 31_000)]
    timed += [(20 + i, 2, 32_000) for i in range(8)]  # the watermark moves past t0 + 26 s
    timed += [(40, 1, 3_000)]  # behind it: late
    timed += [(50 + i, 1, 60_000) for i in range(4)]  # closes the windows above
    auctions = [{"id": i, "seller": s, "reserve": 1, "dateTime": t0 + t} for i, s, t in timed]
    published = onceflow_run(pipeline, {"persons": persons, "auctions": auctions})
    expected = [
        {"state": "OR", "window_start": t0, "auctions": 2},
        {"state": "CA", "window_start": t0, "auctions": 1},
        {"state": "OR", "window_start": t0 + 10_000, "auctions": 1},
        {"state": "CA", "window_start": t0 + 30_000, "auctions": 9},
    ]
    assert_published(published.results, expected, key="state")
    assert published.late == [auctions[-5]]


def test_a_stream_looks_up_two_tables(onceflow_run):
    pipeline = lookup_pipeline(
        "SELECT id, persons.name AS name, categories.title AS category FROM auctions",
        schema="id LONG, seller LONG, reserve LONG, category INT",
        lookup={"persons": "seller", "categories": "category"},
    )
    pipeline.pop("key")  # records without a key
    pipeline["sources"]["categories"] = {"topics": ["categories"], "schema": "title STRING"}
    persons = [person(1, "ann"), person(2, "bob")]
    categories = [("10", {"title": "books"}), ("11", {"title": "toys"}), ("11", None)]
    auctions = [
        {"id": 1, "seller": 1, "reserve": 5, "category": 10},
        {"id": 2, "seller": 2, "reserve": 5, "category": 11},
        {"id": 3, "seller": 3, "reserve": 5, "category": 10},
    ]
    published = onceflow_run(
        pipeline, {"persons": persons, "categories": categories, "auctions": auctions}
    )
    expected = [
        {"id": 1, "name": "ann", "category": "books"},
        {"id": 2, "name": "bob"},  # category 11 deleted
        {"id": 3, "category": "books"},  # seller 3 never in the table
    ]
    assert_published(published.results, expected, key=lambda r: r["id"])
