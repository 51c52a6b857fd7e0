"""`sql:` pipelines over named inputs (`sources:`), against a real broker and Spark.

Each test computes what it expects from its own records, independently of Spark, and
compares multisets: a join row published twice fails.
"""

from __future__ import annotations

import pytest

from onceflow import cli
from onceflow.testing import assert_published

pytestmark = pytest.mark.integration

T0 = 1_700_000_000_000  # a 10 s window boundary
PERSON = "id LONG, name STRING, dateTime LONG"
AUCTION = "id LONG, seller LONG, reserve LONG, dateTime LONG"


def join_pipeline(sql: str, key: str | None = "seller") -> dict:
    """Nexmark's persons and auctions as two inputs, each with a one-minute watermark."""
    event_time = {"field": "dateTime", "watermark_delay": "1m"}
    pipeline = {
        "app_id": "sql-join",
        "sources": {
            "persons": {
                "topics": ["persons"],
                "schema": PERSON,
                "event_time": event_time,
                "max_records_per_batch": 10,
            },
            "auctions": {
                "topics": ["auctions"],
                "schema": AUCTION,
                "event_time": event_time,
                "max_records_per_batch": 10,
            },
        },
        "sql": sql,
        "sink": {"topic": "out", "dead_letter_topic": "dlq", "late_topic": "late"},
        "checkpoint": {"location": "unused"},
    }
    if key:
        pipeline["key"] = key
    return pipeline


INTERVAL_JOIN = """
    SELECT a.seller, p.name, a.id AS auction, a.reserve
    FROM persons p JOIN auctions a
      ON p.id = a.seller
     AND a.event_time BETWEEN p.event_time AND p.event_time + INTERVAL 10 SECONDS
"""


def test_a_stream_stream_join_publishes_each_pair_once_and_routes_bad_and_late_records(
    onceflow_run,
):
    persons = [{"id": i, "name": f"p{i}", "dateTime": T0 + i * 1_000} for i in range(25)]
    auctions = [
        {"id": 100 + j, "seller": j % 30, "reserve": j, "dateTime": T0 + (j % 30) * 1_000 + d}
        for j, d in ((j, (j * 3_700) % 14_000) for j in range(40))
    ]
    late_person = {"id": 3, "name": "too-late", "dateTime": T0 - 600_000}
    published = onceflow_run(
        join_pipeline(INTERVAL_JOIN),
        {
            # the late person comes after a whole batch's worth: the watermark has moved
            "persons": [*persons, b'{"id": "x"', late_person],
            "auctions": [*auctions, {"id": 999, "seller": 1, "reserve": None}],
        },
    )
    expected = [
        {"seller": a["seller"], "name": p["name"], "auction": a["id"], "reserve": a["reserve"]}
        for p in persons
        for a in auctions
        if p["id"] == a["seller"] and p["dateTime"] <= a["dateTime"] <= p["dateTime"] + 10_000
    ]
    assert len(expected) > 10  # the records above must make a real join
    assert_published(published.results, expected, key=lambda r: (r["seller"], r["auction"]))
    reasons = sorted(d.reason for d in published.dead_letters)
    assert len(reasons) == 2, reasons
    assert reasons[0].startswith("event time field 'dateTime' is missing or null"), reasons
    assert "not valid JSON" in reasons[1], reasons
    assert published.late == [late_person]


def test_a_sql_window_over_one_source_counts_and_routes_late_records(onceflow_run):
    pipeline = {
        "app_id": "sql-window",
        "source": {
            "topics": ["clicks"],
            "schema": "user STRING, ts LONG",
            "max_records_per_batch": 4,
        },
        "event_time": {"field": "ts", "watermark_delay": "5s"},
        "sql": """
            SELECT user, unix_millis(window.start) AS window_start, count(*) AS clicks
            FROM input GROUP BY window(event_time, '10 seconds'), user
        """,
        "key": "user",
        "sink": {"topic": "out", "late_topic": "late"},
        "checkpoint": {"location": "unused"},
    }
    clicks = [{"user": u, "ts": T0 + t} for u, t in [("a", 0), ("b", 1_000), ("a", 9_000)]]
    clicks += [{"user": "a", "ts": T0 + 12_000}, {"user": "c", "ts": T0 + 31_000}]
    # Two batches' worth: the watermark moves to T0 + 27 s, and the batch after that drops
    # rows at or before it (Spark's watermark for late rows is the previous batch's).
    clicks += [{"user": "f", "ts": T0 + 32_000}] * 4 + [{"user": "g", "ts": T0 + 33_000}] * 4
    clicks += [{"user": "a", "ts": T0 + 5_000}]  # behind that watermark: late
    clicks += [{"user": "z", "ts": T0 + 60_000}] * 4  # close the windows above
    published = onceflow_run(pipeline, clicks)
    assert_published(
        published.results,
        [
            {"user": "a", "window_start": T0, "clicks": 2},
            {"user": "b", "window_start": T0, "clicks": 1},
            {"user": "a", "window_start": T0 + 10_000, "clicks": 1},
            {"user": "c", "window_start": T0 + 30_000, "clicks": 1},
            {"user": "f", "window_start": T0 + 30_000, "clicks": 4},
            {"user": "g", "window_start": T0 + 30_000, "clicks": 4},
        ],
        key=lambda r: (r["user"], r["window_start"]),
    )
    assert published.late == [{"user": "a", "ts": T0 + 5_000}]


@pytest.mark.parametrize(
    ("sql", "words"),
    [
        ("SELECT seller FROM auctions WHERE seller =", "sql: Spark refuses the query: [PARSE"),
        ("SELECT sellr FROM auctions", "sql: Spark refuses the query: [UNRESOLVED_COLUMN"),
        # Spark refuses at start what it cannot emit once in append mode: validate says so now
        (
            "SELECT seller, count(*) AS n FROM auctions GROUP BY seller",
            "sql: Spark refuses the query: [STREAMING_OUTPUT_MODE.UNSUPPORTED",
        ),
        ("SELECT seller FROM auctions", "sources.persons: is not read by the sql query"),
        (
            "SELECT a.seller FROM auctions a JOIN auctions b ON a.id = b.id "
            "JOIN persons p ON p.id = a.seller",
            "sql: reads input(s) ['auctions'] more than once",
        ),
        (  # Spark's WATERMARK clause: Spark would drop rows the router never saw as late
            "SELECT a.seller FROM persons p JOIN auctions "
            "WATERMARK event_time DELAY OF INTERVAL 1 SECOND a ON p.id = a.seller "
            "AND a.event_time BETWEEN p.event_time AND p.event_time + INTERVAL 10 SECONDS",
            "sql: sets a watermark of its own (WATERMARK)",
        ),
        (  # the same self-join through a common table expression
            "WITH a2 AS (SELECT * FROM auctions) SELECT a.seller FROM a2 a JOIN a2 b "
            "ON a.id = b.id JOIN persons p ON p.id = a.seller",
            "sql: reads input(s) ['auctions'] more than once",
        ),
        (
            "SELECT p.id, a.id FROM persons p JOIN auctions a ON p.id = a.seller",
            "several columns named ['id']",
        ),
        (
            "SELECT p.name, a.seller, a.id AS NAME FROM persons p JOIN auctions a "
            "ON p.id = a.seller",
            "several columns named ['NAME', 'name']",
        ),
    ],
)
def test_validate_refuses_a_query_that_cannot_run_with_exit_2(tmp_path, capsys, sql, words):
    import yaml

    file = tmp_path / "pipeline.yaml"
    pipeline = join_pipeline(sql, key=None)
    pipeline["kafka"] = {"bootstrap_servers": "127.0.0.1:1"}  # never contacted
    file.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    assert cli.main(["validate", str(file)]) == 2
    error = capsys.readouterr().err
    assert words in error, error


@pytest.mark.parametrize(
    "sql",
    [
        INTERVAL_JOIN,
        # a common table expression read once is one scan, inlined or not
        "WITH sellers AS (SELECT id, name, event_time FROM persons) "
        + INTERVAL_JOIN.replace("FROM persons p", "FROM sellers p"),
        # one never read is no scan and no watermark of its own (Spark drops it)
        "WITH unused AS (SELECT * FROM auctions) " + INTERVAL_JOIN,
    ],
)
def test_validate_accepts_a_join_and_names_its_inputs(tmp_path, capsys, sql):
    import yaml

    file = tmp_path / "pipeline.yaml"
    pipeline = join_pipeline(sql)
    pipeline["kafka"] = {"bootstrap_servers": "127.0.0.1:1"}
    file.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    assert cli.main(["validate", str(file)]) == 0
    assert "ok (sql pipeline 'sql-join', persons, auctions -> out)" in capsys.readouterr().out


def test_validate_refuses_result_columns_avro_cannot_name(tmp_path, capsys):
    import yaml

    file = tmp_path / "pipeline.yaml"
    pipeline = join_pipeline(
        "SELECT p.id + 1, a.seller FROM persons p JOIN auctions a ON p.id = a.seller"
    )
    pipeline["kafka"] = {"bootstrap_servers": "127.0.0.1:1"}
    pipeline["sink"]["format"] = "avro"
    file.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    assert cli.main(["validate", str(file)]) == 2
    assert "result columns ['(id + 1)'] are not Avro field names" in capsys.readouterr().err
