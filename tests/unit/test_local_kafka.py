import uuid

from onceflow import local_kafka
from onceflow.local_cluster import LocalCluster
from onceflow.local_kafka import LocalKafka


def test_a_cluster_id_never_starts_with_a_dash(monkeypatch):
    # 0xF8 encodes to '-' in base64url: the storage tool would read such an id as an option.
    drawn = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x04" + bytes(15))])
    monkeypatch.setattr(local_kafka.uuid, "uuid4", lambda: next(drawn))

    cluster_id = local_kafka.new_cluster_id()

    assert cluster_id == "BAAAAAAAAAAAAAAAAAAAAA"
    assert len(cluster_id) == 22


def _config(broker: LocalKafka) -> dict[str, str]:
    broker.run_dir.mkdir(parents=True)
    lines = broker._write_config().read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_a_single_broker_keeps_one_replica_of_everything(tmp_path):
    config = _config(LocalKafka(tmp_path, 9092))
    assert config["controller.quorum.voters"] == "1@127.0.0.1:9093"
    assert config["node.id"] == "1"
    assert config["transaction.state.log.replication.factor"] == "1"
    assert config["min.insync.replicas"] == "1"


def test_a_cluster_node_has_its_own_ports_and_directory_and_three_replicas(tmp_path):
    cluster = LocalCluster.of(tmp_path, 19092, 3)
    node = cluster.node(2)
    config = _config(node)
    assert node.run_dir == tmp_path / "cluster-19092" / "node-2"
    assert config["node.id"] == "2"
    assert config["listeners"] == "PLAINTEXT://127.0.0.1:19093,CONTROLLER://127.0.0.1:19103"
    assert config["controller.quorum.voters"] == (
        "1@127.0.0.1:19102,2@127.0.0.1:19103,3@127.0.0.1:19104"
    )
    assert config["log.dirs"] == str(node.run_dir / "data")
    for name in (
        "default.replication.factor",
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
    ):
        assert config[name] == "3", name
    assert config["min.insync.replicas"] == config["transaction.state.log.min.isr"] == "2"
    assert cluster.bootstrap == "127.0.0.1:19092,127.0.0.1:19093,127.0.0.1:19094"


def test_a_cluster_is_found_again_with_the_size_it_was_made_with(tmp_path):
    (tmp_path / "cluster-19092").mkdir()
    (tmp_path / "cluster-19092" / "nodes").write_text("5")
    assert LocalCluster.of(tmp_path, 19092).size == 5
    assert LocalCluster.of(tmp_path, 29092).size == 3
