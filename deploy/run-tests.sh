#!/usr/bin/env bash
# Runs the test suite against a real Kafka broker: KAFKA_BOOTSTRAP_SERVERS if set, else
# onceflow's local broker (started here, and stopped here if this script started it); and a
# real schema registry: SCHEMA_REGISTRY_URL if set, else onceflow's local one, the same way.
# pytest's "no tests collected" (exit 5) is a failure, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
onceflow="$VENV/bin/onceflow"

# The metrics test scrapes with a real Prometheus: Debian's package, installed here when we
# can (root and apt-get), without starting its system service.
install_prometheus() {
  command -v prometheus >/dev/null && return
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "run-tests: no prometheus binary and no root apt-get; the Prometheus scrape test will skip" >&2
    return
  fi
  echo "run-tests: installing Debian's prometheus package for the scrape test ..."
  local no_start=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    no_start=1
  fi
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      --no-install-recommends prometheus; } > "$VENV/apt-prometheus.log" 2>&1 \
    || echo "run-tests: apt-get could not install prometheus (see $VENV/apt-prometheus.log); the scrape test will skip" >&2
  if [ "$no_start" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
}
install_prometheus

started_broker=0
started_registry=0
stop_services() {
  if [ "$started_registry" = 1 ]; then "$onceflow" registry stop || true; fi
  if [ "$started_broker" = 1 ]; then "$onceflow" kafka stop || true; fi
}
trap stop_services EXIT

if [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
  # A broker that is starting (loading its logs) is running already: not ours to stop.
  if [ "$("$onceflow" kafka status 2>/dev/null)" = "not running" ]; then
    started_broker=1
    # the tests may delete the topics they made on it (tests/conftest.py)
    export ONCEFLOW_TESTS_OWN_BROKER=1
  fi
  "$onceflow" kafka start || { echo "run-tests: could not start the local Kafka broker (see above)" >&2; exit 1; }
fi
if [ -z "${SCHEMA_REGISTRY_URL:-}" ]; then
  if ! "$onceflow" registry status >/dev/null 2>&1; then
    started_registry=1
  fi
  "$onceflow" registry start || { echo "run-tests: could not start the local schema registry (see above)" >&2; exit 1; }
fi

"$VENV/bin/pytest" --durations=25 "$@"
status=$?
if [ "$status" = 5 ]; then
  echo "run-tests: pytest collected no tests; that is a failure, not a pass" >&2
  exit 1
fi
exit "$status"
