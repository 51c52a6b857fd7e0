import uuid

from onceflow import local_kafka


def test_a_cluster_id_never_starts_with_a_dash(monkeypatch):
    # 0xF8 encodes to '-' in base64url: the storage tool would read such an id as an option.
    drawn = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x04" + bytes(15))])
    monkeypatch.setattr(local_kafka.uuid, "uuid4", lambda: next(drawn))

    cluster_id = local_kafka.new_cluster_id()

    assert cluster_id == "BAAAAAAAAAAAAAAAAAAAAA"
    assert len(cluster_id) == 22
