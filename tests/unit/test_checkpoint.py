"""What the checkpoint module decides about Spark's side of the checkpoint."""

from __future__ import annotations

import json

from onceflow.connectors.checkpoint import LOCAL_FILE_MANAGER, CheckpointDir

MANAGER = "spark.sql.streaming.checkpointFileManagerClass"


def test_a_local_checkpoint_is_written_without_fileContexts_forked_link_look_ups(tmp_path):
    """Hadoop's FileContext rename on a local disk is no more atomic than a check and a
    rename, and forks `readlink` 8 times per checkpoint file; the FileSystem-based manager
    does the same check without them."""
    for location in (str(tmp_path), f"file:{tmp_path}", f"file://{tmp_path}"):
        assert CheckpointDir(location).spark_conf() == {MANAGER: LOCAL_FILE_MANAGER}, location
    assert LOCAL_FILE_MANAGER.endswith(".checkpointing.FileSystemBasedCheckpointFileManager")


def test_a_checkpoint_on_a_distributed_file_system_keeps_sparks_default_manager():
    """On HDFS a FileContext rename is atomic; on object stores Spark picks its own."""
    for location in ("hdfs://namenode/checkpoints/app", "s3a://bucket/checkpoints/app"):
        assert CheckpointDir(location).spark_conf() == {}, location


def test_each_input_keeps_its_own_initial_offsets(tmp_path):
    """Two inputs of one query share the checkpoint: the second must never start from the
    first one's offsets (another topic's), and a single input keeps the file it always had."""
    checkpoint = CheckpointDir(tmp_path)
    checkpoint.save_initial_offsets({"persons": {"0": 5}}, "persons")
    assert checkpoint.initial_offsets("auctions") is None
    checkpoint.save_initial_offsets({"auctions": {"0": 7}}, "auctions")
    assert checkpoint.initial_offsets("persons") == {"persons": {"0": 5}}
    assert checkpoint.initial_offsets("auctions") == {"auctions": {"0": 7}}
    checkpoint.save_initial_offsets({"clicks": {"0": 1}})
    assert (tmp_path / "onceflow-initial-offsets.json").exists()
    assert checkpoint.initial_offsets("input") == {"clicks": {"0": 1}}


def test_two_inputs_stage_their_side_records_apart(tmp_path):
    """The inputs of a join are read in stages of their own, whose task numbers overlap:
    task 0 of each stages its dead letters, and both are published."""
    from onceflow.connectors import staging
    from onceflow.connectors.checkpoint import BatchPlan
    from onceflow.connectors.records import side_record

    checkpoint = CheckpointDir(tmp_path)
    plan = BatchPlan(0, [{}, {}], 0, "f" * 16)
    for source, topic in (("persons", "p"), ("auctions", "a")):
        record = side_record("dlq", None, b"bad", [], f"{topic}/0/7", "not valid JSON")
        staging.stage(checkpoint, plan, source, 0, [record])
    tables = staging.staged_tables(checkpoint, plan)
    assert sorted(t.column("source").to_pylist()[0] for t in tables) == ["a/0/7", "p/0/7"]


def test_writers_with_one_pid_replace_a_file_whole(tmp_path):
    """Two hosts' containers sharing a checkpoint volume may both run onceflow as pid 1; their
    writes of one file (threads of this process here: one pid) must not share a temporary
    file, which would fail a rename or leave a torn file that reads as no claim at all."""
    import threading

    from onceflow.connectors.checkpoint import write_atomically

    target = tmp_path / "claim.json"
    contents = [json.dumps({"writer": w, "pad": "x" * (w + 1) * 50_000}).encode() for w in (0, 1)]
    errors: list[BaseException] = []
    torn: list[bytes] = []

    def write(data: bytes) -> None:
        try:
            for _ in range(100):
                write_atomically(target, data)
                read = target.read_bytes()
                if read not in contents:
                    torn.append(read[:40])
        except BaseException as exc:  # reported below
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(data,)) for data in contents]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert not errors and not torn, (errors[:1], torn[:1])
    assert not [p.name for p in tmp_path.iterdir() if p.name != "claim.json"]


def test_lost_offsets_add_up_per_partition_in_the_format_earlier_builds_wrote(tmp_path):
    checkpoint = CheckpointDir(str(tmp_path))
    (tmp_path / "onceflow-source-stats.json").write_text(json.dumps({"a.b-c/0": 5}))
    checkpoint.add_source_data_loss("a.b-c", 0, 2)
    checkpoint.add_source_data_loss("a.b-c", 1, 3)
    assert checkpoint.source_stats() == {("a.b-c", 0): 7, ("a.b-c", 1): 3}
    kept = json.loads((tmp_path / "onceflow-source-stats.json").read_text())
    assert kept == {"a.b-c/0": 7, "a.b-c/1": 3}
