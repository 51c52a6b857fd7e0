"""Prometheus metrics and health for a running pipeline, served from the driver process.

Spark's StreamingQueryListener feeds the engine's view (rows, epoch phases, watermark,
state, source offsets); the sink's phase 2 runs in a Spark-managed Python process of its own,
so it leaves its counters in a small JSON file in the checkpoint (sink_stats.py), which the
listener reads after every epoch; so does the source for offsets lost to data loss.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import datetime
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from pyspark.sql.streaming import StreamingQueryListener

from onceflow.connectors import errors, kafka_clients, offsets
from onceflow.connectors.checkpoint import CheckpointDir

log = logging.getLogger("onceflow.metrics")

STALL_TIMEOUT_S = 300.0
LAG_PROBE_INTERVAL_S = 2.0
EPOCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)


class PipelineMetrics:
    """Every metric of one app, in a registry of its own."""

    def __init__(self, app_id: str) -> None:
        self.app_id = app_id
        self.registry = CollectorRegistry()
        r, app = self.registry, ["app"]
        self.input_records = Counter(
            "onceflow_input_records", "Records read from Kafka", app, registry=r
        )
        self.input_bytes = Counter(
            "onceflow_input_bytes", "Key and value bytes read from Kafka", app, registry=r
        )
        self.data_loss = Counter(
            "onceflow_source_data_loss_offsets",
            "Offsets deleted before they were read, skipped with fail_on_data_loss: false",
            [*app, "topic", "partition"],
            registry=r,
        )
        self.output_records = Counter(
            "onceflow_output_records",
            "Records published, by kind (result, late, dead_letter) and to no topic (dropped_*)",
            [*app, "kind"],
            registry=r,
        )
        self.epoch_seconds = Histogram(
            "onceflow_epoch_duration_seconds",
            "Wall time of a micro-batch (epoch)",
            app,
            buckets=EPOCH_BUCKETS,
            registry=r,
        )
        self.phase_seconds = Histogram(
            "onceflow_epoch_phase_duration_seconds",
            "Epoch phases: plan (offsets, WAL), process (read, compute, prepare), commit",
            [*app, "phase"],
            buckets=EPOCH_BUCKETS,
            registry=r,
        )
        self.last_batch = Gauge(
            "onceflow_last_committed_batch_id", "Last epoch published by the sink", app, registry=r
        )
        self.transactions = Counter(
            "onceflow_transactions", "Kafka transactions of the sink", [*app, "outcome"], registry=r
        )
        self.replays_skipped = Counter(
            "onceflow_replays_skipped", "Replayed epochs found already published", app, registry=r
        )
        self.commit_seconds = Histogram(
            "onceflow_commit_duration_seconds",
            "Phase 2: one epoch's Kafka transaction",
            app,
            buckets=EPOCH_BUCKETS,
            registry=r,
        )
        self.source_lag = Gauge(
            "onceflow_source_lag_records",
            "Readable offsets not yet processed",
            [*app, "topic", "partition"],
            registry=r,
        )
        self.watermark = Gauge(
            "onceflow_watermark_seconds", "Event-time watermark (Unix time)", app, registry=r
        )
        self.watermark_lag = Gauge(
            "onceflow_watermark_lag_seconds", "Wall clock minus the watermark", app, registry=r
        )
        self.state_rows = Gauge("onceflow_state_rows", "Rows in the state store", app, registry=r)
        self.state_bytes = Gauge(
            "onceflow_state_memory_bytes", "State store memory", app, registry=r
        )
        self.dropped_by_watermark = Counter(
            "onceflow_rows_dropped_by_watermark",
            "Rows Spark dropped as late (should stay 0: onceflow routes late rows out first)",
            app,
            registry=r,
        )
        self.restarts = Counter(
            "onceflow_restarts", "Starts from an existing checkpoint", app, registry=r
        )
        self.fenced = Counter(
            "onceflow_fenced", "Times this instance was fenced by another", app, registry=r
        )
        self.up = Gauge("onceflow_up", "1 while the query runs", app, registry=r)


class PipelineListener(StreamingQueryListener):
    """Feeds PipelineMetrics from Spark's query events; keeps what /healthz needs."""

    def __init__(self, metrics: PipelineMetrics, checkpoint: str, input_bytes=None) -> None:
        self.metrics = metrics
        self.checkpoint = CheckpointDir(checkpoint)
        self.input_bytes = input_bytes  # a Spark accumulator the reading tasks add to
        self.bytes_seen = 0
        self.data_loss_seen = self.checkpoint.source_stats()  # before this process started
        self.last_event = time.monotonic()
        self.ready = False
        self.failure: str | None = None
        self.previous_stats: dict = {}
        self.lock = threading.Lock()
        self.processed_ends: dict[tuple[str, int], int] = {}  # end offsets of the last epoch
        self.watermark_s = 0.0
        self.standby = False  # a standby waiting for the checkpoint's lease

    def onQueryStarted(self, event) -> None:
        self.metrics.up.labels(self.metrics.app_id).set(1)
        with self.lock:
            self.last_event = time.monotonic()
            self.failure = None  # the runner starts a query again after a start it missed

    def onQueryIdle(self, event) -> None:
        with self.lock:
            self.last_event = time.monotonic()
            self.ready = True  # started and caught up, nothing to do

    def onQueryTerminated(self, event) -> None:
        self.metrics.up.labels(self.metrics.app_id).set(0)
        if event.exception:
            self.failure = event.exception.splitlines()[0]
            if isinstance(errors.from_text(event.exception), errors.FencedError):
                self.metrics.fenced.labels(self.metrics.app_id).inc()

    def onQueryProgress(self, event) -> None:
        try:
            self._record(event.progress)
        except Exception:  # metrics must never take the pipeline down
            log.exception("could not record query progress")

    def _record(self, progress) -> None:
        m, app = self.metrics, self.metrics.app_id
        with self.lock:
            self.last_event = time.monotonic()
            self.ready = True
        m.input_records.labels(app).inc(progress.numInputRows)
        if self.input_bytes is not None:
            total = self.input_bytes.value
            m.input_bytes.labels(app).inc(total - self.bytes_seen)
            self.bytes_seen = total
        lost = self.checkpoint.source_stats()
        for (topic, partition), count in lost.items():
            seen = self.data_loss_seen.get((topic, partition), 0)
            m.data_loss.labels(app, topic, str(partition)).inc(count - seen)
        self.data_loss_seen = lost
        durations = progress.durationMs or {}
        plan_ms = sum(durations.get(k, 0) for k in ("latestOffset", "queryPlanning", "walCommit"))
        process_ms, commit_ms = durations.get("addBatch", 0), durations.get("commitOffsets", 0)
        log.info(
            "epoch %d done: %d records in %d ms (plan %d, process %d, commit %d)",
            progress.batchId,
            progress.numInputRows,
            progress.batchDuration,
            plan_ms,
            process_ms,
            commit_ms,
            extra={
                "app": app,
                "batch_id": progress.batchId,
                "input_records": progress.numInputRows,
                "duration_ms": progress.batchDuration,
                "phases_ms": dict(durations),
                "offsets": {_input_name(s): s.endOffset for s in progress.sources},
            },
        )
        m.epoch_seconds.labels(app).observe(progress.batchDuration / 1000)
        m.phase_seconds.labels(app, "plan").observe(plan_ms / 1000)
        m.phase_seconds.labels(app, "process").observe(process_ms / 1000)
        m.phase_seconds.labels(app, "commit").observe(commit_ms / 1000)
        processed_ends: dict[tuple[str, int], int] = {}
        for source in progress.sources:
            ends = _positions(source.endOffset)
            _lag(m, app, ends, _positions(source.latestOffset))
            processed_ends |= ends
        self.processed_ends = processed_ends  # the lag probe reads it from its thread
        watermark = (progress.eventTime or {}).get("watermark")
        seconds = (
            datetime.fromisoformat(watermark.replace("Z", "+00:00")).timestamp() if watermark else 0
        )
        if seconds > 0:  # Spark reports the epoch (1970) until the first event time is seen
            m.watermark.labels(app).set(seconds)
            self.watermark_s = seconds
            m.watermark_lag.labels(app).set(max(0.0, time.time() - seconds))
        operators = progress.stateOperators or []
        m.state_rows.labels(app).set(sum(op.numRowsTotal for op in operators))
        m.state_bytes.labels(app).set(sum(op.memoryUsedBytes for op in operators))
        m.dropped_by_watermark.labels(app).inc(
            sum(op.numRowsDroppedByWatermark for op in operators)
        )
        self._record_sink()

    def _record_sink(self) -> None:
        stats = self.checkpoint.sink_stats()
        if not stats:
            return
        m, app, before = self.metrics, self.metrics.app_id, self.previous_stats
        if stats.get("pid") != before.get("pid"):
            before = {}  # a new sink process started its counters at zero
        for kind, count in stats["records"].items():
            m.output_records.labels(app, kind).inc(count - before.get("records", {}).get(kind, 0))
        for outcome in ("committed", "aborted"):
            key = f"transactions_{outcome}"
            m.transactions.labels(app, outcome).inc(stats[key] - before.get(key, 0))
        m.replays_skipped.labels(app).inc(
            stats["replays_skipped"] - before.get("replays_skipped", 0)
        )
        if stats["transactions_committed"] > before.get("transactions_committed", 0):
            m.commit_seconds.labels(app).observe(stats["last_commit_seconds"])
        m.last_batch.labels(app).set(stats["last_committed_batch"])
        self.previous_stats = stats

    def health(self, stall_timeout_s: float) -> tuple[bool, str]:
        with self.lock:
            if self.failure:
                return False, f"query failed: {self.failure}"
            if self.standby:
                return True, "standby: waiting for the active instance's lease"
            if not self.ready:
                return False, "starting: no epoch has completed yet"
            idle = time.monotonic() - self.last_event
            if idle > stall_timeout_s:
                return False, f"no progress for {idle:.0f}s"
            return True, "ok"


def _input_name(source) -> str:
    """A source of the progress by its input's name (named inputs write it into their
    offsets), else by Spark's description, as a query's only input always was."""
    try:
        name = offsets.input_of(json.loads(source.endOffset or "{}"))
    except (TypeError, ValueError, AttributeError):
        name = None
    return name or source.description


def _positions(reported: str | None) -> dict[tuple[str, int], int]:
    """The offsets of a source's progress. PySpark turns an offset Spark did not report into
    the string "None": a batch replayed after a restart has no latest offset."""
    if reported in (None, "", "None", "null"):
        return {}
    return offsets.positions(json.loads(reported))


def _lag(
    metrics: PipelineMetrics,
    app: str,
    ends: dict[tuple[str, int], int],
    latest: dict[tuple[str, int], int],
) -> None:
    for (topic, partition), offset in latest.items():
        done = ends.get((topic, partition), 0)
        metrics.source_lag.labels(app, topic, str(partition)).set(max(0, offset - done))


def probe_lag(
    metrics: PipelineMetrics, listener: PipelineListener, kafka_conf: dict[str, str]
) -> threading.Event:
    """Refresh source lag (from the broker's last stable offsets) and watermark lag every
    LAG_PROBE_INTERVAL_S.

    Progress events only know the offsets seen when an epoch was planned, so a long epoch
    would hide the backlog growing behind it. Set the returned event to stop probing.
    """
    stop = threading.Event()

    def probe() -> None:
        while not stop.wait(LAG_PROBE_INTERVAL_S):
            if listener.watermark_s:
                lag_s = max(0.0, time.time() - listener.watermark_s)
                metrics.watermark_lag.labels(metrics.app_id).set(lag_s)
            processed = dict(listener.processed_ends)
            if not processed:
                continue
            try:
                stable = kafka_clients.stable_ends(kafka_conf, list(processed))
            except Exception as exc:  # the broker may be away; the next probe tries again
                log.debug("lag probe failed: %s", exc)
                continue
            for (topic, partition), end in stable.items():
                lag = max(0, end - processed[(topic, partition)])
                metrics.source_lag.labels(metrics.app_id, topic, str(partition)).set(lag)

    threading.Thread(target=probe, daemon=True, name="lag-probe").start()
    return stop


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


def serve(
    metrics: PipelineMetrics,
    listener: PipelineListener,
    port: int,
    stall_timeout_s: float = STALL_TIMEOUT_S,
) -> WSGIServer:
    """Serve /metrics and /healthz on `port` (0: any free port) in a daemon thread."""
    prometheus = make_wsgi_app(metrics.registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") == "/healthz":
            healthy, reason = listener.health(stall_timeout_s)
            status = "200 OK" if healthy else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [reason.encode() + b"\n"]
        return prometheus(environ, start_response)

    # One thread per request: a slow scrape never holds up /healthz.
    server = make_server(
        "0.0.0.0", port, app, server_class=ThreadingWSGIServer, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server
