"""Subscription groups (RocketMQ's SubscriptionGroupConfig) against in-process broker nodes:
UPDATE_AND_CREATE_SUBSCRIPTIONGROUP (200), GET_ALL_SUBSCRIPTIONGROUP_CONFIG (201), DELETE_SUBSCRIPTIONGROUP (207)
removing the config, the pull refusal of a stopped group (held pulls too) and its lifting, broadcasting refused,
auto-creation on and off, the bound, the send-back's retry_max_times and retry_queue_nums, and the admin client."""

from __future__ import annotations

import functools

import cbor2
import pytest
import trio

from broker.node import BrokerNode, serve_broker
from broker.subscription_group import SUBSCRIPTION_GROUP_TABLE
from client import open_admin
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.message import iter_records
from remoting.transport import open_connection, open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, start_namesrv, wait_leader


async def _send(client, addr: str, topic: str = "T", body: bytes = b"x", queue_id: int = 0):
    r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": topic, "queue_id": queue_id}, body)
    assert r.code == ResponseCode.SUCCESS, r.remark
    return r


async def _pull(client, addr: str, group: str, topic: str = "T", offset: int = 0, timeout_s: float = 10, **ext):
    return await call(client, addr, RequestCode.PULL_MESSAGE,
                      {"consumer_group": group, "topic": topic, "queue_id": 0, "queue_offset": offset,
                       "max_msg_nums": 32, **ext}, timeout_s=timeout_s)


async def _update(client, addr: str, **fields):
    return await call(client, addr, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=cbor2.dumps(fields))


async def _groups(client, addr: str) -> dict:
    r = await call(client, addr, RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG)
    assert r.code == ResponseCode.SUCCESS, r.remark
    return cbor2.loads(r.body)["subscription_groups"]


async def _wait_group(client, addr: str, group: str) -> dict:
    with trio.fail_after(10):  # liveness: an auto-creation is replicated in a task of the leader
        while group not in (groups := await _groups(client, addr)):
            await trio.sleep(0.02)
    return groups[group]


async def _node(nursery, tmp_path, namesrv=None, **overrides) -> str:
    (config,) = broker_configs(tmp_path, namesrv, **overrides)
    addr = await start_broker(nursery, config)
    return addr


async def test_update_and_list_merge_fields_and_refuse_bad_ones_naming_them(nursery, tmp_path):
    addr = await _node(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        assert await _groups(client, addr) == {}
        r = await _update(client, addr, group_name="billing", consume_enable=False, retry_max_times=3)
        assert r.code == ResponseCode.SUCCESS, r.remark
        answer = cbor2.loads(r.body)
        assert answer["previous"] is None
        assert answer["config"] == {
            "group_name": "billing", "consume_enable": False, "consume_from_min_enable": True,
            "consume_broadcast_enable": True, "retry_queue_nums": 1, "retry_max_times": 3, "broker_id": 0,
            "which_broker_when_consume_slowly": 1, "notify_consumer_ids_changed_enable": True}
        # The fields left out keep their value (here sent in ext, as a small request may).
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP,
                       {"group_name": "billing", "consume_enable": True, "retry_queue_nums": 2})
        assert r.code == ResponseCode.SUCCESS, r.remark
        answer = cbor2.loads(r.body)
        assert answer["previous"]["consume_enable"] is False
        assert answer["config"]["consume_enable"] is True and answer["config"]["retry_max_times"] == 3
        assert (await _groups(client, addr))["billing"] == answer["config"]
        version = cbor2.loads((await call(client, addr, RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG)).body)
        assert version["data_version"] == 2

        for fields, field in [({"group_name": "billing", "consume_enable": "no"}, "consume_enable"),
                              ({"group_name": "billing", "retry_max_times": -1}, "retry_max_times"),
                              ({"group_name": "billing", "retry_queue_nums": 0}, "retry_queue_nums"),
                              ({"group_name": "billing", "retry_queue_nums": True}, "retry_queue_nums"),
                              ({"group_name": "billing", "consume_enabled": False}, "consume_enabled"),
                              ({"group_name": "bad group"}, "group_name"),
                              ({"consume_enable": False}, "group_name")]:
            r = await _update(client, addr, **fields)
            assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == field, (fields, r.remark)
            assert field in r.remark
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=b"\xff")
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "body"
        assert (await _groups(client, addr))["billing"] == answer["config"]  # nothing changed by the refusals


async def test_a_stopped_group_is_refused_its_pulls_and_another_is_not_until_it_is_enabled(nursery, tmp_path):
    addr = await _node(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, body=b"m0")
        r = await _pull(client, addr, "stopped")
        assert r.code == ResponseCode.SUCCESS
        # Created on the first pull, with RocketMQ's defaults, by the leader in a task of its own.
        config = await _wait_group(client, addr, "stopped")
        assert config["consume_enable"] is True and config["retry_max_times"] == 16

        assert (await _update(client, addr, group_name="stopped", consume_enable=False)).code == ResponseCode.SUCCESS
        r = await _pull(client, addr, "stopped")
        assert r.code == ResponseCode.NO_PERMISSION
        assert r.remark.startswith("subscription group no permission, stopped")
        assert r.ext["consumer_group"] == "stopped"
        r = await _pull(client, addr, "running")
        assert r.code == ResponseCode.SUCCESS and [m.body for m in iter_records(r.body)] == [b"m0"]

        assert (await _update(client, addr, group_name="stopped", consume_enable=True)).code == ResponseCode.SUCCESS
        r = await _pull(client, addr, "stopped")
        assert r.code == ResponseCode.SUCCESS and [m.body for m in iter_records(r.body)] == [b"m0"]


async def test_a_held_pull_of_a_group_stopped_meanwhile_is_answered_with_the_refusal(nursery, tmp_path):
    addr = await _node(nursery, tmp_path, long_polling_timeout_ms=3_600_000)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, body=b"m0")
        for group in ("stopped", "running"):
            assert (await _update(client, addr, group_name=group)).code == ResponseCode.SUCCESS
        answers: dict[str, object] = {}

        async def hold(group: str) -> None:
            # Past the queue's end, allowed to wait an hour: only the stop (or a message) answers it.
            answers[group] = await _pull(client, addr, group, offset=1, timeout_s=60, sys_flag=0x2,
                                         suspend_timeout_millis=3_600_000)

        async with trio.open_nursery() as waiting:
            waiting.start_soon(hold, "stopped")
            waiting.start_soon(hold, "running")
            await trio.sleep(0.3)
            assert not answers
            r = await _update(client, addr, group_name="stopped", consume_enable=False)
            assert r.code == ResponseCode.SUCCESS
            with trio.fail_after(10):  # liveness
                while "stopped" not in answers:
                    await trio.sleep(0.02)
            assert answers["stopped"].code == ResponseCode.NO_PERMISSION
            assert "subscription group no permission, stopped" in answers["stopped"].remark
            # The other group's pull, woken with it, is held again: a message answers it.
            await trio.sleep(0.3)
            assert "running" not in answers
            await _send(client, addr, body=b"m1")
        assert answers["running"].code == ResponseCode.SUCCESS
        assert [m.body for m in iter_records(answers["running"].body)] == [b"m1"]


async def test_auto_create_off_refuses_unknown_groups_until_created(nursery, tmp_path):
    addr = await _node(nursery, tmp_path, auto_create_subscription_group=False)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        sent = await _send(client, addr, body=b"m0")
        r = await _pull(client, addr, "unknown")
        assert r.code == ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST
        assert "subscription group [unknown] does not exist" in r.remark
        assert "auto_create_subscription_group is false" in r.remark
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK,
                       {"offset": 0, "group": "unknown", "origin_topic": "T", "max_reconsume_times": 16})
        assert r.code == ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST
        # So is an offset commit: made-up group names each stored an offset for good, past the group count's bound.
        commit = {"consumer_group": "unknown", "topic": "T", "queue_id": 0, "commit_offset": 1}
        r = await call(client, addr, RequestCode.UPDATE_CONSUMER_OFFSET, commit)
        assert r.code == ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST and "auto_create_subscription_group is false" \
            in r.remark, (r.code, r.remark)
        r = await call(client, addr, RequestCode.QUERY_CONSUMER_OFFSET, {k: commit[k] for k in list(commit)[:3]})
        assert r.code == ResponseCode.QUERY_NOT_FOUND, (r.code, r.remark)
        assert sent.code == ResponseCode.SUCCESS
        # RocketMQ's tools group is created all the same (raftmq admin consume-message pulls under it).
        assert (await _pull(client, addr, "TOOLS_CONSUMER")).code == ResponseCode.SUCCESS
        await _wait_group(client, addr, "TOOLS_CONSUMER")
        assert "unknown" not in await _groups(client, addr)

        assert (await _update(client, addr, group_name="unknown")).code == ResponseCode.SUCCESS
        r = await _pull(client, addr, "unknown")
        assert r.code == ResponseCode.SUCCESS and [m.body for m in iter_records(r.body)] == [b"m0"]
        assert (await call(client, addr, RequestCode.UPDATE_CONSUMER_OFFSET, commit)).code == ResponseCode.SUCCESS
        # Deleted, it is unknown again.
        r = await call(client, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "unknown"})
        assert r.code == ResponseCode.SUCCESS and r.ext["config_removed"] is True
        assert (await _pull(client, addr, "unknown")).code == ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST


async def test_the_group_count_is_bounded(nursery, tmp_path):
    addr = await _node(nursery, tmp_path, max_subscription_group_count=2)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr)
        for group in ("g1", "g2"):
            assert (await _update(client, addr, group_name=group)).code == ResponseCode.SUCCESS
        r = await _update(client, addr, group_name="g3")
        assert r.code == ResponseCode.INVALID_REQUEST and "max_subscription_group_count is 2" in r.remark
        r = await _pull(client, addr, "g3")
        assert r.code == ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST and "not auto-created" in r.remark
        r = await call(client, addr, RequestCode.UPDATE_CONSUMER_OFFSET,
                       {"consumer_group": "g3", "topic": "T", "queue_id": 0, "commit_offset": 1})
        assert r.code == ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST and "not auto-created" in r.remark
        # Known groups are served and updated as before.
        assert (await _update(client, addr, group_name="g2", retry_max_times=1)).code == ResponseCode.SUCCESS
        assert (await _pull(client, addr, "g1")).code == ResponseCode.SUCCESS
        assert sorted(await _groups(client, addr)) == ["g1", "g2"]


async def test_broadcasting_members_are_refused_when_the_group_allows_no_broadcast(nursery, tmp_path):
    addr = await _node(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr)
        for group in ("bcast", "clustered"):
            r = await _update(client, addr, group_name=group, consume_broadcast_enable=False)
            assert r.code == ResponseCode.SUCCESS, r.remark
        async with open_connection(addr) as member:
            for group, model in (("bcast", "BROADCASTING"), ("clustered", "CLUSTERING")):
                hb = {"client_id": f"c-{group}", "consumers": [{"consumer_group": group, "message_model": model,
                                                                 "subscriptions": [{"topic": "T"}]}]}
                r = await member.invoke(make_request(RequestCode.HEART_BEAT, body=cbor2.dumps(hb)))
                assert r.code == ResponseCode.SUCCESS, r.remark
            r = await _pull(client, addr, "bcast")
            assert r.code == ResponseCode.NO_PERMISSION
            assert "the consumer group[bcast] can not consume by broadcast way" in r.remark
            assert (await _pull(client, addr, "clustered")).code == ResponseCode.SUCCESS
            r = await _update(client, addr, group_name="bcast", consume_broadcast_enable=True)
            assert r.code == ResponseCode.SUCCESS
            assert (await _pull(client, addr, "bcast")).code == ResponseCode.SUCCESS


async def test_send_back_takes_retry_max_times_and_retry_queue_nums_from_the_group(nursery, tmp_path):
    addr = await _node(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, body=b"m0")
        assert (await _update(client, addr, group_name="g", retry_max_times=0,
                              retry_queue_nums=3)).code == ResponseCode.SUCCESS
        back = {"offset": 0, "group": "g", "origin_topic": "T"}
        # No max_reconsume_times in the request (RocketMQ's older clients): the group's 0 sends it to the DLQ.
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, back)
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert r.ext["dead"] is True and r.ext["topic"] == "%DLQ%g"
        # The request's own limit wins over the group's (raftmq's consumers always send one).
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, {**back, "max_reconsume_times": 5})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert r.ext["dead"] is False and r.ext["topic"] == "%RETRY%g"
        topics = cbor2.loads((await call(client, addr, RequestCode.GET_ALL_TOPIC_CONFIG)).body)["topic_configs"]
        assert topics["%RETRY%g"]["write_queue_nums"] == 3 and topics["%RETRY%g"]["read_queue_nums"] == 3
        assert topics["%DLQ%g"]["write_queue_nums"] == 1
        # A group without a config gets one on its first send-back, with the default limit (16).
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, {**back, "group": "fresh"})
        assert r.code == ResponseCode.SUCCESS and r.ext["dead"] is False
        assert (await _groups(client, addr))["fresh"]["retry_max_times"] == 16


async def test_delete_removes_the_config_and_clean_offset_false_keeps_the_offsets(nursery, tmp_path):
    addr = await _node(nursery, tmp_path, consumer_offset_flush_interval_ms=20)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr)
        key = {"consumer_group": "g", "topic": "T", "queue_id": 0}
        assert (await call(client, addr, RequestCode.UPDATE_CONSUMER_OFFSET, {**key, "commit_offset": 1})).code == 0
        assert (await _update(client, addr, group_name="g", consume_enable=False)).code == ResponseCode.SUCCESS
        r = await call(client, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "g", "clean_offset": False})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert r.ext == {"removed": 0, "config_removed": True}
        assert "g" not in await _groups(client, addr)
        r = await call(client, addr, RequestCode.QUERY_CONSUMER_OFFSET, key)
        assert r.code == ResponseCode.SUCCESS and r.ext["offset"] == 1
        # Its config gone, the group consumes again (auto-created with the defaults).
        assert (await _pull(client, addr, "g")).code == ResponseCode.SUCCESS
        await _wait_group(client, addr, "g")
        r = await call(client, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "g"})
        assert r.code == ResponseCode.SUCCESS and r.ext == {"removed": 1, "config_removed": True}
        r = await call(client, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "g", "clean_offset": False})
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "clean_offset"


async def test_a_group_without_notifications_is_not_told_of_new_members(nursery, tmp_path):
    addr = await _node(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        r = await _update(client, addr, group_name="quiet", notify_consumer_ids_changed_enable=False)
        assert r.code == ResponseCode.SUCCESS
    told: list[str] = []

    class Handler:
        async def handle(self, request, conn):
            if request.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
                told.append(request.ext["consumer_group"])
            return None

    def hb(client_id: str, group: str) -> bytes:
        return cbor2.dumps({"client_id": client_id, "consumers": [{"consumer_group": group,
                                                                   "subscriptions": [{"topic": "T"}]}]})

    async with open_connection(addr, handler=Handler()) as c1, open_connection(addr) as c2:
        for group in ("quiet", "loud"):
            assert (await c1.invoke(make_request(RequestCode.HEART_BEAT, body=hb("c1", group)))).code == 0
        for group in ("quiet", "loud"):
            assert (await c2.invoke(make_request(RequestCode.HEART_BEAT, body=hb("c2", group)))).code == 0
        with trio.fail_after(10):  # liveness: the loud group's member is told
            while "loud" not in told:
                await trio.sleep(0.02)
        await trio.sleep(0.2)
    assert "quiet" not in told


async def test_changes_are_leader_only_replicated_and_followers_refuse_a_stopped_group(nursery, tmp_path):
    nodes: dict[str, BrokerNode] = {}
    addrs = []
    for config in broker_configs(tmp_path, None, n=3):
        host, port = await nursery.start(functools.partial(
            serve_broker, config, on_serving=lambda node: nodes.__setitem__(node.broker_addr, node)))
        addrs.append(f"{host}:{port}")
    async with open_remoting_client() as client:
        with trio.fail_after(10):
            while not any(node.group.is_ready_leader for node in nodes.values()):
                await trio.sleep(0.05)
        leader = next(addr for addr, node in nodes.items() if node.group.is_leader)
        followers = [a for a in addrs if a != leader]
        await _send(client, leader)
        for follower in followers:
            r = await _update(client, follower, group_name="g", consume_enable=False)
            assert r.code == ResponseCode.NOT_LEADER and r.ext["leader_addr"] == leader, r.remark
        assert (await _update(client, leader, group_name="g", consume_enable=False)).code == ResponseCode.SUCCESS
        with trio.fail_after(10):  # liveness: the followers apply it
            while any(nodes[a].subscription_groups.get("g") is None for a in followers):
                await trio.sleep(0.02)
        for addr in addrs:
            assert (await _groups(client, addr))["g"]["consume_enable"] is False
            assert "g" in nodes[addr].group.metadata(SUBSCRIPTION_GROUP_TABLE)
            with trio.fail_after(10):  # liveness: a follower serves once it has the message
                while (r := await _pull(client, addr, "g")).code == ResponseCode.PULL_RETRY_IMMEDIATELY:
                    await trio.sleep(0.05)
            assert r.code == ResponseCode.NO_PERMISSION, (addr, r.remark)
        r = await call(client, followers[0], RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "g"})
        assert r.code == ResponseCode.NOT_LEADER


async def test_admin_client_updates_every_group_and_lists_their_configs(nursery, tmp_path):
    namesrv = await start_namesrv(nursery)
    addrs = {}
    for name in ("broker-a", "broker-b"):
        addrs[name] = await _node(nursery, tmp_path / name, namesrv, **{"dledger.group": name})
    async with open_remoting_client() as client, open_admin(namesrv) as admin:
        for addr in addrs.values():
            await wait_leader(client, addr)
        with trio.fail_after(10):  # liveness: both groups registered
            while len((await admin.cluster_info()).broker_addrs) < 2:
                await trio.sleep(0.05)
        updates = await admin.update_subscription_group("G", consume_enable=False)
        assert [(u.broker_name, u.previous, u.config.consume_enable) for u in updates] == [
            ("broker-a", None, False), ("broker-b", None, False)]
        updates = await admin.update_subscription_group("G", broker_names=["broker-b"], consume_enable=True,
                                                        retry_max_times=2)
        assert [(u.broker_name, u.changed) for u in updates] == [
            ("broker-b", {"consume_enable": (False, True), "retry_max_times": (16, 2)})]
        listed = await admin.subscription_groups("G")
        assert [(g.broker_name, g.consume_enable, g.retry_max_times) for g in listed] == [
            ("broker-a", False, 16), ("broker-b", True, 2)]
        assert await admin.subscription_groups("other") == []
        with pytest.raises(ValueError, match="retry_queue_nums must be an integer within 1..1024"):
            await admin.update_subscription_group("G", retry_queue_nums=0)
        with pytest.raises(TypeError, match="not a subscription group field"):
            await admin.update_subscription_group("G", consume_enabled=False)
        with pytest.raises(RaftMQError) as caught:
            await admin.update_subscription_group("G", broker_names=["broker-c"])
        assert "broker-c" in str(caught.value)
        deleted = await admin.delete_group("G")
        assert deleted.config_removed_from == ("broker-a", "broker-b")
        assert await admin.subscription_groups("G") == []
