"""docker-compose.yml cannot drift from the code: its env, ports, volumes and health checks are
checked against the service's own config schema (no Docker engine needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from onceflow.config import apply_env_overrides, parse
from onceflow.local_kafka import KAFKA_VERSION
from tests.conftest import KAFKA_CONTAINER_ENV

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def onceflow_config():
    service = SERVICES["onceflow"]
    mount = next(v for v in service["volumes"] if v.endswith(":/etc/onceflow/pipeline.yaml:ro"))
    raw = yaml.safe_load((REPO / mount.split(":")[0]).read_text())
    apply_env_overrides(raw, service["environment"])
    return parse(raw)


def test_the_onceflow_service_runs_a_valid_pipeline_with_the_compose_environment():
    config = onceflow_config()
    assert config.bootstrap_servers == "kafka:9092"
    assert all(k.startswith("ONCEFLOW_") and "__" in k for k in SERVICES["onceflow"]["environment"])


def test_metrics_port_health_check_and_checkpoint_volume_match_the_pipeline():
    config = onceflow_config()
    service = SERVICES["onceflow"]
    assert f"{config.metrics_port}:{config.metrics_port}" in service["ports"]
    assert f"127.0.0.1:{config.metrics_port}/healthz" in " ".join(service["healthcheck"]["test"])
    dockerfile = (REPO / "deploy/Dockerfile").read_text()
    assert f"127.0.0.1:{config.metrics_port}/healthz" in dockerfile
    assert re.search(r"^USER (?!root)\w+", dockerfile, re.M), "the image must not run as root"
    named = {v.split(":")[0]: v.split(":")[1] for v in service["volumes"] if not v.startswith(".")}
    assert any(config.checkpoint_location.startswith(path) for path in named.values())
    assert set(named) <= set(COMPOSE["volumes"])


def test_kafka_runs_the_tested_version_with_single_node_transaction_settings():
    kafka = SERVICES["kafka"]
    assert kafka["image"] == f"apache/kafka:{KAFKA_VERSION}"
    env = {k: str(v) for k, v in kafka["environment"].items()}
    assert {k: env[k] for k in KAFKA_CONTAINER_ENV} == KAFKA_CONTAINER_ENV
    assert "kafka-data" in " ".join(kafka["volumes"])


def test_topics_the_pipeline_needs_are_created_by_the_init_step():
    config = onceflow_config()
    script = " ".join(SERVICES["topics"]["command"])
    for topic in [
        *config.source.topics,
        config.sink.topic,
        config.sink.dead_letter_topic,
        config.sink.late_topic,
    ]:
        assert f"{topic}:" in script


def test_prometheus_scrapes_onceflow_and_grafana_has_the_dashboard():
    config = onceflow_config()
    scrape = yaml.safe_load((REPO / "deploy/prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"onceflow:{config.metrics_port}"]
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/onceflow.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (
        "onceflow_input_records_total",
        "onceflow_source_lag_records",
        "onceflow_watermark_lag_seconds",
        "onceflow_epoch_duration_seconds_bucket",
        "onceflow_transactions_total",
    ):
        assert metric in exprs


def test_every_series_the_dashboard_uses_exists():
    from onceflow.metrics import PipelineMetrics

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    names = {
        family.name + suffix
        for family in PipelineMetrics("x").registry.collect()
        for suffix in suffixes[family.type]
    }
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/onceflow.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    assert set(re.findall(r"onceflow_\w+", exprs)) <= names
