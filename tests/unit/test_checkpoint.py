"""What the checkpoint module decides about Spark's side of the checkpoint."""

from __future__ import annotations

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
