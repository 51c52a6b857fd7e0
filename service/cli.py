"""The `onceflow` command line. Exit codes: 0 ok, 2 bad configuration, 1 runtime failure."""

from __future__ import annotations

import argparse
import sys

from onceflow.local_kafka import LocalKafka, LocalKafkaError

EXIT_OK, EXIT_FAILURE, EXIT_BAD_CONFIG = 0, 1, 2


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onceflow", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    kafka = commands.add_parser(
        "kafka", help="a local single-node Apache Kafka broker (jars from Maven Central)"
    )
    kafka.add_argument("action", choices=["start", "stop", "status"])
    kafka.set_defaults(handler=_kafka)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except LocalKafkaError as exc:
        print(f"onceflow: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
