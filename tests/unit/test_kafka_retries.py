"""How the offset look-ups the source plans with are retried when a partition has no leader
for a moment, and how a run ends when no broker answers any more.

The admin client is a stand-in here: what is under test is the classification of librdkafka's
answers, which a real broker gives only in a race (a broker between leaders while it shuts
down; tests/integration/test_pipeline.py has that run).
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from confluent_kafka import KafkaError, KafkaException

from onceflow.connectors import kafka_clients
from onceflow.connectors.errors import KafkaUnreachableError
from onceflow.connectors.topics import create_topic

CONF = {"bootstrap.servers": "stand-in:9092"}
NO_LEADER = KafkaError(KafkaError._NOENT, "Failed to query partition leaders: No leaders found")
IN_QUEUE = KafkaError(KafkaError._TIMED_OUT_QUEUE, "Local: Timed out in queue")
DROPPED_BROKER = KafkaError(
    KafkaError._DESTROY_BROKER,
    "Failed while waiting for response from broker: Local: Broker handle destroyed without "
    "termination",
)


class StandInAdmin:
    """Answers list_offsets with the next of `answers` (an offset or a KafkaError) and
    list_topics with `metadata_error` if set."""

    def __init__(self, answers: list, metadata_error: KafkaError | None = None) -> None:
        self.answers = answers
        self.metadata_error = metadata_error
        self.requests = 0
        self.metadata_requests = 0
        self.timeouts: list[float] = []

    def list_offsets(self, request, request_timeout=None, **_):
        answer = self.answers[min(self.requests, len(self.answers) - 1)]
        self.requests += 1
        self.timeouts.append(request_timeout)
        futures = {}
        for tp in request:
            future: Future = Future()
            if isinstance(answer, KafkaError):
                future.set_exception(KafkaException(answer))
            else:
                future.set_result(type("Offset", (), {"offset": answer, "leader_epoch": 0})())
            futures[tp] = future
        return futures

    def list_topics(self, *_, **__):
        self.metadata_requests += 1
        if self.metadata_error is not None:
            raise KafkaException(self.metadata_error)

    def describe_topics(self, topics, request_timeout=None, **_):
        """Like librdkafka: sent to the cached controller, which hangs until a metadata
        request has named another."""
        self.requests += 1
        future: Future = Future()
        if self.metadata_requests == 0:
            future.set_exception(KafkaException(KafkaError(KafkaError._TIMED_OUT, "timed out")))
        else:
            uuid_ = type(
                "Uuid",
                (),
                {
                    "get_most_significant_bits": lambda s: 1,
                    "get_least_significant_bits": lambda s: 2,
                },
            )()
            future.set_result(type("Description", (), {"topic_id": uuid_})())
        return {name: future for name in topics.topic_names}

    def poll(self, _):
        return 0


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setenv("ONCEFLOW_KAFKA_TIMEOUT", "2")

    def install(client: StandInAdmin) -> StandInAdmin:
        monkeypatch.setattr(kafka_clients, "admin", lambda conf: client)
        return client

    return install


def test_a_partition_between_leaders_is_asked_again_until_it_has_one(stand_in):
    client = stand_in(StandInAdmin([NO_LEADER, NO_LEADER, 42]))
    assert kafka_clients.stable_ends(CONF, [("in", 0)]) == {("in", 0): 42}
    assert client.requests == 3


@pytest.mark.parametrize("unanswered", [IN_QUEUE, DROPPED_BROKER], ids=lambda e: e.name())
def test_a_request_left_unanswered_by_the_client_itself_is_asked_again(stand_in, unanswered):
    """Two ways librdkafka ends a request without an answer, seen when every connection was
    cut twice a second (each ended the run):
    - "timed out in queue": it waited while its broker's connection was down and the
      reconnect backed off (up to 10 s after repeated resets), past the request timeout;
    - "broker handle destroyed": it was sent through a bootstrap server's handle, which the
      client drops once a metadata answer names the brokers (a new admin client's first
      request)."""
    client = stand_in(StandInAdmin([unanswered, 42]))
    assert kafka_clients.stable_ends(CONF, [("in", 0)]) == {("in", 0): 42}
    assert client.requests == 2


def test_requests_that_keep_timing_out_in_the_queue_end_the_run_as_unreachable(stand_in):
    stand_in(StandInAdmin([IN_QUEUE]))
    with pytest.raises(KafkaUnreachableError) as raised:
        kafka_clients.stable_ends(CONF, [("in", 0)])
    assert str(raised.value).startswith("Kafka at stand-in:9092 did not answer within 2s")


def test_brokers_that_stopped_answering_end_the_run_as_unreachable(stand_in):
    """The partitions lost their leader as the brokers went down; then nobody answers the
    metadata request either: the run ends saying Kafka did not answer, not "no leaders"."""
    stand_in(StandInAdmin([NO_LEADER], KafkaError(KafkaError._TRANSPORT, "Connection refused")))
    with pytest.raises(KafkaUnreachableError) as raised:
        kafka_clients.stable_ends(CONF, [("in", 0)])
    assert str(raised.value).startswith("Kafka at stand-in:9092 did not answer within 2s")


def test_a_partition_that_stays_leaderless_is_named_as_such(stand_in):
    stand_in(StandInAdmin([NO_LEADER]))
    with pytest.raises(KafkaUnreachableError) as raised:
        kafka_clients.stable_ends(CONF, [("in", 0)])
    assert "No leaders found" in str(raised.value)
    assert "Check that every partition of the subscribed topics has a leader" in str(raised.value)


def test_an_offset_look_up_gives_its_first_attempt_2_s_and_the_next_ones_5(stand_in):
    """A live leader answers at once: a first attempt that waits 2 s in vain went to a leader
    that hangs (asked again where the refreshed metadata says); a broker slow to answer, or
    a new TLS connection, still gets 5 s on the next attempts, and every look-up starts
    over at 2 s."""
    timed_out = KafkaError(KafkaError._TIMED_OUT, "timed out")
    client = stand_in(StandInAdmin([timed_out, timed_out, 42, 43]))
    assert kafka_clients.stable_ends(CONF, [("in", 0)]) == {("in", 0): 42}
    assert kafka_clients.stable_ends(CONF, [("in", 0)]) == {("in", 0): 43}
    assert client.timeouts == [2, 5, 5, 2]


def test_a_topic_id_request_that_a_hung_controller_left_unanswered_goes_elsewhere(stand_in):
    """describe_topics waits on one broker (the controller in the client's metadata): only a
    metadata refresh sends the next attempt to another. Without it every retry waited on a
    hung broker until the run gave up (tests/fault/test_cluster.py, a hung coordinator)."""
    client = stand_in(StandInAdmin([0]))
    assert list(kafka_clients.topic_ids(CONF, ["in"])) == ["in"]
    assert client.requests == 2 and client.metadata_requests == 1


def test_a_partition_answered_without_an_offset_is_asked_again(stand_in):
    """librdkafka can merge a leader's failed answer into "no offset" (-1001) without an
    error; planning a batch with it would read nothing or go backwards."""
    client = stand_in(StandInAdmin([-1001, 42]))
    assert kafka_clients.stable_ends(CONF, [("in", 0)]) == {("in", 0): 42}
    assert client.requests == 2


def test_every_client_gives_up_on_an_unanswered_request_before_kafka_moves_its_leaders():
    """A hung broker answers nothing; librdkafka waits 60 s by default (a transactional
    producer: its transaction timeout), and 10 s for a new connection's first answer, before
    it drops the connection and looks again."""
    conf = kafka_clients.client_conf(CONF)
    assert conf["socket.timeout.ms"] == kafka_clients.REQUEST_ANSWER_TIMEOUT_MS <= 5_000
    assert conf["api.version.request.timeout.ms"] == kafka_clients.FIRST_ANSWER_TIMEOUT_MS
    transactional = {**CONF, "transactional.id": "t", "transaction.timeout.ms": "4000"}
    assert kafka_clients.client_conf(transactional)["socket.timeout.ms"] == 3900
    # A broker holding a produce for its replicas answers before the client gives up on it.
    assert kafka_clients.PRODUCE_WAIT_MS < kafka_clients.REQUEST_ANSWER_TIMEOUT_MS
    own = {**CONF, "socket.timeout.ms": "30000", "api.version.request.timeout.ms": "9000"}
    client = kafka_clients.client_conf(own)
    assert {name: client[name] for name in own} == own


def test_a_topic_creation_the_client_gave_up_on_is_asked_again(stand_in):
    """A controller that is moving or slow leaves CreateTopics unanswered within the client's
    timeout; the request may still have been carried out, so the retry may find the topic."""

    client = stand_in(Creating([0]))
    create_topic(CONF, "markers")
    assert client.creations == 2


def test_a_new_topic_is_ready_only_once_its_leaders_answer_for_it(stand_in):
    """On a cluster the broker that answers the metadata request can know a new topic before
    its leader does; the leader answers UNKNOWN_TOPIC_OR_PART, and a caller that looked up
    offsets at once failed (a fresh-clone CI run on 80bcc8b)."""
    unknown = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, "Broker: Unknown topic or partition")
    client = stand_in(Creating([unknown, 0]))
    create_topic(CONF, "markers")
    assert client.requests == 2  # offset look-ups: the second one answered


class Creating(StandInAdmin):
    """Creates a topic at the second attempt (the first timed out), whose partition 0 has a
    leader in the metadata."""

    creations = 0

    def create_topics(self, topics, **_):
        self.creations += 1
        future: Future = Future()
        code = KafkaError._TIMED_OUT if self.creations == 1 else KafkaError.TOPIC_ALREADY_EXISTS
        future.set_exception(KafkaException(KafkaError(code)))
        return {topics[0].topic: future}

    def list_topics(self, topic, **_):
        partition = type("Partition", (), {"leader": 1})()
        meta = type("Topic", (), {"error": None, "partitions": {0: partition}})()
        return type("Metadata", (), {"topics": {topic: meta}})()


@pytest.fixture
def own_admins(monkeypatch):
    """The process' admin clients emptied for the test; `age(conf)` makes the client of
    `conf` old enough to be replaced."""
    for name, empty in (("_admins", {}), ("_admins_made", {}), ("_retired_admins", [])):
        monkeypatch.setattr(kafka_clients, name, empty)

    def age(conf: dict[str, str]) -> None:
        kafka_clients._admins_made[kafka_clients._key(conf)] -= kafka_clients.ADMIN_REPLACED_EVERY_S

    return age


UNHEARD = {"bootstrap.servers": "127.0.0.1:1"}  # nothing listens: connections are refused


def test_an_admin_client_that_got_no_answer_is_replaced_and_kept_until_its_requests_end(
    monkeypatch, own_admins
):
    """librdkafka asks the broker it last sent to for metadata: after no answer, likely the
    hung one; a new client asks brokers that answer it. The old one is kept: destroying it
    would leave another thread's futures from it pending for ever."""
    conf = UNHEARD
    first = kafka_clients.admin(conf)
    no_answer = KafkaException(KafkaError(KafkaError._TIMED_OUT, "timed out"))
    kafka_clients._replace_admin(conf)  # made a moment ago: kept
    assert kafka_clients.admin(conf) is first
    own_admins(conf)
    monkeypatch.setattr(kafka_clients.AdminClient, "list_topics", lambda *a, **k: None)
    assert kafka_clients._refresh_metadata(conf, ["in"], no_answer) is None
    second = kafka_clients.admin(conf)
    assert second is not first
    assert [client for _, client in kafka_clients._retired_admins] == [first]
    refused = KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION, "not leader"))
    own_admins(conf)
    assert kafka_clients._refresh_metadata(conf, ["in"], refused) is None
    assert kafka_clients.admin(conf) is second  # an answer, even a refusal: the client is fine
    # Once every request made through it has ended, the next look-up lets it go.
    retired, client = kafka_clients._retired_admins[0]
    kafka_clients._retired_admins[0] = (retired - kafka_clients.RETIRED_ADMIN_KEEP_S, client)
    del client
    assert kafka_clients.admin(conf) is second
    assert kafka_clients._retired_admins == []


def test_a_metadata_request_that_got_no_answer_is_asked_again_by_a_new_client(
    monkeypatch, own_admins
):
    monkeypatch.setenv("ONCEFLOW_KAFKA_TIMEOUT", "5")
    conf = UNHEARD
    first = kafka_clients.admin(conf)
    own_admins(conf)
    asked = []

    def list_topics(client, *_, **__):
        asked.append(client)
        if len(asked) == 1:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "timed out"))
        return "metadata"

    monkeypatch.setattr(kafka_clients.AdminClient, "list_topics", list_topics)
    assert kafka_clients.metadata(conf) == "metadata"
    assert asked[0] is first and asked[1] is not first
    assert [client for _, client in kafka_clients._retired_admins] == [first]


class StandInGroupConsumer:
    """Takes commits and answers each at the poll after `answer()`."""

    def __init__(self, config: dict) -> None:
        self.on_commit = config["on_commit"]
        self.sent: list[list[int]] = []
        self.answers: list[KafkaError | None] = []

    def commit(self, offsets, asynchronous):
        assert asynchronous  # never waits for the group's coordinator
        self.sent.append([tp.offset for tp in offsets])

    def answer(self, error: KafkaError | None = None) -> None:
        self.answers.append(error)

    def poll(self, timeout):
        while self.answers:
            self.on_commit(self.answers.pop(0), [])


def test_a_groups_offsets_are_committed_one_at_a_time_the_newest_waiting(monkeypatch, caplog):
    """Commits sent side by side can land out of order (librdkafka retries one while a newer
    one goes ahead): lag tools would see the group's offsets go backwards."""
    monkeypatch.setattr(kafka_clients, "Consumer", StandInGroupConsumer)
    monkeypatch.setattr(kafka_clients, "_group_commits", {})
    group = "group-one-at-a-time"
    for offset in (10, 20, 30):  # 20 and 30 while 10 is unanswered: 30 waits, 20 is dropped
        kafka_clients.commit_group_offsets(CONF, group, {("in", 0): offset})
    consumer = kafka_clients._group_commits[kafka_clients._key(CONF, "group", group)].consumer
    assert consumer.sent == [[10]]
    consumer.answer(KafkaError(KafkaError._TIMED_OUT, "no answer"))
    with caplog.at_level("WARNING", logger="onceflow.kafka"):
        kafka_clients.commit_group_offsets(CONF, group, {("in", 0): 40})
    assert consumer.sent == [[10], [40]]
    assert "could not commit offsets to consumer group group-one-at-a-time" in caplog.text
