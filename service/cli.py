"""The `onceflow` command line. Exit codes: 0 ok, 2 bad configuration, 1 runtime failure."""

from __future__ import annotations

import argparse
import sys

from onceflow.connectors.errors import EXIT_BAD_CONFIG, EXIT_FAILURE, OnceflowError

from . import config as pipeline_config
from . import logs
from .local_kafka import LocalKafka, LocalKafkaError

EXIT_OK = 0


def _kafka(args: argparse.Namespace) -> int:
    broker = LocalKafka.from_env()
    if args.action == "start":
        broker.start()
    elif args.action == "stop":
        if not broker.stop():
            print("Kafka is not running")
    else:
        state = broker.status()
        print(state)
        return EXIT_OK if state.startswith("running") else 3
    return EXIT_OK


def _validate(args: argparse.Namespace) -> int:
    config = pipeline_config.load(args.pipeline)
    kind = "windowed" if config.window else "transform" if config.transform else "pass-through"
    print(
        f"{args.pipeline}: ok ({kind} pipeline {config.app_id!r}, "
        f"{', '.join(config.source.topics)} -> {config.sink.topic})"
    )
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    from .runner import run

    run(pipeline_config.load(args.pipeline), available_now=args.available_now)
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from .verify import WindowSpec, verify

    config = pipeline_config.load(args.pipeline)
    if config.transform is not None:
        raise pipeline_config.ConfigError("transform", "verify checks window and pass-through apps")
    # Window apps: verify recomputes the windows from the input, the checkpoint's batches
    # and watermark, so it can tell records in open windows from lost ones.
    windows = WindowSpec.from_config(config) if config.window is not None else None
    report = verify(
        config.bootstrap_servers,
        config.source.topics,
        config.sink.topic,
        config.sink.dead_letter_topic,
        config.sink.late_topic,
        windows,
    )
    print(report.summary())
    return EXIT_OK if report.ok else EXIT_FAILURE


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(seconds=args.seconds)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onceflow", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a pipeline until SIGTERM/SIGINT")
    run.add_argument("pipeline", help="the pipeline YAML file")
    run.add_argument(
        "--available-now",
        action="store_true",
        help="process the backlog (with the final watermark advance), then exit",
    )
    run.set_defaults(handler=_run)

    validate = commands.add_parser("validate", help="check a pipeline file without starting Spark")
    validate.add_argument("pipeline")
    validate.set_defaults(handler=_validate)

    verify = commands.add_parser(
        "verify", help="check an app's output topics for duplicates, loss and accounting"
    )
    verify.add_argument("pipeline")
    verify.set_defaults(handler=_verify)

    demo = commands.add_parser("demo", help="local broker + click stream + windowed pipeline")
    demo.add_argument("--seconds", type=float, default=40.0, help="how long the stream runs")
    demo.set_defaults(handler=_demo)

    kafka = commands.add_parser(
        "kafka", help="a local single-node Apache Kafka broker (jars from Maven Central)"
    )
    kafka.add_argument("action", choices=["start", "stop", "status"])
    kafka.set_defaults(handler=_kafka)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure()
    try:
        return args.handler(args)
    except pipeline_config.ConfigError as exc:
        print(f"onceflow: invalid pipeline: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except OnceflowError as exc:
        print(f"onceflow: {exc}", file=sys.stderr)
        return exc.exit_code
    except LocalKafkaError as exc:
        print(f"onceflow: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
