"""Running a pipeline: start the query, finish the current epoch on SIGTERM/SIGINT, exit cleanly."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

from pyspark.errors import StreamingQueryException
from pyspark.sql.streaming import StreamingQuery

from onceflow.connectors import errors, faults, staging
from onceflow.connectors.checkpoint import CheckpointDir

from . import pipeline
from .config import ConfigError, PipelineConfig
from .lease import acquire, check_standby, wait_for
from .metrics import PipelineListener, PipelineMetrics, probe_lag, serve
from .spark_session import build_session
from .warmup import start_warm_up

log = logging.getLogger("onceflow.run")

GRACEFUL_STOP_TIMEOUT_S = 300.0
START_RETRY_DELAY_S = 5.0
WARM_UP_WAIT_S = 60.0  # a standby's; it stands by without a warm-up that takes longer


class PipelineFailed(errors.OnceflowError):
    """The streaming query died; the message is the cause, without the JVM stack trace.

    `cause` is the onceflow error a Python worker raised, when it was one.
    """

    def __init__(self, message: str, cause: errors.OnceflowError | None = None) -> None:
        super().__init__(message)
        self.cause = cause


def run(
    config: PipelineConfig,
    available_now: bool = False,
    stop: threading.Event | None = None,
    standby: bool = False,
) -> None:
    """Run until the backlog is drained (available_now), SIGTERM/SIGINT or `stop` is set.

    A standby starts Spark and its Python processes, then waits for the checkpoint's lease
    and runs when the active instance's lease ends.
    Raises PipelineFailed when the query dies, and KeyboardInterrupt after a SIGINT (Ctrl-C),
    so that the CLI exits 130 as shells expect.
    """
    if standby:
        check_standby(config)
    lease = None if standby else acquire(config)  # a second instance is refused at once
    try:
        faults.watch_state_store_commits(config.checkpoint_location)
        checkpoint = CheckpointDir(config.checkpoint_location)
        conf = session_conf(config, checkpoint)
        spark = build_session(config.spark_master, f"onceflow-{config.app_id}", conf)
        metrics = PipelineMetrics(config.app_id)
        input_bytes = spark.sparkContext.accumulator(0)
        listener = PipelineListener(metrics, config.checkpoint_location, input_bytes)
        server = _serve_metrics(config, metrics, listener)
        spark.streams.addListener(listener)  # once nothing is left to fail: the session lives on
        lag_probe = probe_lag(metrics, listener, dict(config.kafka))
    except BaseException:
        if lease is not None:  # a caller in this process (the pytest plugin) lives on
            lease.release()
        raise
    stop = stop or threading.Event()
    handlers = {}
    received: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, on_signal)
    try:
        if standby:
            # Only a standby warms up: it has the time. Beside a starting query the warm-up
            # competes for the same cores and the restart took no less (bench/results).
            warm_up = start_warm_up(spark)
            deadline = time.monotonic() + WARM_UP_WAIT_S
            while warm_up.is_alive() and time.monotonic() < deadline and not stop.wait(0.2):
                pass
            listener.standby = True
            lease = wait_for(config, stop)
            listener.standby = False
            if lease is None:
                log.info("standby stopped before taking over")
                if signal.SIGINT in received:
                    raise KeyboardInterrupt
                return
            log.info("standby: took over checkpoint %s", config.checkpoint_location)
        if checkpoint.committed_batches():
            metrics.restarts.labels(config.app_id).inc()
        lost = lease.lost if lease is not None else threading.Event()
        query = _run_query(spark, config, available_now, input_bytes, stop, lost)
        if lost.is_set():
            query.stop()
            cause = lease.lost_error()
            raise PipelineFailed(errors.describe(cause), cause)
        if stop.is_set() and query.isActive:
            _stop_after_current_epoch(query)
        error = query.exception()
        interrupted = signal.SIGINT in received
        # A terminal's Ctrl-C also interrupts Spark's Python workers: the epoch they were in
        # fails with KeyboardInterrupt and is replayed on restart, as after any stop. Any
        # other failure is reported as such.
        if error is not None and not (interrupted and "KeyboardInterrupt" in str(error)):
            raise failure(str(error))
        if interrupted:
            raise KeyboardInterrupt
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if lease is not None:
            lease.release()
        _deliver_pending_events(spark)
        spark.streams.removeListener(listener)
        lag_probe.set()
        if server is not None:
            server.shutdown()
            server.server_close()


def session_conf(config: PipelineConfig, checkpoint: CheckpointDir) -> dict[str, str]:
    """The Spark settings a pipeline's session is built with; the user's own win."""
    return checkpoint.spark_conf() | _python_sockets(config) | config.spark_conf


def _python_sockets(config: PipelineConfig) -> dict[str, str]:
    """Spark's TCP for a pipeline whose epochs open socket servers in the JVM. Over Unix
    sockets Spark registers each such socket's path with Java's deleteOnExit, and the JVM
    keeps every path until it exits: the driver's heap would grow for as long as the
    pipeline runs (README, "Recovery"). They open in update mode (each batch goes to the
    driver), for each task of transformWithState (table lookups, perhaps a user's
    transform) and, without Spark's daemon, for every task. The other pipelines talk over
    Unix sockets (spark_session.python_socket_conf)."""
    update = config.window is not None and config.window.output_mode == "update"
    lookups = any(source.lookups for source in config.sources)
    no_daemon = config.spark_conf.get("spark.python.use.daemon", "true").lower() == "false"
    if update or lookups or config.transform is not None or no_daemon:
        return {"spark.python.unix.domain.socket.enabled": "false"}
    return {}


def _run_query(
    spark,
    config: PipelineConfig,
    available_now: bool,
    input_bytes,
    stop: threading.Event,
    lost: threading.Event,
) -> StreamingQuery:
    """Start the query and wait until it ends or `stop` or `lost` is set; start it again
    after a start it missed (`pipeline.missed_its_start`), up to START_ATTEMPTS starts."""
    for attempt in range(1, pipeline.START_ATTEMPTS + 1):
        staging.discard_uncommitted(CheckpointDir(config.checkpoint_location))
        query = pipeline.start(spark, config, available_now, input_bytes)
        log.info("query %s started (checkpoint %s)", config.app_id, config.checkpoint_location)
        with contextlib.suppress(StreamingQueryException):  # run() reports it, in one line
            while query.isActive and not stop.is_set() and not lost.is_set():
                query.awaitTermination(0.5)
        if not pipeline.missed_its_start(query) or lost.is_set():
            break
        if attempt == pipeline.START_ATTEMPTS or stop.is_set():
            raise PipelineFailed(_late_source_worker(attempt))
        log.warning(
            "Spark's Python source worker did not connect back within Spark's 10 s "
            "(start %d of %d); starting the query again in %.0f s",
            attempt,
            pipeline.START_ATTEMPTS,
            START_RETRY_DELAY_S,
        )
        with contextlib.suppress(StreamingQueryException):
            query.awaitTermination()  # Spark refuses a query id it has not yet forgotten
        if stop.wait(START_RETRY_DELAY_S):  # the late process may still be starting
            raise PipelineFailed(_late_source_worker(attempt))
    return query


def _deliver_pending_events(spark, timeout_ms: int = 10_000) -> None:
    """Let the listener see the last epochs' progress before the process exits: Spark
    delivers query events asynchronously, and a drained backlog ends the query at once."""
    try:
        spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty(timeout_ms)
    except Exception as exc:  # metrics only; never fail a finished run over them
        log.warning("some query events were not delivered before exit: %s", exc)


def _serve_metrics(config: PipelineConfig, metrics: PipelineMetrics, listener: PipelineListener):
    if config.metrics_port is None:
        return None
    try:
        server = serve(metrics, listener, config.metrics_port, config.stall_timeout_ms / 1000)
    except OSError as exc:
        raise ConfigError(
            "metrics.port",
            f"cannot listen on port {config.metrics_port} ({exc.strerror}); pick a free port "
            "(0 picks any)",
        ) from None
    port = server.server_port
    log.info(
        "metrics on http://127.0.0.1:%d/metrics, health on http://127.0.0.1:%d/healthz", port, port
    )
    return server


def _stop_after_current_epoch(query) -> None:
    """Let the running epoch commit, then stop.

    Waiting for an idle trigger is not enough: with a backlog the next epoch starts at once,
    and the service would go on for epoch after epoch. So wait
    for the running epoch's progress; an epoch that began meanwhile is interrupted by the stop
    and replayed from the offset log on restart, as after any stop. The epoch is named by
    number: the "epoch N done" lines come from the listener, asynchronously, and may be
    logged after this one although the epoch finished before.
    """
    last = query.lastProgress
    done = last.batchId if last else -1
    log.info("stop requested: finishing epoch %d", done + 1)
    deadline = time.monotonic() + GRACEFUL_STOP_TIMEOUT_S
    while query.status.get("isTriggerActive") and time.monotonic() < deadline:
        last = query.lastProgress
        if last and last.batchId > done:
            break
        time.sleep(0.02)
    query.stop()
    last = query.lastProgress
    log.info("stopped after epoch %d", last.batchId if last else -1)


def _late_source_worker(attempts: int) -> str:
    return (
        f"Spark's Python source worker did not connect back within Spark's 10 s ({attempts} "
        f"of {pipeline.START_ATTEMPTS} starts): the machine is short of CPU; give the service "
        "more cores or run less beside it, then start it again"
    )


def failure(error_text: str) -> PipelineFailed:
    """The query's failure as one line: the onceflow error inside the StreamingQueryException
    (typed, as `cause`), or the exception's first line."""
    cause = errors.from_text(error_text)
    if cause is not None:
        return PipelineFailed(errors.describe(cause), cause)
    lines = [line for line in error_text.splitlines() if line.strip()]
    if not lines:
        return PipelineFailed("the streaming query failed")
    first = lines[0]
    if first.endswith(PYTHON_TRACEBACK):  # Spark's words, then a Python worker's traceback
        raised = _raised_by_python(lines[1:])
        if raised is not None:
            first = first[: -len(PYTHON_TRACEBACK)] + raised
    return PipelineFailed(first)


PYTHON_TRACEBACK = "Traceback (most recent call last):"


def _raised_by_python(lines: list[str]) -> str | None:
    """The line naming the exception at the end of a Python traceback: the first unindented
    line after the last block of (indented) frames. Lines after it are more of its message
    or its notes; the JVM's own stack, after it all, starts with a tab or 'Caused by'."""
    raised, after_frames = None, True  # the first block's header ended the line before
    for line in lines:
        if line.startswith(("\tat ", "Caused by:")):
            break
        if line.startswith(PYTHON_TRACEBACK):  # a chained exception's block
            after_frames = True
        elif (
            after_frames
            and not line[0].isspace()
            and not line.startswith(("During handling of", "The above exception"))
        ):
            raised, after_frames = line, False
    return raised
