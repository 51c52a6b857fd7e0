"""The driver JVM's class archive: used when recorded, and setup goes on when it cannot be."""

from __future__ import annotations

import subprocess

from onceflow import class_archive


def test_the_driver_uses_the_archive_only_once_it_is_recorded(tmp_path, monkeypatch):
    archive = tmp_path / "spark-driver.jsa"
    monkeypatch.setattr(class_archive, "archive_path", lambda: archive)
    assert class_archive.driver_java_options() is None
    archive.write_bytes(b"archive")
    options = class_archive.driver_java_options()
    assert options is not None
    assert f"-XX:SharedArchiveFile={archive}" in options.split()
    assert "-Xshare:auto" in options.split()  # a stale archive is ignored, never fatal


def test_a_failed_recording_leaves_no_archive_and_says_how_to_try_again(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(class_archive.sys, "executable", "false")  # the recording run fails
    archive = tmp_path / "share" / "spark-driver.jsa"
    class_archive.main([str(archive)])
    assert not archive.exists()
    assert "python -m onceflow.class_archive" in capsys.readouterr().err


def test_a_recording_that_wrote_nothing_is_a_failure_not_an_empty_archive(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(class_archive.sys, "executable", "true")  # runs, writes nothing
    archive = tmp_path / "spark-driver.jsa"
    class_archive.main([str(archive)])
    assert not archive.exists()
    assert "wrote no class archive" in capsys.readouterr().err


def test_the_jvm_starts_quietly_with_an_archive_that_does_not_match(tmp_path, monkeypatch):
    """An archive of another JVM or Spark (after an upgrade) only costs the speed-up."""
    archive = tmp_path / "spark-driver.jsa"
    archive.write_bytes(b"not an archive of this JVM")
    monkeypatch.setattr(class_archive, "archive_path", lambda: archive)
    options = class_archive.driver_java_options()
    assert options is not None
    done = subprocess.run(["java", *options.split(), "-version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr.lower() and "error" not in done.stderr.lower()
