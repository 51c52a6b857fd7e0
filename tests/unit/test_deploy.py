"""docker-compose.yml and the image cannot drift from the code: the compose file is checked
against the Compose Specification's schema, and its env, ports, volumes and health checks
against the service's own config schema (no Docker engine needed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from onceflow.config import apply_env_overrides, parse
from onceflow.local_kafka import KAFKA_VERSION
from onceflow.local_registry import REGISTRY_VERSION, SETTINGS, environment, storage_settings
from onceflow.testing import KAFKA_CONTAINER_ENV

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def onceflow_config():
    service = SERVICES["onceflow"]
    mount = next(v for v in service["volumes"] if v.endswith(":/etc/onceflow/pipeline.yaml:ro"))
    return pipeline_config(REPO / mount.split(":")[0], service["environment"])


def pipeline_config(path: Path, environment: dict):
    """The pipeline file at `path` as a service with `environment` runs it."""
    raw = yaml.safe_load(path.read_text())
    apply_env_overrides(raw, {k: _unset(v) for k, v in environment.items()})
    return parse(raw)


def _unset(value: str) -> str:
    """A compose value as compose interpolates it when the variable is not set."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def test_the_onceflow_service_runs_a_valid_pipeline_with_the_compose_environment():
    config = onceflow_config()
    assert config.bootstrap_servers == "kafka:9092"
    assert config.spark_master == "local[*]"
    assert all(
        (k.startswith("ONCEFLOW_") and "__" in k) or k.startswith("SPARK_")
        for k in SERVICES["onceflow"]["environment"]
    )


def test_metrics_port_health_check_and_checkpoint_volume_match_the_pipeline():
    config = onceflow_config()
    service = SERVICES["onceflow"]
    assert f"127.0.0.1:{config.metrics_port}:{config.metrics_port}" in service["ports"]
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
    listeners = {"KAFKA_LISTENERS", "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"}
    expected = {k: v for k, v in KAFKA_CONTAINER_ENV.items() if k not in listeners}
    assert {k: env[k] for k in expected} == expected


def test_the_registry_runs_the_tested_version_with_its_schemas_in_kafka():
    """The same settings as `onceflow registry start`, as Quarkus' environment variables
    (checked against the registry's own jar by hand: see the README)."""
    service = SERVICES["schema-registry"]
    assert service["image"] == f"apicurio/apicurio-registry:{REGISTRY_VERSION}"
    assert service["environment"] == environment({**SETTINGS, **storage_settings("kafka:9092")})
    assert service["depends_on"]["kafka"] == {"condition": "service_healthy"}
    assert service["profiles"] == ["registry"]


def test_kafkas_log_is_on_its_named_volume():
    """The apache/kafka image writes server.properties from the KAFKA_* variables alone:
    without KAFKA_LOG_DIRS the log is in Kafka's default log.dir inside the container, and
    `down` and `up` start an empty broker."""
    kafka = SERVICES["kafka"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in kafka["volumes"]}
    log_dirs = str(kafka["environment"].get("KAFKA_LOG_DIRS", "/tmp/kafka-logs"))
    for log_dir in log_dirs.split(","):
        volume = next((name for path, name in mounts.items() if log_dir.startswith(path)), None)
        assert volume in COMPOSE["volumes"], f"{log_dir} is not on a named volume"


def test_the_host_reaches_kafka_on_an_advertised_published_port():
    kafka = SERVICES["kafka"]
    advertised = kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    host_ports = re.findall(r"//localhost:(\d+)", advertised)
    assert host_ports and all(f"127.0.0.1:{p}:{p}" in kafka["ports"] for p in host_ports)


def test_published_ports_listen_on_the_hosts_loopback_only():
    """Kafka's host listener takes no credentials, Grafana lets anyone view: a port published
    on every interface would open both to the host's network."""
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every address"


def test_long_running_services_restart_after_a_failure():
    for name in ("kafka", "onceflow", "generator", "prometheus", "grafana"):
        assert SERVICES[name].get("restart") == "unless-stopped", name


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


# The Compose Specification's JSON schema as docker compose embeds it (compose-go), fetched
# through the Go module proxy: no Docker engine or compose plugin is needed to check the file.
COMPOSE_GO = "github.com/compose-spec/compose-go/v2@v2.16.2"


def compose_spec_schema() -> dict:
    try:
        result = subprocess.run(
            ["go", "mod", "download", "-json", COMPOSE_GO],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tempfile.gettempdir(),  # outside any Go module
        )
    except FileNotFoundError:
        pytest.fail("this check reads the Compose schema with `go mod download`: install Go")
    assert result.returncode == 0, f"go mod download {COMPOSE_GO} failed: {result.stderr}"
    directory = Path(json.loads(result.stdout)["Dir"])
    return json.loads((directory / "schema" / "compose-spec.json").read_text())


def test_the_compose_file_follows_the_compose_specification():
    import jsonschema

    schema = compose_spec_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(COMPOSE)]
    assert errors == []
    # The check can fail: a misspelt key is refused.
    broken = {**COMPOSE, "services": {**SERVICES, "kafka": {**SERVICES["kafka"], "restrat": "no"}}}
    assert not validator.is_valid(broken)


def test_the_spark_cluster_profile_never_binds_loopback():
    """Master, worker and driver run in three containers: each must bind and advertise its
    own name. SPARK_LOCAL_IP=127.0.0.1 in the image made all three advertise loopback."""
    dockerfile = (REPO / "deploy/Dockerfile").read_text()
    assert not re.search(r"^ENV .*SPARK_LOCAL_IP", dockerfile, re.M)
    for name, service in SERVICES.items():
        assert "SPARK_LOCAL_IP" not in service.get("environment", {}), name
    master, worker = SERVICES["spark-master"], SERVICES["spark-worker"]
    assert master["entrypoint"][-2:] == ["--host", master["hostname"]]
    assert worker["entrypoint"][-2:] == ["--host", worker["hostname"]]
    assert f"spark://{master['hostname']}:7077" in worker["entrypoint"]
    # The driver advertises a name the worker resolves (its service name), without setting
    # its host name: the container's own names it in the lease's messages.
    onceflow = SERVICES["onceflow"]
    assert "hostname" not in onceflow
    assert onceflow["environment"]["SPARK_LOCAL_HOSTNAME"] == "onceflow"
    master_setting = onceflow["environment"]["ONCEFLOW_SPARK__MASTER"]
    assert master_setting == "${ONCEFLOW_SPARK_MASTER:-local[*]}"
    # The worker runs as the image's user, who cannot write to $SPARK_HOME/work.
    assert worker["environment"]["SPARK_WORKER_DIR"].startswith(("/tmp/", "/data/"))


def test_the_image_installs_the_dependencies_ci_tested_from_a_small_context():
    dockerfile = (REPO / "deploy/Dockerfile").read_text()
    pins = dict(
        line.split("==")
        for line in (REPO / "deploy/constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    # Every runtime dependency of the installed package is pinned, at the version tested here.
    required = {
        re.split(r"[\[<>=;! ]", r)[0].lower().replace("_", "-")
        for r in metadata.requires("onceflow")
        if "extra ==" not in r
    }
    pinned = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    assert required <= set(pinned)
    assert {n: metadata.version(n) for n in pinned} == pinned
    # Dependencies are a layer of their own, before the code is copied.
    assert dockerfile.index("RUN pip install --no-cache-dir -r constraints.txt") < dockerfile.index(
        "COPY service"
    )
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert "**" in ignored  # nothing is sent to the builder unless it is listed (.venv, .git)
    for copied in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for path in copied.split():
            assert f"!{path}" in ignored or f"!{path}/" in ignored, f"{path} is not in the context"
    assert (REPO / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]


def compose_project(*files: str) -> dict:
    """The project docker compose runs from `files` (merged in order, every profile on), as
    compose-go, docker compose's own loader, builds it: `tests/compose_config`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_")}
    try:
        result = subprocess.run(
            ["go", "run", ".", *(str(REPO / f) for f in files)],
            cwd=REPO / "tests/compose_config",
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
    except FileNotFoundError:
        pytest.fail("this check loads the compose files with compose-go (`go run`): install Go")
    assert result.returncode == 0, f"compose-go refused {files}: {result.stderr}"
    return json.loads(result.stdout)


def test_the_standby_override_runs_two_standbys_of_one_pipeline_on_one_checkpoint():
    """`-f deploy/standby.yml`: two instances that differ only in the name Spark advertises
    and the published metrics port, both `--standby` (the one restarted after a takeover
    waits instead of being refused), both on a local master (a standby's condition)."""
    from onceflow.lease import check_standby

    project = compose_project("docker-compose.yml", "deploy/standby.yml")
    services = project["services"]
    pair = [services["onceflow"], services["onceflow-standby"]]
    for name, service in zip(("onceflow", "onceflow-standby"), pair, strict=True):
        assert service["command"] == ["run", "--standby", "/etc/onceflow/pipeline.yaml"], name
        assert service["environment"]["SPARK_LOCAL_HOSTNAME"] == name
        assert "hostname" not in service  # containers of their own: distinct host names
        assert service["restart"] == "unless-stopped"
        assert all(port["host_ip"] == "127.0.0.1" for port in service["ports"])
        mounts = {v["target"]: v["source"] for v in service["volumes"]}
        pipeline = Path(mounts["/etc/onceflow/pipeline.yaml"])
        check_standby(pipeline_config(pipeline, service["environment"]))
    # The same image, command, volumes, health check and policies; the standby does not build.
    differ = ("environment", "ports", "build")
    same = [{k: v for k, v in service.items() if k not in differ} for service in pair]
    assert same[0] == same[1]
    assert {k: v for k, v in pair[0]["environment"].items() if k != "SPARK_LOCAL_HOSTNAME"} == {
        k: v for k, v in pair[1]["environment"].items() if k != "SPARK_LOCAL_HOSTNAME"
    }
    assert len({port["published"] for s in pair for port in s["ports"]}) == 2
    mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    scrape = yaml.safe_load(Path(mounts["/etc/prometheus/prometheus.yml"]).read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["onceflow:9108", "onceflow-standby:9108"]
