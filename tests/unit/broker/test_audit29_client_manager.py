"""What clients send grows ClientManager's tables only as far as their connections go (broker/consumer_manager.py)."""

from __future__ import annotations

from broker.consumer_manager import ClientManager, parse_heartbeat


def _hb(client_id, group="cg", topics=("T",), producer_group="pg"):
    return parse_heartbeat({"client_id": client_id, "producers": [{"producer_group": producer_group}],
                            "consumers": [{"consumer_group": group, "subscriptions": [
                                {"topic": t, "expression": "*"} for t in topics]}]})


def test_a_connection_is_one_member_whatever_client_ids_it_sends():
    """Before, each heartbeat with a fresh client id over one connection added a member: 1000 heartbeats, 1000
    members, listed to every real member, which then gave each a share of the queues (RocketMQ keys by channel)."""
    changes = []
    manager = ClientManager(on_consumer_ids_changed=lambda g, conns: changes.append(len(conns)))
    hostile, real = object(), object()
    manager.heartbeat(_hb("real"), real)
    for i in range(1000):
        manager.heartbeat(_hb(f"fresh-{i}"), hostile)
    assert manager.consumer_ids("cg") == ["fresh-999", "real"]
    assert sorted(manager.producer_groups["pg"]) == ["fresh-999", "real"]
    assert manager.connection_count() == 2 and max(changes) == 2
    # Two connections are two members, even of one process.
    manager.heartbeat(_hb("second"), object())
    assert manager.consumer_ids("cg") == ["fresh-999", "real", "second"]


def test_a_group_whose_last_member_left_is_forgotten_with_its_subscriptions():
    """Before, every group ever named stayed, empty, with every topic its members ever subscribed to, for as long as
    the broker ran (and in its metrics, one series each)."""
    now = [0.0]
    manager = ClientManager(channel_expired_timeout_ms=1000, clock=lambda: now[0])
    conn = object()
    for i in range(100):
        manager.heartbeat(_hb("c", group=f"g{i}", topics=[f"T{i}"], producer_group=f"p{i}"), conn)
    assert len(manager.consumer_groups) == 100 and len(manager.producer_groups) == 100
    manager.connection_closed(conn)
    assert manager.consumer_groups == {} and manager.producer_groups == {}
    assert manager.find_subscription("g1", "T1") is None

    manager.heartbeat(_hb("c"), conn)
    manager.unregister("c", "pg", "cg")
    assert "cg" not in manager.consumer_groups
    manager.heartbeat(_hb("d", group="silent", producer_group="silent-p"), object())
    now[0] = 2.0
    manager.scan_expired()  # the silent member, and the producer group the unregister left empty
    assert manager.consumer_groups == {} and manager.producer_groups == {}


def test_a_topic_no_member_subscribes_to_any_more_leaves_the_group_subscriptions():
    """Before, a member that subscribed to a fresh topic in each heartbeat grew its group's subscription table by
    one topic per heartbeat, and a topic every member had dropped still gave pulls its old filter."""
    manager = ClientManager()
    a, b = object(), object()
    for i in range(1000):
        manager.heartbeat(_hb("a", topics=["Kept", f"T{i}"]), a)
    assert sorted(manager.consumer_groups["cg"].subscriptions) == ["Kept", "T999"]
    manager.heartbeat(_hb("b", topics=["Shared"]), b)
    manager.heartbeat(_hb("a", topics=["Kept", "Shared"]), a)
    manager.heartbeat(_hb("a", topics=["Kept"]), a)  # b still subscribes to Shared
    assert sorted(manager.consumer_groups["cg"].subscriptions) == ["Kept", "Shared"]
    manager.connection_closed(b)
    assert sorted(manager.consumer_groups["cg"].subscriptions) == ["Kept"]
    assert manager.find_subscription("cg", "Shared") is None
