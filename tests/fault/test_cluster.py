"""Exactly-once on a three-node Kafka cluster (three replicas, min ISR 2), as users run Kafka:
the sink's transaction coordinator dies while the driver commits, then hangs, then every node
restarts in turn, then one loses its disk; and, on another pipeline, the network between the
service and the brokers turns slow, loses answers, loses requests and breaks connections.
A read_committed reader watches each pipeline's output as it is written.

The default run is the short version (a windowed pipeline); `--long` also runs it
pass-through, where the reader checks that one key's records of one input partition keep
their order.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import shutil
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from onceflow.connectors import kafka_clients
from onceflow.connectors.checkpoint import CheckpointDir
from onceflow.connectors.markers import last_marker, marker_topic_for
from onceflow.connectors.topics import create_topic, read_committed
from onceflow.local_cluster import LocalCluster
from onceflow.local_kafka import LocalKafka
from tests.fault.live_checker import LiveChecker
from tests.fault.test_faults import (
    BASE,
    FLUSH_TS,
    USERS,
    Scenario,
    Service,
    _click,
    _committed,
)
from tests.helpers import free_ports, produce, wait_until
from tests.tcp_proxy import CUT, END_TXN, INIT_PRODUCER_ID, LOSE_ANSWERS, TO_SERVER, Proxy

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
def cluster(request):
    nodes = request.config.getoption("--nodes")
    if nodes < 3:
        pytest.skip(f"--nodes {nodes}: the cluster scenarios need three nodes or more")
    if nodes > 5:
        pytest.fail(f"--nodes {nodes}: at most 5 (each node's proxied listener is 5 ports up)")
    if not sys.platform.startswith("linux"):
        pytest.skip("the local cluster runs on Linux only (CI runs these scenarios there)")
    # Ports from the first: clients, proxied listeners (+5), controllers (+10), proxies.
    port = free_ports(nodes + 10 + nodes)
    proxies = tuple(range(port + 10 + nodes, port + 10 + 2 * nodes))
    cluster = LocalCluster(LocalKafka.from_env().home, port, nodes, proxy_ports=proxies)
    try:
        cluster.start(progress=print)
        yield cluster
    finally:
        cluster.stop(progress=print)
        shutil.rmtree(cluster.directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def _whole_cluster_after(cluster):
    """After each test, every node runs and answers, even where the test failed between a
    fault and its end: the next test starts on three nodes in sync."""
    yield
    for node in cluster.nodes:
        if node.pid() is not None:
            node.pause(False)
    for node_id in range(1, cluster.size + 1):
        if cluster.node(node_id).pid() is None:
            cluster.start_node(node_id, progress=print)
    cluster.wait_in_sync(progress=print)


@pytest.fixture
def running():
    """What a test starts that must not outlive it when it fails: services (killed), and the
    feeder's, the reader's and the commit watch's threads (stopped)."""
    started: list = []
    yield started
    for thing in reversed(started):
        with contextlib.suppress(Exception):
            if isinstance(thing, Service):
                if thing.process.poll() is None:
                    thing.kill()
            else:
                thing._stop.set()


def pytest_generate_tests(metafunc) -> None:
    if "cluster_pipeline" in metafunc.fixturenames:
        long = metafunc.config.getoption("--long")
        metafunc.parametrize(
            "cluster_pipeline", ["windowed", "pass-through"] if long else ["windowed"]
        )


def test_the_coordinator_dies_in_a_commit_then_hangs_then_every_node_restarts_in_turn(
    cluster, cluster_pipeline, tmp_path, monkeypatch, running, request
):
    """Then, with --long, the coordinator loses its disk (the short run stays in the suite's
    time budget)."""
    windowed = cluster_pipeline == "windowed"
    topics = {n: _topic(cluster, n) for n in ("in", "out", "dlq", "late")}
    feeder = Feeder(cluster.bootstrap, topics["in"])  # clicks arrive all along the faults
    app = Scenario(cluster.bootstrap, topics, [], tmp_path, long=False)
    # Clicks of a partition whose leader hangs wait in the feeder's producer while the other
    # partitions' move event time on (2.8 s of it per second): a watermark delay of 30 s
    # keeps them from being late, so every click must be in its window.
    pipeline = app.pipeline(
        windowed=windowed,
        source={"max_records_per_batch": 2_000},
        event_time={"watermark_delay": "30s"},
    )
    checker = LiveChecker(
        cluster.bootstrap,
        topics["out"],
        partitions=3,
        identity=_window if windowed else _source,
        order=None if windowed else _key_and_source_offset,
    )
    commits = app.tmp / "checkpoint" / "commits"
    held = tmp_path / "held"
    monkeypatch.setenv("ONCEFLOW_FAULT_HOLD_FILE", str(held))
    # Epoch 8 is the first sure to publish windows: epochs 0 and 1 are small (a start's first
    # epochs), the next of 2,000 clicks (14 s of event time) each.
    service = app.service(pipeline, fault="hold:before_kafka_commit@8")
    watch = CommitWatch(commits)
    running.extend([feeder, checker, service, watch])
    stalls = {}

    # 1. The coordinator of the sink's transactional id dies with epoch 8's transaction open
    #    and produced, as the driver commits it.
    wait_until(lambda: held.exists() or service.process.poll() is not None, 180, "epoch 8")
    assert service.process.poll() is None, service.report()
    sink = f"onceflow-fault-{topics['in']}-{topics['out']}"  # the sink's transactional id
    coordinator = cluster.transaction_coordinator(sink)
    before = _committed(commits)
    killed = time.monotonic()
    cluster.node(coordinator).kill()
    held.unlink()
    _next_commit(service, commits, before)
    cluster.start_node(coordinator, progress=print)
    stalls[f"node {coordinator}, the coordinator, SIGKILLed in a commit"] = watch.longest_gap(
        killed
    )

    # 2. A hung node: the coordinator, wherever it is now, stops answering but keeps its
    #    connections (SIGSTOP), for longer than a client waits for an answer; the pipeline
    #    must go on committing without it, then it resumes and catches up.
    coordinator = cluster.transaction_coordinator(sink)
    before, hung = _committed(commits), time.monotonic()
    cluster.node(coordinator).pause()
    try:
        _next_commit(service, commits, before + 2)  # one may have been on its way already
        stalls[f"node {coordinator}, the coordinator, hung (SIGSTOP)"] = watch.longest_gap(hung)
    finally:
        cluster.node(coordinator).pause(False)
    cluster.wait_in_sync(progress=print)

    # 3. A rolling restart: each node stopped cleanly and started again, in turn.
    for node in range(1, cluster.size + 1):
        before, stopping = _committed(commits), time.monotonic()
        cluster.node(node).stop(progress=print)
        _next_commit(service, commits, before)
        cluster.start_node(node, progress=print)
        stalls[f"node {node} stopped cleanly, then started"] = watch.longest_gap(stopping)

    if request.config.getoption("--long"):
        # 4. A node loses its disk: the coordinator, SIGKILLed, comes back with an empty data
        #    directory and copies every replica from the other two. Then each of those restarts
        #    in turn, so that the rebuilt node leads partitions: had it come back without data
        #    that was committed, the reader would see records vanish or go missing.
        lost = cluster.transaction_coordinator(sink)
        before, killed = _committed(commits), time.monotonic()
        cluster.node(lost).kill()
        shutil.rmtree(cluster.node(lost).data_dir)
        cluster.start_node(lost, progress=print)
        _next_commit(service, commits, before)
        stalls[f"node {lost}, the coordinator, lost its disk, back empty"] = watch.longest_gap(
            killed
        )
        led_by_rebuilt: set[str] = set()
        for node in range(1, cluster.size + 1):
            if node != lost:
                before, stopping = _committed(commits), time.monotonic()
                cluster.node(node).stop(progress=print)
                _next_commit(service, commits, before)
                led_by_rebuilt |= _partitions_led_by(cluster, lost)
                cluster.start_node(node, progress=print)
                stalls[f"node {node} restarted, node {lost} rebuilt"] = watch.longest_gap(stopping)
        print(
            f"node {lost}, rebuilt, led {len(led_by_rebuilt)} partitions: {sorted(led_by_rebuilt)}"
        )
        assert led_by_rebuilt & {f"{topics['out']}/{p}" for p in range(3)}, led_by_rebuilt

    watch.stop()
    app.events = feeder.stop()
    assert service.terminate() == 0, service.report()
    # After the stop: the drain that reads it also runs the epoch that closes the windows.
    produce(cluster.bootstrap, topics["in"], [(b"u0", _click("u0", FLUSH_TS), 0)])
    app.drain(pipeline)
    figures = checker.finish()
    print(f"cluster of {cluster.size}, {cluster_pipeline}: longest time without a commit")
    for fault, seconds in stalls.items():
        print(f"  {fault}: {seconds:.1f} s")
    print(
        f"read_committed during the faults: {figures['seen_live']} records, "
        f"{len(figures['duplicates'])} published twice, {len(figures['vanished'])} seen then "
        f"gone, {len(figures['out_of_order'])} out of order; {figures['final']} at the end"
    )
    assert figures["duplicates"] == figures["vanished"] == figures["out_of_order"] == []
    if windowed:
        app.check_windows()
    else:
        app.check_pass_through()


def test_a_slow_then_broken_network_between_the_service_and_the_brokers(
    cluster, tmp_path, monkeypatch, running
):
    """The service reaches the cluster only through a proxy per node (the feeder and the
    reader do not): first slow, then losing the answer to a commit that went through, then
    holding requests, then cutting every connection, then cutting them while a restarted
    service starts (and the one that carries its InitProducerId as that request leaves)."""
    proxies = [
        Proxy(cluster.proxy_ports[k - 1], ("127.0.0.1", cluster.node(k).proxied_listener_port))
        for k in range(1, cluster.size + 1)
    ]
    topics = {n: _topic(cluster, n) for n in ("in", "out", "dlq", "late")}
    sink = f"onceflow-fault-{topics['in']}-{topics['out']}"  # the sink's transactional id
    feeder = Feeder(cluster.bootstrap, topics["in"])
    app = Scenario(cluster.bootstrap, topics, [], tmp_path, long=False)
    pipeline = app.pipeline(
        windowed=True,
        kafka={"bootstrap_servers": ",".join(proxy.address for proxy in proxies)},
        source={"max_records_per_batch": 2_000},
        event_time={"watermark_delay": "30s"},
    )
    checker = LiveChecker(cluster.bootstrap, topics["out"], partitions=3, identity=_window)
    running.extend([feeder, checker])
    commits = app.tmp / "checkpoint" / "commits"
    held = tmp_path / "held"
    monkeypatch.setenv("ONCEFLOW_FAULT_HOLD_FILE", str(held))
    stalls = {}

    def every_link(fault: str, *args) -> None:
        for proxy in proxies:
            getattr(proxy, fault)(*args)

    try:
        # 1. A slow link at the start: what either side sends arrives 0.1 s later, through
        #    the start-up's marker read, init_transactions and the first epoch.
        every_link("delay", 0.1)
        service = app.service(pipeline, fault="hold:before_kafka_commit@8")
        running.append(service)
        started = time.monotonic()
        _next_commit(service, commits, 0)
        slow_start = time.monotonic() - started
        every_link("delay", 0)
        # Epoch 8 is the first sure to publish windows (a Kafka transaction to commit).
        wait_until(lambda: held.exists() or service.process.poll() is not None, 240, "epoch 8")
        assert service.process.poll() is None, service.report()
        watch = CommitWatch(commits)
        running.append(watch)

        # 2. The commit's answer lost: epoch 8's EndTxn reaches its coordinator, which commits,
        #    and from then on nothing comes back from that node for 8 s, longer than a client
        #    waits for an answer: the service cannot know the outcome until it asks again.
        before, lost = _committed(commits), time.monotonic()
        every_link("arm", END_TXN, LOSE_ANSWERS)
        held.unlink()
        wait_until(lambda: any(proxy.sprung for proxy in proxies), 30, "epoch 8's EndTxn")
        every_link("arm", None)
        wait_until(lambda: _published_batch(cluster, sink) == 8, 30, "epoch 8 on the brokers")
        # The service leaves the unanswered commit to a new producer, which waits for that
        # node's answer to settle the transaction, and then reads the marker.
        left = "epoch 8: Kafka has answered nothing of the commit"
        wait_until(lambda: left in service.log.read_text(), 30, "the commit left unanswered")
        assert _committed(commits) == before  # committed, and the service does not know it
        time.sleep(max(0, 8 - (time.monotonic() - lost)))  # the fault's length
        every_link("release")
        _next_commit(service, commits, before)
        stalls["the answer to epoch 8's commit lost, 8 s"] = watch.longest_gap(lost)

        # 3. Requests held: nothing the service sends reaches a broker for 8 s.
        before, lost = _committed(commits), time.monotonic()
        every_link("hold", TO_SERVER)
        time.sleep(8)  # the fault's length
        every_link("release")
        _next_commit(service, commits, before)
        stalls["requests held for 8 s"] = watch.longest_gap(lost)

        # 4. Every connection cut twice a second for 10 s: in fetches, produces and commits.
        before, cutting = _committed(commits), time.monotonic()
        cuts = 0
        while time.monotonic() - cutting < 10:
            cuts += sum(proxy.cut() for proxy in proxies)
            time.sleep(0.5)  # the fault's rhythm
        _next_commit(service, commits, before)
        stalls[f"every connection cut twice a second for 10 s ({cuts} cut)"] = watch.longest_gap(
            cutting
        )
        watch.stop()

        # 5. A restart while connections break: the one carrying the sink's InitProducerId
        #    cut as that request leaves, and every connection each second until the new sink
        #    has read its last marker.
        assert service.terminate() == 0, service.report()
        before, sprung = _committed(commits), sum(len(proxy.sprung) for proxy in proxies)
        every_link("arm", INIT_PRODUCER_ID, CUT)
        service = app.service(pipeline)
        running.append(service)
        restarted, cuts = time.monotonic(), 0
        ready = re.compile(r"TransactionalPublisher producer \S+ ready")
        # (For 20 s at most: reconnect backoffs grow with each cut.)
        while not ready.search(service.log.read_text()) and time.monotonic() - restarted < 20:
            assert service.process.poll() is None, service.report()
            cuts += sum(proxy.cut() for proxy in proxies)
            time.sleep(1)  # the fault's rhythm
        wait_until(lambda: ready.search(service.log.read_text()), 180, "the sink ready")
        every_link("arm", None)
        assert sum(len(proxy.sprung) for proxy in proxies) == sprung + 1  # InitProducerId's cut
        _next_commit(service, commits, before)
        stalls[f"a restart, InitProducerId's connection and {cuts} more cut"] = (
            time.monotonic() - restarted
        )
        app.events = feeder.stop()
        assert service.terminate() == 0, service.report()
        produce(cluster.bootstrap, topics["in"], [(b"u0", _click("u0", FLUSH_TS), 0)])
        app.drain(pipeline)
    finally:
        every_link("close")
    figures = checker.finish()
    print(f"network between the service and a cluster of 3: first epoch {slow_start:.1f} s after")
    print("a start through a link 0.1 s slow each way; then the longest time without a commit")
    for fault, seconds in stalls.items():
        print(f"  {fault}: {seconds:.1f} s")
    print(
        f"read_committed during the faults: {figures['seen_live']} records, "
        f"{len(figures['duplicates'])} published twice, {len(figures['vanished'])} seen then "
        f"gone; {figures['final']} at the end"
    )
    assert figures["duplicates"] == figures["vanished"] == []
    app.check_windows()


def _published_batch(cluster: LocalCluster, sink: str) -> int | None:
    """The last epoch `sink` committed, read from the brokers directly (not through the
    proxies); None while its transaction is open or nothing answers."""
    try:
        conf = {"bootstrap.servers": cluster.bootstrap}
        marker = last_marker(conf, marker_topic_for(sink), sink, 5)
    except Exception:
        return None
    return None if marker is None else marker.batch_id


def test_an_offset_look_up_waiting_for_a_dead_leader_does_not_spin(cluster):
    """While Kafka moves the leaders of a SIGKILLed node (its session timeout, 9 s), the
    source's offset look-up waits and retries: it must wait, not reconnect to the dead
    node's port in a busy loop (librdkafka's admin client did, with sparse connections: a
    core gone while the cluster recovers)."""
    topic = _topic(cluster, "spin")
    conf = {"bootstrap.servers": cluster.bootstrap}
    partitions = [(topic, p) for p in range(3)]
    kafka_clients.stable_ends(conf, partitions)  # the client is connected and knows leaders
    from confluent_kafka.admin import AdminClient

    leaders = AdminClient(conf).list_topics(topic, timeout=30).topics[topic].partitions
    victim = leaders[0].leader
    cluster.node(victim).kill()
    try:
        wall, cpu = time.monotonic(), _cpu_seconds()
        assert kafka_clients.stable_ends(conf, partitions) == dict.fromkeys(partitions, 0)
        wall, cpu = time.monotonic() - wall, _cpu_seconds() - cpu
    finally:
        cluster.start_node(victim, progress=print)
    print(f"the look-up waited {wall:.1f} s for node {victim}'s leaders, using {cpu:.1f} s of CPU")
    assert cpu < 0.25 * wall


def test_a_read_answered_by_a_leader_that_was_paused_waits_for_its_records_not_skips_them(
    cluster, tmp_path, caplog, monkeypatch
):
    """A leader paused past its session timeout (a long GC pause, a hung host) loses its
    partitions; resumed, it answers as the leader it was until it learns otherwise, and a
    read of records the new leader took meanwhile is told they are past its log. They are
    not gone: the read must deliver them. (It took them for data loss: skipped with
    failOnDataLoss=false, a failed query by default; seen in bench.broker_faults.)"""
    from onceflow.connectors.source import OffsetRange

    # The read waits for the resumed node's answer: neither a request timeout nor a new
    # consumer (after FETCH_STALL_S) may go around it, however slowly its JVM resumes.
    conf = {"bootstrap.servers": cluster.bootstrap, "socket.timeout.ms": "30000"}
    monkeypatch.setattr("onceflow.connectors.source.FETCH_STALL_S", 30.0)
    around: list[str] = []  # attempts whose read never asked the paused node
    for attempt in range(ATTEMPTS_TO_REACH_A_PAUSED_LEADER):
        topic = _topic(cluster, "paused-leader")
        checkpoint = CheckpointDir(tmp_path / f"checkpoint-{attempt}")
        with _leader_paused_after_a_read(cluster, topic, conf) as paused:
            before = _bytes_waiting_at(paused.port)
            read: list = []  # the offsets read, or the error the read ended with
            reader = _reading(read, conf, OffsetRange(topic, 0, 15, 20), checkpoint)
            with caplog.at_level("WARNING", logger="onceflow.source"):
                reader.start()
                # The fetch waits in the paused node's socket: it reads it first thing on
                # resume. Unless the consumer's metadata already named the new leader (it
                # asked a live node on assigning the partition): then no request of the read
                # reaches the paused node, the read takes the records from the new leader,
                # and the scenario is tried again on a new topic.
                asked = _waited_for(
                    lambda b=before, r=read, p=paused.port: (
                        _more_waiting(b, _bytes_waiting_at(p)) or r
                    ),
                    10,
                )
                reached = asked and not read
                after = _bytes_waiting_at(paused.port)
                paused.pause(False)
                reader.join(60)
        assert read == [list(range(15, 20))]
        assert checkpoint.source_stats() == {}  # nothing counted as lost
        if reached:
            break
        around.append(
            f"read {read} without asking the paused node (bytes waiting per "
            f"connection before the read {before}, after {after})"
        )
        caplog.clear()
    else:
        raise AssertionError(
            f"in {ATTEMPTS_TO_REACH_A_PAUSED_LEADER} attempts no read asked the paused leader: "
            + "; ".join(around)
        )
    answered = [r.getMessage() for r in caplog.records if "is not in its log" in r.getMessage()]
    waited = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    print(
        f"the paused leader's answers: {answered + waited}; attempts that went around it: "
        f"{len(around)}"
    )
    assert answered or waited  # the resumed node did answer out of range


ATTEMPTS_TO_REACH_A_PAUSED_LEADER = 3


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_a_log_an_unclean_election_truncated_and_that_grew_back_past_the_checkpoint_is_loss(
    cluster, spark, tmp_path, fail_on_data_loss
):
    """A partition on nodes 1 and 2 that takes writes with one replica and may elect an
    out-of-sync one (unclean.leader.election.enable, min.insync.replicas 1, as some users
    run Kafka): node 2 stops, 10 records go to node 1 and the query reads them; node 1
    stops, node 2 is elected with none of them, and producers write 15 others. The log holds
    offset 10 again, so the offsets alone say nothing was lost, and the query read on from
    10 over records that are not what it read before: the old records 0-9 were processed,
    the new ones at offsets 0-9 never are. With the leader epoch logged beside offset 10
    the next batch's read sees the truncation: the query fails, or (failOnDataLoss=false)
    counts the new records below the checkpoint, which no batch reads, and reads the batch
    (planned on the new log)."""
    from tests.helpers import drain, source_reader

    topic = _unclean_topic(cluster, "unclean")
    cluster.node(2).stop(progress=print)
    wait_until(lambda: _isr(cluster.bootstrap, topic) == [1], 60, "node 2 out of the ISR")
    _write(cluster.bootstrap, topic, [b"old-%d" % i for i in range(10)])
    checkpoint = str(tmp_path / "ck")
    options = {"failOnDataLoss": str(fail_on_data_loss).lower(), "checkpointLocation": checkpoint}
    rows, _ = drain(source_reader(spark, cluster.bootstrap, topic, **options), checkpoint)
    assert [(r.offset, r.value) for r in rows] == [(i, b"old-%d" % i) for i in range(10)]

    cluster.node(1).stop(progress=print)
    cluster.start_node(2, progress=print, in_sync=False)
    wait_until(lambda: _leaders(cluster.bootstrap, topic).get(0) == 2, 60, "node 2 elected")
    _write(cluster.bootstrap, topic, [b"new-%d" % i for i in range(15)])
    # The scenario holds: offset 10 is in the log again, with another record.
    assert kafka_clients.stable_ends({"bootstrap.servers": cluster.bootstrap}, [(topic, 0)]) == {
        (topic, 0): 15
    }

    reader = source_reader(spark, cluster.bootstrap, topic, **options)
    if fail_on_data_loss:
        with pytest.raises(Exception, match=r"data loss on topic .* log was truncated"):
            drain(reader, checkpoint)
        return
    rows, _ = drain(reader, checkpoint)  # the batch planned on the new log: read
    assert [(r.offset, r.value) for r in rows] == [(i, b"new-%d" % i) for i in range(10, 15)]
    assert CheckpointDir(checkpoint).source_stats() == {(topic, 0): 10}  # new-0 to new-9


def test_a_log_an_unclean_election_cut_below_the_checkpoint_restarts_where_it_was_cut(
    cluster, spark, tmp_path
):
    """The same partition, with 5 records on both replicas and 5 more on node 1 alone, which
    the query reads; node 2 is elected with the first 5, and producers write 2 others, at
    offsets 5 and 6. The log ends below the checkpoint's offset 10 and stays there. With
    failOnDataLoss=false the partition restarted from its earliest offset: old-0 to old-4
    were published twice. The leader's answer for the epoch logged with offset 10 says the
    log was cut at 5: the query reads new-5 and new-6, and nothing it read before."""
    from tests.helpers import drain, source_reader

    topic = _unclean_topic(cluster, "unclean-cut")
    _write(cluster.bootstrap, topic, [b"old-%d" % i for i in range(5)])
    cluster.node(2).stop(progress=print)
    wait_until(lambda: _isr(cluster.bootstrap, topic) == [1], 60, "node 2 out of the ISR")
    _write(cluster.bootstrap, topic, [b"old-%d" % i for i in range(5, 10)])
    checkpoint = str(tmp_path / "ck")
    options = {"failOnDataLoss": "false", "checkpointLocation": checkpoint}
    rows, _ = drain(source_reader(spark, cluster.bootstrap, topic, **options), checkpoint)
    assert [(r.offset, r.value) for r in rows] == [(i, b"old-%d" % i) for i in range(10)]

    cluster.node(1).stop(progress=print)
    cluster.start_node(2, progress=print, in_sync=False)
    wait_until(lambda: _leaders(cluster.bootstrap, topic).get(0) == 2, 60, "node 2 elected")
    _write(cluster.bootstrap, topic, [b"new-5", b"new-6"])
    # The scenario holds: the log ends below the checkpoint, and starts with the old records.
    conf = {"bootstrap.servers": cluster.bootstrap}
    assert kafka_clients.stable_ends(conf, [(topic, 0)]) == {(topic, 0): 7}

    rows, _ = drain(source_reader(spark, cluster.bootstrap, topic, **options), checkpoint)
    assert [(r.offset, r.value) for r in rows] == [(5, b"new-5"), (6, b"new-6")]
    assert CheckpointDir(checkpoint).source_stats() == {}  # every record read was there


def _unclean_topic(cluster: LocalCluster, prefix: str) -> str:
    """A new topic of one partition on nodes 1 and 2, both in sync, that takes writes with one
    replica and may elect an out-of-sync one (unclean.leader.election.enable, min.insync.replicas
    1, as some users run Kafka)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"{prefix}-{uuid.uuid4().hex[:10]}"
    settings = {"unclean.leader.election.enable": "true", "min.insync.replicas": "1"}
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
    new = NewTopic(topic, num_partitions=1, replica_assignment=[[1, 2]], config=settings)
    admin.create_topics([new])[topic].result()
    wait_until(lambda: _isr(cluster.bootstrap, topic) == [1, 2], 30, "both replicas in sync")
    return topic


def _isr(bootstrap: str, topic: str) -> list[int]:
    """The in-sync replicas of partition 0 of `topic` (none while the answering broker does
    not know the partition yet)."""
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    partition = meta.topics[topic].partitions.get(0)
    return sorted(partition.isrs) if partition is not None else []


def _write(bootstrap: str, topic: str, values: list[bytes]) -> None:
    """`values` to partition 0, acknowledged by the in-sync replicas, without transactions or
    idempotence (a new producer id needs the active controller, which may be stopped)."""
    writer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": False})
    for value in values:
        writer.produce(topic, value=value, partition=0)
    assert writer.flush(30) == 0


def _waited_for(condition, timeout_s: float) -> bool:
    """Whether `condition` held within `timeout_s` (polled)."""
    try:
        wait_until(condition, timeout_s)
    except AssertionError:
        return False
    return True


def test_look_ups_reads_and_commits_leave_a_node_that_hangs_for_the_new_one(cluster, caplog):
    """A node that hangs (SIGSTOP: alive to TCP, answering nothing) holds what was sent to it
    until the client's request timeout (60 s here; onceflow's 5 s made a hung node cost more
    than a dead one). Kafka moves its partitions and the transactions it coordinates after
    its session timeout; clients that knew it must follow them then:
    - an offset look-up, whose metadata request librdkafka sends to the broker it last sent
      to, the hung one, again and again (a new admin client asks another);
    - a read (a new range consumer);
    - a sink's commit, whose producer keeps sending to the coordinator it found (a new
      producer looks it up again and settles the transaction);
    - the source's commit of its consumer group's offsets (for lag tooling), which Spark
      calls between two epochs: in the background, it must not hold the pipeline."""
    from onceflow.connectors.publisher import TransactionalPublisher
    from onceflow.connectors.source import OffsetRange, read_range

    # A node that coordinates transactions and consumer groups, and a topic it leads.
    out = _topic(cluster, "hung-coordinator-out")
    leader = _coordinating_node(cluster, out)
    topic = _topic_led_by(cluster, leader)
    conf = {"bootstrap.servers": cluster.bootstrap, "socket.timeout.ms": "60000"}
    conf["client.id"] = "hung-leader"  # clients of its own (the process caches them by conf)
    # The process' admin client for `conf` knows the leader and has sent to it last.
    assert kafka_clients.stable_ends(conf, [(topic, 0)]) == {(topic, 0): 0}
    # A sink and a consumer group that the leader coordinates, each with a commit behind it.
    sink = _coordinated_by(leader, cluster.transaction_coordinator)
    publisher = TransactionalPublisher(conf, sink, marker_topic_for(sink))
    sent = [(out, None, None, f"epoch {n}".encode(), None) for n in (0, 1)]
    assert publisher.publish(0, "q", sent[:1], [{"in": {"0": 1}}])
    group = _coordinated_by(leader, cluster.group_coordinator)
    kafka_clients.commit_group_offsets(conf, group, {(topic, 0): 10})
    wait_until(lambda: _group_offset(cluster, group, topic) == 10, 30, "the group's offset")
    paused = _leader_paused_after_a_read(cluster, topic, conf)
    with caplog.at_level("WARNING", logger="onceflow"), paused as hung:
        looked_up = time.monotonic()
        assert kafka_clients.stable_ends(conf, [(topic, 0)]) == {(topic, 0): 20}
        look_up_s = time.monotonic() - looked_up
        read: list = []
        reader = _reading(read, conf, OffsetRange(topic, 0, 10, 20))
        reader.start()
        reader.join(30)
        assert read == [list(range(10, 20))]  # while the old leader still hangs
        live = ",".join(n.bootstrap for n in cluster.nodes if n.port != hung.port)
        assert cluster.transaction_coordinator(sink, live) != hung.node_id  # Kafka moved it
        committing = time.monotonic()
        assert publisher.publish(1, "q", sent[1:], [{"in": {"0": 2}}])
        commit_s = time.monotonic() - committing
        committing = time.monotonic()
        kafka_clients.commit_group_offsets(conf, group, {(topic, 0): 20})
        group_commit_s = time.monotonic() - committing
    cluster.wait_in_sync(progress=print)  # (a resumed leader answers as one until it learns)
    renewed = [r.getMessage() for r in caplog.records if "new consumer" in r.getMessage()]
    left = [r.getMessage() for r in caplog.records if "looks up the transaction" in r.getMessage()]
    print(
        f"the look-up took {look_up_s:.1f} s, the commit {commit_s:.1f} s, the group's commit "
        f"{group_commit_s:.1f} s; stalls: {renewed}"
    )
    assert look_up_s < 30 and commit_s < 30  # not waiting out the hung node's 60 s
    assert group_commit_s < 1
    assert renewed and left
    assert _offsets(read_range(conf, OffsetRange(topic, 0, 0, 20), False)) == list(range(20))
    # Kafka answers a commit once the coordinator logged it, and writes its markers to the
    # output's partitions after: a read at once may not see the epoch yet (its leader just
    # moved twice). A lost epoch never shows; a doubled one fails the multiset.
    published: Counter = Counter()

    def both_epochs_visible() -> bool:
        published.clear()
        published.update(m.value() for m in read_committed(cluster.bootstrap, out))
        return sum(published.values()) >= 2

    with contextlib.suppress(AssertionError):
        wait_until(both_epochs_visible, 60, "both epochs visible to read_committed")
    assert published == {b"epoch 0": 1, b"epoch 1": 1}
    kafka_clients.commit_group_offsets(conf, group, {(topic, 0): 20})  # (as the next epoch does)
    wait_until(lambda: _group_offset(cluster, group, topic) == 20, 60, "the group's new offset")


def _coordinating_node(cluster: LocalCluster, topic: str) -> int:
    """A node that leads partitions of both the transaction and the offsets log (after a
    rolling restart, the last node restarted may lead none until Kafka rebalances)."""
    first = Producer({"bootstrap.servers": cluster.bootstrap, "transactional.id": "any"})
    first.init_transactions(30)  # Kafka makes both logs at their first use
    _group_offset(cluster, "any", topic)
    leaders = []
    for log in ("__transaction_state", "__consumer_offsets"):
        meta = _leaders(cluster.bootstrap, log)
        leaders.append(set(meta.values()))
    both = sorted(leaders[0] & leaders[1])
    assert both, f"no node leads partitions of both logs: {leaders}"
    return both[0]


def _topic_led_by(cluster: LocalCluster, node: int) -> str:
    """A new topic whose partition 0 `node` leads (Kafka spreads new leaders over nodes)."""
    for _ in range(30):
        topic = _topic(cluster, "hung-leader")
        if _leaders(cluster.bootstrap, topic).get(0) == node:
            return topic
    raise AssertionError(f"node {node} led partition 0 of none of 30 new topics")


def _coordinated_by(node: int, coordinator: Callable[[str], int]) -> str:
    """A transactional id or group id whose coordinator (LocalCluster.transaction_coordinator
    or group_coordinator) is `node`, which leads a partition of that log."""
    for n in range(200):
        key = f"hung-coordinator-{uuid.uuid4().hex[:6]}-{n}"
        if coordinator(key) == node:
            return key
    raise AssertionError(f"node {node} coordinates none of 200 ids")


def _group_offset(cluster: LocalCluster, group: str, topic: str) -> int:
    """The offset consumer group `group` committed for partition 0 of `topic`, asked again
    for up to 30 s while the cluster is in motion (NOT_COORDINATOR right after it starts;
    `kafka_clients.retriable`)."""
    consumer = Consumer({"bootstrap.servers": cluster.bootstrap, "group.id": group})
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                return consumer.committed([TopicPartition(topic, 0)], timeout=10)[0].offset
            except KafkaException as exc:
                if not kafka_clients.retriable(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        consumer.close()


@contextlib.contextmanager
def _leader_paused_after_a_read(cluster: LocalCluster, topic: str, conf: dict):
    """Partition 0 of `topic` with 10 records, read through the range consumer of `conf`
    (which now knows the leader and keeps a connection to it); then its leader paused, a new
    one elected, and 10 more records written to it (offsets 10-19). Yields the paused node,
    resumed on leaving."""
    from onceflow.connectors.source import OffsetRange, read_range

    produce(cluster.bootstrap, topic, [(None, b"before", 0)] * 10)
    assert _offsets(read_range(conf, OffsetRange(topic, 0, 0, 10), False)) == list(range(10))
    leader = _leaders(cluster.bootstrap, topic)[0]
    live = ",".join(n.bootstrap for n in cluster.nodes if n.node_id != leader)
    paused = cluster.node(leader)
    paused.pause()
    try:
        wait_until(lambda: _leaders(live, topic).get(0, leader) != leader, 60, "a new leader")
        # Not idempotent: a new producer id comes from the active controller, and when the
        # paused node was that controller the live ones answered "load in progress" for over
        # 30 s (seen in CI). Acks from all in-sync replicas, one request at a time, keep order.
        writer = Producer(
            {"bootstrap.servers": live, "acks": "all", "enable.idempotence": False}
            | {"max.in.flight.requests.per.connection": 1, "linger.ms": 5}
        )
        for _ in range(10):
            writer.produce(topic, value=b"while paused", partition=0)
        assert writer.flush(30) == 0
        yield paused
    finally:
        paused.pause(False)


def _reading(read: list, conf: dict, r, checkpoint: CheckpointDir | None = None):
    """A thread that reads range `r` and appends its offsets, or the error it ended with, to
    `read`."""
    from onceflow.connectors.source import read_range

    def read_on() -> None:
        try:
            read.append(_offsets(read_range(conf, r, False, checkpoint)))
        except Exception as exc:
            read.append(exc)

    return threading.Thread(target=read_on, daemon=True)


def _offsets(batches) -> list[int]:
    return [o for b in batches for o in b.column("offset").to_pylist()]


def _leaders(bootstrap: str, topic: str) -> dict[int, int]:
    """partition -> leader node, as the brokers of `bootstrap` see it (-1 when none)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    with contextlib.suppress(Exception):
        meta = admin.list_topics(topic, timeout=2).topics[topic]
        return {p.id: p.leader for p in meta.partitions.values()}
    return {}


def _bytes_waiting_at(port: int) -> dict[str, int]:
    """Bytes received and not yet read, per connection to `port` (by the client's address;
    the listening socket's count is its accept queue): a paused broker's requests, from
    /proc/net/tcp and tcp6 (where the JVM's sockets are)."""
    waiting: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:  # local address:port
                peer = fields[2]  # remote address:port
                waiting[peer] = waiting.get(peer, 0) + int(fields[4].split(":")[1], 16)
    return waiting


def _more_waiting(before: dict[str, int], now: dict[str, int]) -> bool:
    """A connection holds more unread bytes than before, or a new one holds some. Compared
    per connection: other clients' new connections to the paused node wait there with their
    first request (69 bytes each; 7 of them at one run's start of the read) and close when it
    times out, taking their bytes with them, so the sum could fall by more than the read's
    fetch (98 bytes) added. Likely why this wait failed once in a whole fault run."""
    return any(count > before.get(peer, 0) for peer, count in now.items())


def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Feeder:
    """Clicks produced at a steady rate from a thread, through the faults (an idempotent
    producer that waits out a dead leader and gives up on a hung one as onceflow's clients
    do), until `stop()`, which returns those delivered. The first BACKLOG clicks (56 s of
    event time) go at once, so that the first epochs already close windows and publish."""

    RATE_PER_S = 400
    BACKLOG = 8_000

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.delivered: list[tuple[str, int]] = []
        self.failed: list = []
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "linger.ms": 5,
                "socket.timeout.ms": kafka_clients.REQUEST_ANSWER_TIMEOUT_MS,
                "api.version.request.timeout.ms": kafka_clients.FIRST_ANSWER_TIMEOUT_MS,
            }
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feeder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i, started = 0, time.monotonic()
        while not self._stop.wait(0.05):
            due = self.BACKLOG + int((time.monotonic() - started) * self.RATE_PER_S)
            for _ in range(due - i):
                user, ts = f"u{i % USERS}", BASE + i * 7
                self.producer.produce(
                    self.topic,
                    key=user.encode(),
                    value=_click(user, ts),
                    partition=i % 3,
                    on_delivery=self._delivery((user, ts)),
                )
                i += 1
            self.producer.poll(0)

    def _delivery(self, event: tuple[str, int]):
        def delivered(error, _message) -> None:
            if error is None:
                self.delivered.append(event)
            else:
                self.failed.append(error)

        return delivered

    def stop(self) -> list[tuple[str, int]]:
        self._stop.set()
        self._thread.join(30)
        assert self.producer.flush(120) == 0
        assert self.failed == []  # idempotent and retried: every click lands, once
        return self.delivered


def _topic(cluster: LocalCluster, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    create_topic(cluster.bootstrap, name, 3)
    return name


def _partitions_led_by(cluster: LocalCluster, node: int) -> set[str]:
    """The partitions (topic/partition) whose leader is `node` now."""
    from confluent_kafka.admin import AdminClient

    topics = AdminClient({"bootstrap.servers": cluster.bootstrap}).list_topics(timeout=30).topics
    return {
        f"{name}/{p.id}"
        for name, topic in topics.items()
        for p in topic.partitions.values()
        if p.leader == node
    }


def _next_commit(service, commits: Path, before: int) -> None:
    """Until the service commits an epoch after the `before`th."""
    wait_until(
        lambda: _committed(commits) > before or service.process.poll() is not None,
        180,
        "an epoch committed after the fault",
    )
    assert service.process.poll() is None, service.report()


class CommitWatch:
    """When each epoch reached Spark's commit log (polled every 50 ms, from a thread)."""

    def __init__(self, commits: Path) -> None:
        self.commits, self.times = commits, [(time.monotonic(), _committed(commits))]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commit-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            count = _committed(self.commits)
            if count > self.times[-1][1]:
                self.times.append((time.monotonic(), count))

    def longest_gap(self, since: float) -> float:
        """The longest time without a new commit from `since` until now."""
        now = time.monotonic()
        moments = [since, *(t for t, _ in self.times if since < t), now]
        return max(b - a for a, b in itertools.pairwise(moments))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _window(message) -> tuple:
    return (message.key(), message.value())


def _source(message) -> str | None:
    return dict(message.headers() or []).get("onceflow.source")


def _key_and_source_offset(message) -> tuple:
    _, partition, offset = _source(message).decode().rsplit("/", 2)
    return (message.key(), partition), int(offset)
