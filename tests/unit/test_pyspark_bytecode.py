"""Compiled bytecode in a zip on the path: modules load from it, tests are left out, and a
second run changes nothing."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from onceflow.pyspark_bytecode import add_bytecode


def test_modules_in_the_zip_are_imported_from_their_bytecode(tmp_path):
    archive = tmp_path / "lib.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/mod.py", "VALUE = 42\n")
        z.writestr("pkg/tests/test_mod.py", "")
    assert add_bytecode(archive) == 2
    assert add_bytecode(archive) == 0
    names = zipfile.ZipFile(archive).namelist()
    assert "pkg/mod.pyc" in names and "pkg/tests/test_mod.pyc" not in names
    loaded = subprocess.run(
        [sys.executable, "-c", "import pkg.mod as m; print(m.__file__, m.VALUE)"],
        env={"PYTHONPATH": str(archive)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.split() == [f"{archive}/pkg/mod.pyc", "42"]
