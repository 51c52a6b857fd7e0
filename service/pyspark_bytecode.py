"""Compiled bytecode inside pyspark.zip, so Spark's Python processes stop recompiling pyspark.

Spark puts `$SPARK_HOME/python/lib/pyspark.zip` first on its Python workers' path, and the
zip in pyspark's wheel holds sources only: every Python process Spark starts (the daemons,
the source runner, the sink's commit runner, the planners) compiles the pyspark modules it
imports again, and a restart starts several of them one after the other before its first
output. Python can import from a zip but never writes bytecode into one, so this adds it:
unchecked hash-based .pyc files (PEP 552) next to each module, which zipimport loads
without comparing timestamps. Run once after installing (`make setup`, the image build);
`python -m onceflow.pyspark_bytecode`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path


def pyspark_zip() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "python" / "lib" / "pyspark.zip"


def add_bytecode(archive: Path) -> int:
    """Rewrite `archive` with a .pyc beside every .py; returns how many it added (0 when
    they are there already). The new archive replaces the old one in a single rename."""
    with zipfile.ZipFile(archive) as source:
        names = set(source.namelist())
        missing = {
            n for n in names if n.endswith(".py") and n + "c" not in names and "/tests/" not in n
        }
        if not missing:
            return 0
        fd, tmp = tempfile.mkstemp(dir=archive.parent, suffix=".zip")
        os.close(fd)
        try:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as target:
                for info in source.infolist():
                    data = source.read(info)
                    target.writestr(info, data)
                    if info.filename in missing:
                        try:  # named as zipimport names a module it compiles itself
                            path = f"{archive}{os.sep}{info.filename}"
                            with warnings.catch_warnings():
                                warnings.simplefilter("ignore")
                                code = compile(data, path, "exec", dont_inherit=True)
                        except SyntaxError:  # left to fail, as before, only if imported
                            continue
                        pyc = importlib._bootstrap_external._code_to_hash_pyc(  # type: ignore[attr-defined]
                            code, importlib.util.source_hash(data), checked=False
                        )
                        compiled = zipfile.ZipInfo(info.filename + "c", info.date_time)
                        compiled.compress_type = zipfile.ZIP_DEFLATED
                        target.writestr(compiled, pyc)
            shutil.copymode(archive, tmp)
            os.replace(tmp, archive)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return len(missing)


def main() -> None:
    archive = pyspark_zip()
    if not archive.exists():
        print(f"no {archive}: nothing to do")
        return
    try:
        added = add_bytecode(archive)
    except OSError as exc:
        sys.exit(f"could not rewrite {archive} ({exc.strerror}); run this as its owner")
    print(f"{archive}: {added} modules compiled" if added else f"{archive}: already compiled")


if __name__ == "__main__":
    main()
