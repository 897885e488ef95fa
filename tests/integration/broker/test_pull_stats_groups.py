"""The pull figures of /metrics (``rocketmq_messages_out_total``) follow the subscription-group table on every member
of an in-process 3-member group: a deleted group's series go on the leader and on the followers, which apply the
deletion; pulls a follower serves under names the table does not hold are not exported (they were, one series per
made-up name, without end), and a group whose config comes after its first pulls shows them once it is there."""

from __future__ import annotations

import functools

import cbor2
import trio

from broker.node import BrokerNode, serve_broker
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call
from tests.metrics_scrape import scrape, value


async def _pull(client, addr: str, group: str) -> None:
    """A pull of T's queue 0 from its start by ``group`` at ``addr``, answered with the 3 messages (a follower
    answers PULL_RETRY_IMMEDIATELY until it has them)."""
    with trio.fail_after(10):  # liveness: a follower serves once it has the messages
        while True:
            r = await call(client, addr, RequestCode.PULL_MESSAGE,
                           {"consumer_group": group, "topic": "T", "queue_id": 0, "queue_offset": 0,
                            "max_msg_nums": 32})
            if r.code == ResponseCode.SUCCESS and r.ext["next_begin_offset"] == 3:
                return
            assert r.code in (ResponseCode.SUCCESS, ResponseCode.PULL_RETRY_IMMEDIATELY), r.remark
            await trio.sleep(0.05)


async def _wait_groups(nodes: dict[str, BrokerNode], group: str, *, held: bool) -> None:
    with trio.fail_after(10):  # liveness: every member applies the change
        while any((group in node.subscription_groups.table) != held for node in nodes.values()):
            await trio.sleep(0.02)


def _out(samples, group: str) -> float | None:
    return value(samples, "rocketmq_messages_out_total", topic="T", consumer_group=group)


async def _cluster(nursery, tmp_path, client) -> tuple[dict[str, BrokerNode], str, str, str]:
    """Three members serving /metrics, T's queue 0 holding 3 messages: (nodes by address, leader, followers)."""
    nodes: dict[str, BrokerNode] = {}
    for config in broker_configs(tmp_path, None, n=3, metrics_listen="127.0.0.1:0"):
        await nursery.start(functools.partial(
            serve_broker, config, on_serving=lambda node: nodes.__setitem__(node.broker_addr, node)))
    with trio.fail_after(10):
        while not any(node.group.is_ready_leader for node in nodes.values()):
            await trio.sleep(0.05)
    leader = next(addr for addr, node in nodes.items() if node.group.is_leader)
    follower, other = (addr for addr in nodes if addr != leader)
    for i in range(3):
        r = await call(client, leader, RequestCode.SEND_MESSAGE, {"topic": "T", "queue_id": 0}, b"m%d" % i)
        assert r.code == ResponseCode.SUCCESS, r.remark
    return nodes, leader, follower, other


async def test_a_deleted_groups_pull_series_go_on_every_member(nursery, tmp_path):
    async with open_remoting_client() as client:
        nodes, leader, follower, other = await _cluster(nursery, tmp_path, client)
        for group in ("gone", "kept"):
            await _pull(client, leader, group)  # auto-created by the leader
            await _wait_groups(nodes, group, held=True)
            for addr in (follower, other):
                await _pull(client, addr, group)
        for node in nodes.values():
            s = await scrape(node.metrics_address)
            assert _out(s, "gone") == 3 and _out(s, "kept") == 3, node.broker_addr

        r = await call(client, leader, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "gone"})
        assert r.code == ResponseCode.SUCCESS and r.ext["config_removed"] is True, r.remark
        await _wait_groups(nodes, "gone", held=False)
        for node in nodes.values():
            s = await scrape(node.metrics_address)
            assert _out(s, "gone") is None and _out(s, "kept") == 3, node.broker_addr
            assert ("gone", "T") not in node.pull_stats.totals()


async def test_a_followers_pulls_under_names_the_table_lacks_are_not_exported_until_the_group_comes(nursery,
                                                                                                     tmp_path):
    async with open_remoting_client() as client:
        nodes, leader, follower, _other = await _cluster(nursery, tmp_path, client)
        await _pull(client, leader, "kept")
        await _wait_groups(nodes, "kept", held=True)
        await _pull(client, follower, "kept")
        # A follower creates no group: every name a client pulls with is served, and was a series for good.
        for i in range(50):
            await _pull(client, follower, f"rand{i}")
        # A real group whose config reaches this member after its first pull.
        await _pull(client, follower, "late")
        s = await scrape(nodes[follower].metrics_address)
        assert [labels["consumer_group"] for labels, _ in s["rocketmq_messages_out_total"]] == ["kept"]
        r = await call(client, leader, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP,
                       body=cbor2.dumps({"group_name": "late"}))
        assert r.code == ResponseCode.SUCCESS, r.remark
        await _wait_groups(nodes, "late", held=True)
        s = await scrape(nodes[follower].metrics_address)
        assert _out(s, "late") == 3 and _out(s, "kept") == 3
        assert sorted(labels["consumer_group"] for labels, _ in s["rocketmq_messages_out_total"]) == ["kept", "late"]
        assert {group for group, _topic in nodes[follower].pull_stats.totals()} == {"kept", "late"}
