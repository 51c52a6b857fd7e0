#!/usr/bin/env bash
# Runs the test suite against a real Kafka broker: KAFKA_BOOTSTRAP_SERVERS if set, else
# onceflow's local broker (started here, and stopped here if this script started it).
# pytest's "no tests collected" (exit 5) is a failure, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
onceflow="$VENV/bin/onceflow"

started_broker=0
stop_broker() {
  if [ "$started_broker" = 1 ]; then "$onceflow" kafka stop || true; fi
}
trap stop_broker EXIT

if [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
  if ! "$onceflow" kafka status >/dev/null 2>&1; then
    started_broker=1
  fi
  "$onceflow" kafka start || { echo "run-tests: could not start the local Kafka broker (see above)" >&2; exit 1; }
fi

"$VENV/bin/pytest" "$@"
status=$?
if [ "$status" = 5 ]; then
  echo "run-tests: pytest collected no tests; that is a failure, not a pass" >&2
  exit 1
fi
exit "$status"
