"""Kafka clients cached per Python process, and the offset look-ups the source plans with.

Readers and writers are pickled to executors for every batch, so they must not hold clients.
Instead each Python process (a Spark worker, or the driver-side source/sink runner, both of
which Spark reuses across batches) keeps its clients here, keyed by their configuration.
"""

from __future__ import annotations

import base64
import functools
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Iterable

from confluent_kafka import (
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, OffsetSpec, ResourceType
from tenacity import (
    retry,
    retry_if_exception,
    wait_exponential,
)

from .errors import KafkaUnreachableError, OptionError
from .offsets import TP
from .stalls import reported_if_stalled

log = logging.getLogger("onceflow.kafka")
REPEAT_WINDOW_S = 30.0
# The parts of a librdkafka line that change between repeats of one event.
VOLATILE = re.compile(r"after \d+ms|\d+ identical error\(s\) suppressed|\d+/\d+ brokers")

REQUEST_TIMEOUT_S = 15  # a request made once
# One attempt of a retried look-up (kafka_request): an attempt waiting for a leader that
# died or hangs is given up sooner, and the next one goes where the refreshed metadata says.
ATTEMPT_TIMEOUT_S = 5
# An offset look-up's first attempt: a live leader answers ListOffsets from memory, at once.
# One sent to a leader that hangs (the admin client's cached leader, after Kafka moved it) is
# given up after this, and the next goes where the refreshed metadata says, so that a hung
# node costs about what a dead one does. Later attempts wait ATTEMPT_TIMEOUT_S: a broker that
# is slow to answer (a loaded one, a new TLS connection) is still waited for.
OFFSETS_FIRST_ATTEMPT_TIMEOUT_S = 2
_attempt = threading.local()  # the number of the look-up attempt running on this thread
PREFETCH_MESSAGES = 20_000
# How long one `consume` call of a read may wait. It returns early only with every record it
# asked for, and transaction markers and aborted records take offsets but are never returned:
# a read of a range that holds one asks for more records than come, and each call waits its
# whole timeout before the consumer's position shows the gap passed. So the reads ask briefly
# and check the position between calls.
CONSUME_WAIT_S = 0.01
DEFAULT_RETRY_BUDGET_S = 60.0


def retry_budget_s() -> float:
    """How long a Kafka look-up is retried before the run fails: ONCEFLOW_KAFKA_TIMEOUT
    (seconds). An environment variable, because Spark runs the source's planning in a Python
    process of its own, which inherits the environment and nothing else."""
    raw = os.environ.get("ONCEFLOW_KAFKA_TIMEOUT")
    if not raw:
        return DEFAULT_RETRY_BUDGET_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise OptionError(
            f"ONCEFLOW_KAFKA_TIMEOUT={raw!r} is not a positive number of seconds; unset it for "
            f"the default ({DEFAULT_RETRY_BUDGET_S:g})"
        )
    return seconds


_lock = threading.Lock()
_admins: dict[tuple, AdminClient] = {}
_admins_made: dict[tuple, float] = {}  # when each of _admins was made
# Admin clients replaced (see _replace_admin), kept until every request made through them has
# ended: destroying a client fails the futures of its requests still in flight without ever
# completing them (confluent-kafka's Admin_dealloc; librdkafka drops its queued events).
_retired_admins: list[tuple[float, AdminClient]] = []
RETIRED_ADMIN_KEEP_S = 120.0  # beyond every request timeout onceflow sets, and the default
ADMIN_REPLACED_EVERY_S = 10.0  # at most, per configuration
_consumers: dict[tuple, Consumer] = {}
_group_commits: dict[tuple, GroupCommits] = {}


def _key(conf: dict[str, str], *extra: object) -> tuple:
    return (*sorted(conf.items()), *extra)


# The codes of a request that got no answer at all (as opposed to an answer saying no):
# - _TIMED_OUT_QUEUE: unanswered in the client's queue past the request timeout, its
#   broker's connection down;
# - _DESTROY_BROKER: sent through a broker handle the client dropped meanwhile (a bootstrap
#   server's, dropped once a metadata answer names the brokers; librdkafka's
#   rd_kafka_metadata_decommission_unavailable_brokers).
# Either may have reached the broker, so only reads, and requests whose second copy is
# harmless (CreateTopics), are retried on these codes.
NO_ANSWER = (
    KafkaError._TRANSPORT,
    KafkaError._TIMED_OUT,
    KafkaError._TIMED_OUT_QUEUE,
    KafkaError._DESTROY_BROKER,
    KafkaError._ALL_BROKERS_DOWN,
)


# Answers of a cluster in motion (a broker restarting, leaders and coordinators moving), which
# Kafka's own clients retry (its RetriableException family); librdkafka does not always mark
# them retriable when an admin request returns them.
CLUSTER_IN_MOTION = (
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.UNKNOWN_LEADER_EPOCH,
    KafkaError.OFFSET_NOT_AVAILABLE,
    KafkaError.REPLICA_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.KAFKA_STORAGE_ERROR,
    KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION,
)


def retriable(exc: BaseException) -> bool:
    """A Kafka error that goes away when asked again: no answer, or a cluster in motion."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        error = exc.args[0]
        return error.retriable() or error.code() in (*NO_ANSWER, *CLUSTER_IN_MOTION)
    return False


def _unreachable(retry_state) -> None:
    exc = retry_state.outcome.exception()
    conf = retry_state.args[0] if retry_state.args else {}
    code = exc.args[0].code() if exc.args and isinstance(exc.args[0], KafkaError) else None
    if code in NO_ANSWER or _refused_credentials(_last_error_since(conf, retry_state.start_time)):
        raise KafkaUnreachableError(
            _why_unreachable(conf, retry_state.start_time, str(exc))
        ) from exc
    raise KafkaUnreachableError(
        f"a request to Kafka at {conf.get('bootstrap.servers', '?')} kept failing for "
        f"{retry_state.seconds_since_start:.0f}s: {exc}. Check that every partition of the "
        "subscribed topics has a leader."
    ) from exc


def _why_unreachable(conf: dict[str, str], since: float, fallback: str) -> str:
    """One line for a client that never got an answer: the address, what failed (the
    broker refused the credentials, TLS, the name, the connection) and what to check.
    Credentials are named by setting, never by value."""
    bootstrap = conf.get("bootstrap.servers", "?")
    error = _last_error_since(conf, since)
    code = error.code() if error is not None else None
    if _refused_credentials(error):
        return (
            f"Kafka at {bootstrap} refused the credentials of user "
            f"{conf.get('sasl.username', '(none)')!r} ({conf.get('sasl.mechanism', 'GSSAPI')}): "
            f"{error.str()}. Check kafka.sasl.username, kafka.sasl.password and "
            "kafka.sasl.mechanism."
        )
    if code == KafkaError._SSL:
        return (
            f"TLS with Kafka at {bootstrap} failed: {error.str()}. Check kafka.ssl.ca.location "
            "(the CA that signed the broker's certificate), that the address is one the "
            "certificate names, and kafka.ssl.certificate.location / kafka.ssl.key.location "
            "if the listener asks clients for a certificate."
        )
    if code == KafkaError._RESOLVE:
        return f"{error.str()}. Check the host names in kafka.bootstrap.servers ({bootstrap})."
    # librdkafka logs a connection failure once, then its identical repeats at most once per
    # REPEAT_WINDOW_S: one logged shortly before the look-up began, with no request answered
    # since, is still its cause (a client that keeps a connection to every broker saw the
    # broker go before it was asked).
    answered = _last_answers.get(_key(conf), 0.0)
    recent = _last_failure_since(conf, max(since - REPEAT_WINDOW_S, answered))
    said = recent or (error.str() if error else fallback)
    protocol = conf.get("security.protocol", "plaintext")
    check = (
        f"Check kafka.bootstrap.servers, that the broker is up, and that "
        f"kafka.security.protocol ({protocol}) is what that listener speaks."
    )
    if "APIVERSION_QUERY" in said and "ssl" not in protocol.lower():
        check = (
            "The broker closed the connection before answering the first request: if that "
            f"listener expects TLS, set kafka.security.protocol ({protocol}) to SSL or "
            "SASL_SSL; else check that the broker is up and accepts connections."
        )
    return (
        f"Kafka at {bootstrap} did not answer within {retry_budget_s():g}s; the client's last "
        f"error: {said}. {check}"
    )


# librdkafka reports a refusal by the broker, and also a connection lost during the SASL
# handshake or an OAUTHBEARER token it could not fetch, as _AUTHENTICATION: only the text
# tells a refusal (wrong password, unknown user, a mechanism the broker does not offer).
CREDENTIALS_REFUSED = re.compile(
    r"invalid credentials|Unsupported SASL mechanism|ServerSignature mismatch"
    r"|SASL SCRAM authentication failed|authorization id"
)
# A user created a moment ago may not have reached every broker yet, and is refused
# meanwhile in the same words as a wrong password: a refusal ends the retries only after this.
REFUSAL_GRACE_S = 5.0


def _refused_credentials(error: KafkaError | None) -> bool:
    return (
        error is not None
        and error.code() == KafkaError._AUTHENTICATION
        and CREDENTIALS_REFUSED.search(error.str()) is not None
    )


def _gives_up(retry_state) -> bool:
    """After the retry budget, or sooner when the broker keeps refusing the credentials:
    trying the same password again cannot help."""
    if retry_state.seconds_since_start >= retry_budget_s():
        return True
    conf = retry_state.args[0] if retry_state.args else {}
    last = _last_error_since(conf, retry_state.start_time)
    return _refused_credentials(last) and retry_state.seconds_since_start >= REFUSAL_GRACE_S


def _note_attempt(retry_state) -> None:
    _attempt.number = retry_state.attempt_number


def offsets_attempt_timeout_s() -> float:
    """How long the running attempt of an offset look-up waits for its answer."""
    first = getattr(_attempt, "number", 1) == 1
    return OFFSETS_FIRST_ATTEMPT_TIMEOUT_S if first else ATTEMPT_TIMEOUT_S


kafka_retry = retry(
    before=_note_attempt,
    retry=retry_if_exception(retriable),
    wait=wait_exponential(multiplier=0.2, max=5),
    stop=_gives_up,
    retry_error_callback=_unreachable,
    reraise=False,
)


class _RepeatFilter(logging.Filter):
    """Lets a librdkafka line through once per REPEAT_WINDOW_S, then says how many like it
    were held back: an unreachable broker makes every client log the same failure many times
    a second."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.seen: dict[str, tuple[float, int]] = {}  # shape of a line -> (shown at, held)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        shape = VOLATILE.sub("#", message)
        now = time.monotonic()
        with self.lock:
            shown, held = self.seen.get(shape, (float("-inf"), 0))
            if now - shown < REPEAT_WINDOW_S:
                self.seen[shape] = (shown, held + 1)
                return False
            if len(self.seen) > 1000:
                self.seen.clear()
            self.seen[shape] = (now, 0)
        if held:
            record.msg, record.args = f"{message} ({held} more like it held back)", ()
        return True


_repeats = _RepeatFilter()
LIBRDKAFKA_LOG = logging.getLogger("onceflow.librdkafka")
LIBRDKAFKA_LOG.addFilter(_repeats)


# A client's settings (`_key`) -> (time.monotonic(), what its clients last reported): why
# Kafka is unreachable. Errors carry a code (authentication, TLS, name resolution); some
# failures, such as a TLS listener hanging up on a client without TLS, reach only the log, as
# a FAIL line. Both are stamped when delivered, at a poll (see `kafka_request`).
_last_errors: dict[tuple, tuple[float, KafkaError]] = {}
_last_failures: dict[tuple, tuple[float, str]] = {}
_last_answers: dict[tuple, float] = {}  # when a look-up (kafka_request) last succeeded


def _last_error_since(conf: dict[str, str], since: float) -> KafkaError | None:
    when, error = _last_errors.get(_key(conf), (0.0, None))
    return error if when >= since else None


def _last_failure_since(conf: dict[str, str], since: float) -> str | None:
    when, failure = _last_failures.get(_key(conf), (0.0, None))
    return failure if when >= since else None


class _ClientLog:
    """librdkafka's log of the clients of one configuration: lines go on to LIBRDKAFKA_LOG,
    and the last connection failure (a FAIL line) is kept for `_why_unreachable`.
    confluent-kafka only calls `log` on the object it is given."""

    def __init__(self, key: tuple) -> None:
        self.key = key

    def log(self, level: int, fmt: str, *args: object) -> None:
        if len(args) == 3 and args[0] == "FAIL":
            text = re.sub(r"^\[thrd:[^\]]*\]: ", "", str(args[2]))
            _last_failures[self.key] = (time.monotonic(), text)
        LIBRDKAFKA_LOG.log(level, fmt, *args)


# How long a client waits for the answer to one request before it gives up on it and on its
# connection (librdkafka's socket.timeout.ms; it then refreshes metadata and, for a
# transaction, finds the coordinator again), and for the first answer on a new connection
# (api.version.request.timeout.ms). librdkafka's defaults, 60 s (a transactional producer:
# its transaction timeout) and 10 s, made a hung broker (alive to TCP, answering nothing)
# stall the pipeline far longer than a dead one, which refuses connections at once; Kafka
# moves leaders and coordinators off a silent broker within ~10 s. A request cut short is
# retried: produce requests by the idempotent producer, the commit by librdkafka, look-ups by
# kafka_retry.
REQUEST_ANSWER_TIMEOUT_MS = 5_000
FIRST_ANSWER_TIMEOUT_MS = 3_000
# How long a broker may hold a produce request (waiting for its in-sync replicas) before it
# answers REQUEST_TIMED_OUT, which the producer retries on the same connection. Kafka's
# default, 30 s, is longer than the client waits for an answer: a slow but live broker would
# be dropped and reconnected as if it hung. A producer setting (publisher.producer_config).
PRODUCE_WAIT_MS = 4_000


def _answer_timeouts(conf: dict[str, str]) -> dict[str, str | int]:
    """The two timeouts, where the user set neither. A transactional producer's stays 100 ms
    under its transaction timeout, as librdkafka's own default does (rd_kafka_conf_finalize):
    one attempt must not take the whole transaction."""
    timeouts: dict[str, str | int] = {}
    if "socket.timeout.ms" not in conf:
        timeout = REQUEST_ANSWER_TIMEOUT_MS
        if "transaction.timeout.ms" in conf:
            timeout = min(timeout, max(int(conf["transaction.timeout.ms"]) - 100, 900))
        timeouts["socket.timeout.ms"] = timeout
    if "api.version.request.timeout.ms" not in conf:
        timeouts["api.version.request.timeout.ms"] = FIRST_ANSWER_TIMEOUT_MS
    return timeouts


def client_conf(conf: dict[str, str]) -> dict:
    """`conf` for a librdkafka client whose log goes through Python logging, de-duplicated,
    instead of straight to stderr, and whose errors say why Kafka cannot be reached
    (refused, name resolution, TLS, authentication).

    librdkafka queues both until the client is polled: clients that are never polled
    otherwise (the admin client) are polled around each request (see `kafka_request`)."""
    key = _key(conf)

    def remember(error: KafkaError) -> None:
        if error.code() != KafkaError._ALL_BROKERS_DOWN:  # says nothing about why
            _last_errors[key] = (time.monotonic(), error)

    return {**conf, **_answer_timeouts(conf), "logger": _ClientLog(key), "error_cb": remember}


def admin(conf: dict[str, str]) -> AdminClient:
    """The process' admin client for `conf`. Its metadata look-ups never create a topic: the
    client is a producer to librdkafka, and a producer's look-up of a missing topic creates
    it where the broker allows auto-creation (Kafka's default).

    It keeps a connection to every broker (`enable.sparse.connections` off, a property
    librdkafka does not document): with sparse connections, its default, an admin request
    waiting for a leader that is down asks for a connection at each of that broker's state
    changes, and each ask skips the reconnect backoff (librdkafka 2.16, `rd_kafka_broker_
    find_by_nodeid0` -> `OP_CONNECT`), so the client reconnects in a busy loop, a core for as
    long as Kafka takes to move the leader. Consumers and producers reconnect with backoff."""
    with _lock:
        key = _key(conf)
        expired = _expired_admins()
        if key not in _admins:
            settings = {
                "enable.sparse.connections": False,  # unless the user chose
                **client_conf(conf),
                "allow.auto.create.topics": False,
            }
            _admins[key] = AdminClient(settings)
            _admins_made[key] = time.monotonic()
        client = _admins[key]
    del expired  # destroyed here, outside the lock
    return client


def _delivers_logs(call):
    """Poll the admin client after `call`: it delivers the log lines and errors librdkafka
    queued meanwhile, which would otherwise wait, unbounded, for a poll that never comes."""

    @functools.wraps(call)
    def polled(conf: dict[str, str], *args, **kwargs):
        try:
            return call(conf, *args, **kwargs)
        finally:
            admin(conf).poll(0)

    return polled


def kafka_request(call):
    """A Kafka look-up with the admin client: retried (kafka_retry), its client's logs and
    errors delivered after each attempt, and what was queued before it delivered first, so
    that an older error is not taken for this request's cause (they are stamped when
    delivered)."""
    retried = kafka_retry(_delivers_logs(call))

    what = f"Kafka request {call.__name__.strip('_').replace('_', ' ')!r}"

    @functools.wraps(call)
    def request(conf: dict[str, str], *args, **kwargs):
        admin(conf).poll(0)
        with reported_if_stalled(f"{what} to {conf.get('bootstrap.servers', '?')}"):
            result = retried(conf, *args, **kwargs)
        _last_answers[_key(conf)] = time.monotonic()
        return result

    return request


def _list_topics(conf: dict[str, str], topic: str | None = None):
    """The admin client's metadata (of `topic`, or of every topic); a client that got no
    answer is replaced for the next attempt (see _replaced_after_no_answer)."""
    try:
        return admin(conf).list_topics(topic, timeout=ATTEMPT_TIMEOUT_S)
    except KafkaException as exc:
        _replaced_after_no_answer(conf, exc)
        raise


@kafka_request
def metadata(conf: dict[str, str]):
    try:
        return _list_topics(conf)
    except KafkaException:
        raise
    except Exception as exc:  # confluent-kafka raises KafkaException, but be explicit
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, str(exc))) from exc


@kafka_request
def topic_metadata(conf: dict[str, str], topic: str):
    """One topic's metadata (None if it does not exist), without listing every topic."""
    meta = _list_topics(conf, topic).topics.get(topic)
    if meta is None or meta.error is None:
        return meta
    if meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
        return None
    raise KafkaException(meta.error)


@kafka_request
def topic_config(conf: dict[str, str], topic: str) -> dict[str, str]:
    """The effective configuration (its own settings over the broker's defaults) of a topic
    that exists. In a cluster, a broker that has not heard of a topic created a moment ago
    answers UNKNOWN_TOPIC_OR_PART: retried like a broker that did not answer."""
    resource = ConfigResource(ResourceType.TOPIC, topic)
    future = admin(conf).describe_configs([resource], request_timeout=ATTEMPT_TIMEOUT_S)[resource]
    try:
        return {name: entry.value for name, entry in future.result().items()}
    except KafkaException as exc:
        _away_from_a_silent_controller(conf, [topic], exc)
        error = exc.args[0]
        if error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise
        raise _marked_retriable(error) from exc


@kafka_request
def topic_ids(conf: dict[str, str], topics: Iterable[str]) -> dict[str, str | None]:
    """The id of each topic, in Kafka's own text form (as `kafka-topics.sh --describe` shows
    it): a topic deleted and created again under its name gets a new one.

    None for a topic whose broker reports no id (brokers before Kafka 2.8); a topic deleted
    since the metadata was read is left out.
    """
    names = sorted(set(topics))
    if not names:
        return {}
    futures = admin(conf).describe_topics(TopicCollection(names), request_timeout=ATTEMPT_TIMEOUT_S)
    ids: dict[str, str | None] = {}
    for name, future in futures.items():
        try:
            uuid_ = future.result().topic_id
        except KafkaException as exc:
            _away_from_a_silent_controller(conf, names, exc)
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise
            continue
        ids[name] = _kafka_uuid(
            uuid_.get_most_significant_bits(), uuid_.get_least_significant_bits()
        )
    return ids


def _kafka_uuid(msb: int, lsb: int) -> str | None:
    """Kafka's Uuid.toString (URL-safe base64, no padding); None for the zero id."""
    if msb == lsb == 0:
        return None
    raw = msb.to_bytes(8, "big", signed=msb < 0) + lsb.to_bytes(8, "big", signed=lsb < 0)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@kafka_request
def _list_offsets(
    conf: dict[str, str],
    tps: Iterable[TP],
    spec: OffsetSpec,
    isolation: IsolationLevel = IsolationLevel.READ_COMMITTED,
) -> dict[TP, tuple[int, int | None]]:
    """Each partition's offset for `spec` and the leader epoch it was answered in (None from
    a broker that gives none)."""
    request = {TopicPartition(t, p): spec for t, p in tps}
    if not request:
        return {}
    futures = admin(conf).list_offsets(
        request, isolation_level=isolation, request_timeout=offsets_attempt_timeout_s()
    )
    try:
        answers = {(tp.topic, tp.partition): f.result() for tp, f in futures.items()}
        return _every_offset_answered({tp: (a.offset, a.leader_epoch) for tp, a in answers.items()})
    except KafkaException as exc:
        # 1. The admin client sends each partition's request to the leader in its metadata
        #    cache, refreshed only every few minutes: after a broker died, every retry would
        #    go to the dead one. A metadata request, which any live broker answers, refreshes
        #    it; if no broker answers it, that is the failure to report.
        unanswered = _refresh_metadata(conf, {tp.topic for tp in request}, exc)
        if unanswered is not None:
            raise unanswered from exc
        # 2. librdkafka's "No leaders found" (_NOENT): a partition between leaders, as while
        #    its broker shuts down; retried like LEADER_NOT_AVAILABLE.
        if exc.args[0].code() == KafkaError._NOENT:
            raise _marked_retriable(exc.args[0]) from exc
        # 3. Anything else is classified by kafka_retry.
        raise


def _every_offset_answered(
    listed: dict[TP, tuple[int, int | None]],
) -> dict[TP, tuple[int, int | None]]:
    """`listed`, if each is an offset: librdkafka (2.15, `ListOffsets_response_merge`) can
    leave a partition whose leader did not answer with no error and offset -1001 (no offset),
    which the source must never plan with. Retried like a leader that did not answer."""
    unanswered = sorted(tp for tp, (offset, _) in listed.items() if offset < 0)
    if unanswered:
        raise _marked_retriable(
            KafkaError(
                KafkaError._TIMED_OUT,
                f"no offset in the answer for {', '.join(f'{t}[{p}]' for t, p in unanswered)}",
            )
        )
    return listed


def _away_from_a_silent_controller(
    conf: dict[str, str], topics: list[str], exc: KafkaException
) -> None:
    """After a controller-routed request (describe topics, describe configs) got no answer,
    refresh the metadata so that the next attempt goes elsewhere; raise the refresh's own
    failure if no broker answers that either.

    librdkafka sends these requests to the broker its last metadata answer named controller
    (RD_KAFKA_ADMIN_TARGET_CONTROLLER; on KRaft, a random live broker) and waits for that one
    alone: a broker that hangs would get every retry until the run gives up. A metadata
    request from a new client (see _refresh_metadata) goes to a broker that answers, and its
    answer names another."""
    if _no_answer(exc):
        unanswered = _refresh_metadata(conf, topics[:1], exc)
        if unanswered is not None:
            raise unanswered from exc


def _refresh_metadata(
    conf: dict[str, str], topics: Iterable[str], failure: KafkaException
) -> KafkaException | None:
    """Refresh the admin client's metadata of `topics` after a request failed with `failure`;
    the failure of a refresh that got no answer (no broker reachable), else None.

    librdkafka sends a metadata request to the broker it last sent something to (the least
    idle, `rd_kafka_broker_weight_usable`): after a request that got no answer, likely the
    broker that did not answer, a leader that hangs. Its answer would come when the request
    times out, and the next attempt would go to the same node. So after no answer the
    process' client for `conf` is replaced: a new one asks a broker that answers it."""
    _replaced_after_no_answer(conf, failure)
    for topic in topics:
        try:
            admin(conf).list_topics(topic, timeout=ATTEMPT_TIMEOUT_S)
        except KafkaException as exc:
            if _no_answer(exc):
                return exc
        except Exception:  # a refresh is best effort: the request's own error stands
            continue
    return None


def _replaced_after_no_answer(conf: dict[str, str], failure: BaseException) -> None:
    """Replace the process' admin client for `conf` if `failure` is a request that got no
    answer: its next metadata request would go to the broker it last sent to (the least
    idle, `rd_kafka_broker_weight_usable`), likely the one that did not answer."""
    if _no_answer(failure):
        _replace_admin(conf)


def ask_afresh(conf: dict[str, str]) -> None:
    """The next look-ups for `conf` go through a new admin client (see _replace_admin), which
    reads the cluster's metadata again from a bootstrap server: after an answer that looks
    stale, such as a replaced leader's, which the old client would keep asking."""
    _replace_admin(conf)


def _replace_admin(conf: dict[str, str]) -> None:
    """The next admin(conf) makes a new client, unless this one is younger than
    ADMIN_REPLACED_EVERY_S: a new client never counts a broker that did not answer its first
    request as up, so one replacement per hang is enough (a refused connection makes no new
    client at every attempt of an outage). The old one is retired, not destroyed."""
    key, now = _key(conf), time.monotonic()
    with _lock:
        if key not in _admins or now - _admins_made.get(key, 0.0) < ADMIN_REPLACED_EVERY_S:
            return
        _retired_admins.append((now, _admins.pop(key)))


def _expired_admins() -> list[AdminClient]:
    """Retired clients kept long enough, taken out of the list (under _lock): the caller
    drops them outside it, since destroying a client waits for its threads."""
    now = time.monotonic()
    expired = [c for retired, c in _retired_admins if now - retired >= RETIRED_ADMIN_KEEP_S]
    if expired:
        _retired_admins[:] = [(t, c) for t, c in _retired_admins if now - t < RETIRED_ADMIN_KEEP_S]
    return expired


def _no_answer(exc: BaseException) -> bool:
    return bool(
        isinstance(exc, KafkaException)
        and exc.args
        and isinstance(exc.args[0], KafkaError)
        and exc.args[0].code() in NO_ANSWER
    )


def _marked_retriable(error: KafkaError) -> KafkaException:
    return KafkaException(KafkaError(error.code(), error.str(), retriable=True))


def earliest(conf: dict[str, str], tps: Iterable[TP]) -> dict[TP, int]:
    """The first offset still stored for each partition (retention moves it forward)."""
    return {tp: o for tp, (o, _) in _list_offsets(conf, tps, OffsetSpec.earliest()).items()}


def stable_ends(conf: dict[str, str], tps: Iterable[TP]) -> dict[TP, int]:
    """The last stable offset: as far as a read_committed reader can get right now.

    A batch ending here never waits on somebody else's open transaction.
    """
    return {tp: o for tp, (o, _) in stable_ends_and_epochs(conf, tps).items()}


def stable_ends_and_epochs(
    conf: dict[str, str], tps: Iterable[TP]
) -> dict[TP, tuple[int, int | None]]:
    """Each partition's last stable offset and its leader's epoch in the same answer: the
    offset is in the log of that epoch, which is what a reader validates it against later
    (KIP-320; see offsets.LEADER_EPOCHS)."""
    return _list_offsets(conf, tps, OffsetSpec.latest())


def high_watermarks(conf: dict[str, str], tps: Iterable[TP]) -> dict[TP, int]:
    """The end of each partition's log, open transactions included."""
    listed = _list_offsets(conf, tps, OffsetSpec.latest(), IsolationLevel.READ_UNCOMMITTED)
    return {tp: o for tp, (o, _) in listed.items()}


def range_consumer(conf: dict[str, str]) -> Consumer:
    """A read_committed consumer for assigned offset ranges, reused across tasks.

    Offsets that are gone raise an error (auto.offset.reset=error) instead of moving the
    consumer elsewhere: the source decides what a gone offset means (see source.read_range).
    """
    key = _key(conf, "range")
    with _lock:
        if key not in _consumers:
            _consumers[key] = _new_range_consumer(conf)
        return _consumers[key]


def renewed_range_consumer(conf: dict[str, str], stale: Consumer) -> Consumer:
    """A new range consumer in place of `stale`, which is closed in the background.

    librdkafka sends a metadata request to the broker it last sent something to: for a
    consumer whose fetch waits on a leader that hangs, that is the hung one, so asking it
    which broker leads now waits as long as the fetch does (its request timeout). A new
    consumer asks the brokers that answer it."""
    key = _key(conf, "range")
    with _lock:
        replaced = _consumers.get(key) in (stale, None)
        if replaced:
            _consumers[key] = _new_range_consumer(conf)
        fresh = _consumers[key]
    if replaced:
        threading.Thread(target=stale.close, name="close-stale-consumer", daemon=True).start()
    return fresh


def _new_range_consumer(conf: dict[str, str]) -> Consumer:
    return Consumer(
        {
            "fetch.min.bytes": 1,
            # librdkafka keeps one fetch in flight per broker: one that the broker
            # holds at a range's end delays the next range's first fetch by up to this.
            "fetch.wait.max.ms": 5,
            # Prefetch about one Arrow batch: what is fetched past a range's end is
            # thrown away when the task unassigns the partition.
            "queued.min.messages": PREFETCH_MESSAGES,
            # librdkafka postpones a partition's next fetch by this much once its queue
            # was full, and remembers that across unassign/assign: with the default
            # (1 s) one task in three of an epoch waited a second before its first fetch.
            "fetch.queue.backoff.ms": 10,
            **client_conf(conf),
            # Never part of a group: offsets come from Spark's offset log.
            "group.id": f"onceflow-range-reader-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "error",
        }
    )


def commit_group_offsets(conf: dict[str, str], group_id: str, offsets: dict[TP, int]) -> None:
    """Commit `offsets` for `group_id`, so that lag tooling shows the query's progress.

    Best effort, in the background: Spark's offset log is the truth, and Spark calls this
    between writing an epoch's offsets and planning it, so a commit that waited for the
    group's coordinator held the pipeline (13 s while that broker hung). See GroupCommits.
    """
    key = _key(conf, "group", group_id)
    with _lock:
        if key not in _group_commits:
            _group_commits[key] = GroupCommits(conf, group_id)
        commits = _group_commits[key]
    commits.commit(offsets)


class GroupCommits:
    """A consumer group's offset commits, sent one at a time: offsets given while a commit
    is unanswered wait for the next call after its answer (the next epoch's), and newer ones
    replace them. Commits sent side by side can land out of order (librdkafka retries one
    while a newer one goes ahead), and lag tools would see the group's offsets go backwards.
    The last offsets of a run may stay uncommitted; its next run commits them."""

    def __init__(self, conf: dict[str, str], group_id: str) -> None:
        self.group_id = group_id
        self.waiting: dict[TP, int] | None = None
        self.in_flight = False
        settings = {**conf, "group.id": group_id, "enable.auto.commit": False}
        # It never joins the group: this only bounds how long a commit waits for a
        # coordinator to be found (librdkafka's default, 45 s, would also hold the process'
        # exit); one sent to a coordinator that hangs waits socket.timeout.ms.
        settings.setdefault("session.timeout.ms", 10_000)
        self.consumer = Consumer(client_conf(settings) | {"on_commit": self._answered})

    def commit(self, offsets: dict[TP, int]) -> None:
        self.waiting = offsets
        self.consumer.poll(0)  # the answer to the last commit, and queued log lines
        if self.in_flight:
            return
        sent = [TopicPartition(t, p, o) for (t, p), o in self.waiting.items()]
        self.consumer.commit(offsets=sent, asynchronous=True)
        self.waiting, self.in_flight = None, True

    def _answered(self, error: KafkaError | None, _partitions) -> None:
        self.in_flight = False
        if error is not None:
            log.warning("could not commit offsets to consumer group %s: %s", self.group_id, error)
