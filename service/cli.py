"""The `onceflow` command line.

Exit codes: 0 ok; 1 runtime failure (the last line says what failed and what to do); 2 bad
configuration; 3 `kafka status` / `registry status`: the local service is not running;
4 `verify`: the output is not exactly once; 130 stopped by Ctrl-C (the epoch it interrupted
is replayed on the next start; SIGTERM lets `run` finish the epoch and exit 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from importlib import metadata

from onceflow.connectors import kafka_clients
from onceflow.connectors.errors import EXIT_BAD_CONFIG, EXIT_FAILURE, OnceflowError

from . import config as pipeline_config
from . import logs
from .local_cluster import LocalCluster
from .local_kafka import LocalKafka, LocalKafkaError
from .local_process import LocalServiceError
from .local_registry import LocalRegistry
from .secure_listener import SecureListenerError

EXIT_OK = 0
EXIT_BROKER_NOT_RUNNING = 3
EXIT_NOT_EXACTLY_ONCE = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def _kafka(args: argparse.Namespace) -> int:
    broker = dataclasses.replace(LocalKafka.from_env(), sasl_ssl=args.sasl_ssl)
    cluster = LocalCluster.of(broker.home, broker.port, args.nodes) if args.nodes else None
    found = args.action in ("stop", "status") and broker.pid() is None and _cluster_here(broker)
    if cluster is None and (args.node or found):  # `start` alone is the single broker
        cluster = LocalCluster.of(broker.home, broker.port)
    if cluster is not None and args.sasl_ssl:
        raise LocalKafkaError("--sasl-ssl is for the single local broker, not a cluster")
    if args.action in ("kill", "pause", "resume") and cluster is not None and not args.node:
        raise LocalKafkaError(f"`kafka {args.action}` needs --node K: which node of the cluster")
    target = cluster.node(args.node) if cluster is not None and args.node else cluster or broker
    if args.action == "start":
        if isinstance(target, LocalKafka) and cluster is not None:
            cluster.start_node(target.node_id)
        else:
            target.start()
    elif args.action == "stop":
        if not target.stop():
            print("Kafka is not running")
    elif args.action == "kill":
        target.kill()
    elif args.action in ("pause", "resume"):
        target.pause(args.action == "pause")
    else:
        state = target.status()
        print(state)
        running = all(line.split(": ", 1)[-1].startswith("running") for line in state.splitlines())
        return EXIT_OK if running else EXIT_BROKER_NOT_RUNNING
    return EXIT_OK


def _registry(args: argparse.Namespace) -> int:
    registry = LocalRegistry.from_env()
    if args.action == "start":
        registry.start()
    elif args.action == "stop":
        if not registry.stop():
            print("The schema registry is not running")
    else:
        state = registry.status()
        print(state)
        return EXIT_OK if state.startswith("running") else EXIT_BROKER_NOT_RUNNING
    return EXIT_OK


def _cluster_here(broker: LocalKafka) -> bool:
    return LocalCluster(broker.home, broker.port).exists()


def _validate(args: argparse.Namespace) -> int:
    config = pipeline_config.load(args.pipeline)
    if config.sql is not None:
        _analyse_sql(config)
    topics = [t for source in config.sources for t in source.topics]
    print(
        f"{args.pipeline}: ok ({config.kind} pipeline {config.app_id!r}, "
        f"{', '.join(topics)} -> {config.sink.topic})"
    )
    return EXIT_OK


def _analyse_sql(config: pipeline_config.PipelineConfig) -> None:
    """Spark parses and analyses the query over the inputs' views; nothing connects to Kafka
    and no stream starts. A refusal is a ConfigError of `sql` (exit 2)."""
    from .formats import encode
    from .pipeline import SQL_RESULT, sql_result
    from .spark_session import build_session

    print("analysing the sql query with Spark ...", file=sys.stderr, flush=True)
    spark = build_session("local[1]", f"onceflow-validate-{config.app_id}", config.spark_conf)
    result = sql_result(spark, config)
    encode(result, config.sink.format, lambda schema: 0, config.key, SQL_RESULT)  # registers none


def _run(args: argparse.Namespace) -> int:
    from .runner import run

    run(
        pipeline_config.load(args.pipeline),
        available_now=args.available_now,
        standby=args.standby,
    )
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from .verify import WindowSpec, verify

    config = pipeline_config.load(args.pipeline)
    if config.transform is not None or config.sql is not None:
        raise pipeline_config.ConfigError(
            "transform" if config.transform else "sql",
            "verify checks window and pass-through apps; test a transform or sql pipeline's "
            "results with onceflow.testing (README, 'Testing your own pipelines')",
        )
    # Window apps: verify recomputes the windows from the input, the checkpoint's batches
    # and watermark, so it can tell records in open windows from lost ones.
    windows = WindowSpec.from_config(config) if config.window is not None else None
    report = verify(
        dict(config.kafka),
        config.source.topics,
        config.sink.topic,
        config.sink.dead_letter_topic,
        config.sink.late_topic,
        windows,
    )
    print(json.dumps(report.as_json(), indent=2) if args.json else report.summary())
    return EXIT_OK if report.ok else EXIT_NOT_EXACTLY_ONCE


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(seconds=args.seconds)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onceflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"onceflow {_version()}")
    parser.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        default=os.environ.get("ONCEFLOW_LOG_LEVEL", "info").lower(),
        help="debug also prints stack traces of failures (default: $ONCEFLOW_LOG_LEVEL or info)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a pipeline until SIGTERM/SIGINT")
    run.add_argument("pipeline", help="the pipeline YAML file")
    run.add_argument(
        "--available-now",
        action="store_true",
        help="process the backlog (with the final watermark advance), then exit",
    )
    run.add_argument(
        "--standby",
        action="store_true",
        help="start Spark, then wait and take over when the running instance's checkpoint "
        "lease ends (it stops, dies, or stops renewing)",
    )
    run.set_defaults(handler=_run)

    validate = commands.add_parser("validate", help="check a pipeline file without starting Spark")
    validate.add_argument("pipeline")
    validate.set_defaults(handler=_validate)

    verify = commands.add_parser(
        "verify", help="check an app's output topics for duplicates, loss and accounting"
    )
    verify.add_argument("pipeline")
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.set_defaults(handler=_verify)

    demo = commands.add_parser("demo", help="local broker + click stream + windowed pipeline")
    demo.add_argument("--seconds", type=float, default=40.0, help="how long the stream runs")
    demo.set_defaults(handler=_demo)

    kafka = commands.add_parser(
        "kafka",
        help="a local Apache Kafka broker, or a cluster with --nodes (jars from Maven Central)",
    )
    kafka.add_argument(
        "action",
        choices=["start", "stop", "status", "kill", "pause", "resume"],
        help="status exits 0 when every node runs, 3 if not; kill (SIGKILL), pause (SIGSTOP: "
        "a hung broker) and resume (SIGCONT) are for fault tests",
    )
    kafka.add_argument(
        "--nodes",
        type=int,
        help="a cluster of this many nodes on consecutive ports from ONCEFLOW_KAFKA_PORT "
        "(default 9092), three replicas per topic, min ISR 2; stop and status find it alone",
    )
    kafka.add_argument("--node", type=int, help="only this node (1, 2, ...) of the cluster")
    kafka.add_argument(
        "--sasl-ssl",
        action="store_true",
        help="with start: also listen for SASL_SSL clients (SCRAM-SHA-512 user, a CA of its "
        "own) on the broker's port + 3; start names the file with the client settings",
    )
    kafka.set_defaults(handler=_kafka)

    registry = commands.add_parser(
        "registry",
        help="a local Confluent-compatible schema registry (Apicurio Registry, from Maven "
        "Central) at http://127.0.0.1:8081/apis/ccompat/v7 (ONCEFLOW_REGISTRY_PORT)",
    )
    registry.add_argument(
        "action", choices=["start", "stop", "status"], help="status exits 0 when it runs, 3 if not"
    )
    registry.set_defaults(handler=_registry)
    return parser


def _version() -> str:
    try:
        return metadata.version("onceflow")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def _environment_problem(log_level: str) -> str | None:
    """What is wrong with the settings taken from the environment, checked before anything
    starts (Spark's processes read them later, where an error would surface mid-run)."""
    if log_level not in logs.LEVELS:
        return f"ONCEFLOW_LOG_LEVEL={log_level!r} is not one of {', '.join(logs.LEVELS)}"
    try:
        kafka_clients.retry_budget_s()
    except OnceflowError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if problem := _environment_problem(args.log_level):
        print(f"onceflow: invalid setting: {problem}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    logs.configure(args.log_level)
    try:
        return args.handler(args)
    except pipeline_config.ConfigError as exc:
        print(f"onceflow: invalid pipeline: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except OnceflowError as exc:
        print(f"onceflow: {exc}", file=sys.stderr)
        return exc.exit_code
    except (LocalServiceError, SecureListenerError) as exc:
        print(f"onceflow: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
