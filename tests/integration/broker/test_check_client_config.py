"""CHECK_CLIENT_CONFIG (46), RocketMQ's checkClientConfig, against in-process broker nodes: a node says whether it
would serve a subscription to the group's pulls, by its own config, before a consumer consumes it."""

from __future__ import annotations

import dataclasses

import cbor2
import trio

from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, wait_leader

REFUSAL = "The broker does not support consumer to filter message by SQL92"
CLIENT_ID = "127.0.0.1@1#check#DEFAULT#1"


def _body(subscription, *, client_id=CLIENT_ID, consumer_group="check_group") -> dict:
    return {"client_id": client_id, "consumer_group": consumer_group, "subscription": subscription}


async def _check(client, addr, data, *, inline=False):
    if inline:  # a small request may carry the map as its ext, as a heartbeat may
        return await call(client, addr, RequestCode.CHECK_CLIENT_CONFIG, data)
    return await call(client, addr, RequestCode.CHECK_CLIENT_CONFIG,
                      body=data if isinstance(data, bytes) else cbor2.dumps(data))


async def _node(nursery, tmp_path, **overrides) -> str:
    (config,) = broker_configs(tmp_path, None, **overrides)
    return await start_broker(nursery, config)


async def test_tag_subscriptions_pass_on_any_node_and_sql92_only_where_the_property_filter_is_enabled(
        nursery, tmp_path):
    plain = await _node(nursery, tmp_path / "plain")
    sql = await _node(nursery, tmp_path / "sql", enable_property_filter=True)
    async with open_remoting_client() as client:
        for addr in (plain, sql):
            for sub in ({"topic": "T", "expression": "TagA || TagB"},  # no type: TAG
                        {"topic": "T", "expression": "*", "expression_type": "TAG", "sub_version": 7},
                        {"topic": "T"}):
                r = await _check(client, addr, _body(sub))
                assert r.code == ResponseCode.SUCCESS, (addr, sub, r.remark)
            r = await _check(client, addr, _body({"topic": "T", "expression": "TagA"}), inline=True)
            assert r.code == ResponseCode.SUCCESS, r.remark

        sql92 = {"topic": "T", "expression": "a BETWEEN 3 AND 5 AND color IN ('red', 'blue')",
                 "expression_type": "SQL92", "sub_version": 1}
        r = await _check(client, sql, _body(sql92))
        assert r.code == ResponseCode.SUCCESS, r.remark

        r = await _check(client, plain, _body(sql92))
        assert r.code == ResponseCode.SYSTEM_ERROR
        # The pull's refusal, word for word: RocketMQ's text, then the group, the node and the key to set.
        assert r.remark == (f"{REFUSAL}: broker broker-a (node {plain}) has enable_property_filter = false")
        assert r.ext["field"] == "expression_type"
        await wait_leader(client, plain)
        created = await call(client, plain, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "T"})
        assert created.code == ResponseCode.SUCCESS, created.remark
        pull = await call(client, plain, RequestCode.PULL_MESSAGE, {
            "consumer_group": "check_group", "topic": "T", "queue_id": 0, "queue_offset": 0,
            "subscription": "a > 1", "expression_type": "SQL92"})
        assert (pull.code, pull.remark) == (r.code, r.remark)

        # Asking registers nothing: the group has no member on either node.
        for addr in (plain, sql):
            ids = await call(client, addr, RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumer_group": "check_group"})
            assert cbor2.loads(ids.body)["consumer_id_list"] == []


async def test_an_expression_that_does_not_parse_is_subscription_parse_failed_after_the_type_is_judged(
        nursery, tmp_path):
    plain = await _node(nursery, tmp_path / "plain")
    sql = await _node(nursery, tmp_path / "sql", enable_property_filter=True)
    async with open_remoting_client() as client:
        bad_sql = {"topic": "T", "expression": "a > ", "expression_type": "SQL92"}
        r = await _check(client, sql, _body(bad_sql))
        assert r.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED
        assert r.remark.startswith("subscription.expression: ") and "at character 5" in r.remark
        assert r.ext["field"] == "expression"
        # A node that cannot filter by SQL92 says that first (as RocketMQ's, which judges the type first).
        r = await _check(client, plain, _body(bad_sql))
        assert r.code == ResponseCode.SYSTEM_ERROR and REFUSAL in r.remark
        # A tag expression its pulls would refuse is refused alike (RocketMQ answers SUCCESS without looking).
        r = await _check(client, plain, _body({"topic": "T", "expression": "TagA || "}))
        assert r.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED and "empty tag" in r.remark


async def test_a_malformed_request_is_invalid_request_naming_the_field(nursery, tmp_path):
    addr = await _node(nursery, tmp_path, enable_property_filter=True)
    ok = {"topic": "T", "expression": "a > 1", "expression_type": "SQL92"}
    cases = [
        (b"\xff\x00 not cbor", "body"),
        (cbor2.dumps(["client_id", CLIENT_ID]), "body"),
        ({"consumer_group": "g", "subscription": ok}, "client_id"),
        (_body(ok, client_id=""), "client_id"),
        (_body(ok, client_id="c" * 256), "client_id"),
        ({"client_id": CLIENT_ID, "subscription": ok}, "consumer_group"),
        (_body(ok, consumer_group="bad group!"), "consumer_group"),
        ({"client_id": CLIENT_ID, "consumer_group": "g"}, "subscription"),
        (_body("a > 1"), "subscription"),
        (_body([ok]), "subscription"),
        (_body({"expression": "a > 1", "expression_type": "SQL92"}), "topic"),
        (_body({**ok, "topic": "bad topic!"}), "topic"),
        (_body({**ok, "expression_type": "REGEX"}), "expression_type"),
        (_body({**ok, "sub_version": "1"}), "sub_version"),
        (_body({**ok, "sub_version": True}), "sub_version"),
    ]
    async with open_remoting_client() as client:
        for data, field in cases:
            r = await _check(client, addr, data)
            assert r.code == ResponseCode.INVALID_REQUEST, (data, r.code, r.remark)
            assert r.ext["field"] == field, (data, r.remark)
            assert field in r.remark, (data, r.remark)
        # The node serves on.
        assert (await _check(client, addr, _body(ok))).code == ResponseCode.SUCCESS


async def test_every_node_of_a_group_answers_for_itself_leader_or_follower(nursery, tmp_path):
    configs = broker_configs(tmp_path, None, n=3)
    # The property filter is a node's own key: here only the first node sets it.
    configs[0] = dataclasses.replace(configs[0], enable_property_filter=True)
    addrs = [await start_broker(nursery, config) for config in configs]
    sql92 = _body({"topic": "T", "expression": "a > 1", "expression_type": "SQL92"})
    async with open_remoting_client() as client:
        roles = {}
        with trio.fail_after(10):
            while "LEADER" not in roles.values():
                for addr in addrs:
                    info = await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)
                    roles[addr] = cbor2.loads(info.body)["role"]
                await trio.sleep(0.05)
        assert list(roles.values()).count("FOLLOWER") >= 1, roles
        for addr in addrs:
            r = await _check(client, addr, sql92)
            if addr == addrs[0]:
                assert r.code == ResponseCode.SUCCESS, (roles[addr], r.remark)
            else:
                assert r.code == ResponseCode.SYSTEM_ERROR and f"(node {addr})" in r.remark, (roles[addr], r.remark)
            assert (await _check(client, addr, _body({"topic": "T"}))).code == ResponseCode.SUCCESS
