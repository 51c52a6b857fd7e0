"""A Hadoop local file system that sets file permissions without starting `chmod`.

Spark writes every checkpoint file (each epoch's offset and commit log entries, each state
partition's changelog) through Hadoop's local file system. Without Hadoop's native library,
which PySpark does not ship, that file system starts a `chmod` process for every file it
creates and for its checksum file: eight process starts per epoch of a windowed pipeline,
most of them on the epoch's path. `NoForkLocalFileSystem.java` makes the same change with a
system call. `make setup` and the image build compile it into a jar beside the Python
environment (`python -m onceflow.local_fs`); a pipeline on a local master then uses it for
`file:` paths. Without a JDK there is no jar and Hadoop's own is used: that costs only speed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

CLASS_NAME = "onceflow.hadoop.NoForkLocalFileSystem"
SOURCE = Path(__file__).with_name("NoForkLocalFileSystem.java")
FILE_SYSTEM_SETTING = "spark.hadoop.fs.file.impl"
CLASS_PATH_VARIABLE = "SPARK_DIST_CLASSPATH"  # appended to the JVM's class path by Spark's launcher


def jar_path() -> Path:
    """Where the jar of this installation lives (beside the Python environment)."""
    return Path(sys.prefix) / "share" / "onceflow" / "onceflow-local-fs.jar"


def spark_conf(master: str, conf: Mapping[str, str]) -> dict[str, str]:
    """The setting that uses the jar: for a local master (a cluster's executors have no such
    jar), when the jar is built and the pipeline chose no file system of its own."""
    local = master.strip() == "local" or master.strip().startswith("local[")
    if not local or FILE_SYSTEM_SETTING in conf or not jar_path().is_file():
        return {}
    return {FILE_SYSTEM_SETTING: CLASS_NAME}


@contextlib.contextmanager
def on_class_path(used: bool):
    """The jar is on the class path of a JVM started inside (when `used`), after Spark's own
    jars, so that the class archive recorded with it still matches. Restored after."""
    before = os.environ.get(CLASS_PATH_VARIABLE)
    if used:
        os.environ[CLASS_PATH_VARIABLE] = os.pathsep.join(filter(None, (before, str(jar_path()))))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CLASS_PATH_VARIABLE, None)
        else:
            os.environ[CLASS_PATH_VARIABLE] = before


def build(jar: Path) -> None:
    """Compile the file system against the Hadoop API that PySpark ships, into `jar`."""
    import pyspark

    hadoop_api = sorted((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"))
    javac, jar_tool = _jdk_tool("javac"), _jdk_tool("jar")
    if not hadoop_api:
        raise RuntimeError("PySpark's jars hold no hadoop-client-api jar")
    jar.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="onceflow-local-fs-") as work:
        classes = Path(work) / "classes"
        compile_it = [javac, "--release", "17", "-d", str(classes), "-cp", str(hadoop_api[-1])]
        subprocess.run([*compile_it, str(SOURCE)], check=True)
        partial = Path(work) / jar.name
        subprocess.run([jar_tool, "cf", str(partial), "-C", str(classes), "."], check=True)
        shutil.move(partial, jar)


def _jdk_tool(name: str) -> str:
    """`name` from the JDK whose `java` Spark runs (JAVA_HOME, else PATH)."""
    home = os.environ.get("JAVA_HOME")
    candidates = [Path(home) / "bin" / name] if home else []
    candidates += [Path(found)] if (found := shutil.which(name)) else []
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise RuntimeError(f"no `{name}`: a JDK builds the jar, a JRE runs without it")


def main() -> None:
    jar = jar_path()
    started = time.monotonic()
    try:
        build(jar)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        # Setup goes on: the jar only makes epochs faster.
        print(
            f"local file system: not built ({exc}); onceflow runs without it, each epoch a "
            "few ms slower. To try again: python -m onceflow.local_fs",
            file=sys.stderr,
        )
        return
    print(f"local file system: {jar} in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
