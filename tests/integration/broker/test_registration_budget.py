"""A broker group's topic table rides in every registration: topic creation stops where the registration would no
longer fit the node's max_frame_size, so the group stays registered and routed (name servers take frames as large)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import re

import cbor2
import pytest
import trio

from broker.registration import registration_body_budget
from broker.topic_config import TOPIC_MAX_LENGTH, TopicConfig, registration_entry_size
from namesrv import NamesrvConfig, serve_namesrv
from remoting.codes import RequestCode, ResponseCode
from remoting.config import ConfigError
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, start_namesrv, wait_leader
from tests.integration.broker.test_broker_node import _send

# What lets max_frame_size go lowest: small messages, pulls and catch-up chunks.
_SMALL = {"max_transfer_bytes": 1024, "store.max_message_size": 1024, "dledger.catch_up_chunk_bytes": 4096}


def _smallest_frame_size(tmp_path) -> int:
    """The smallest max_frame_size a node with ``_SMALL`` accepts (what its config check asks for)."""
    try:
        broker_configs(tmp_path, None, max_frame_size=1024, **_SMALL)
    except ConfigError as e:
        return int(re.search(r">= (\d+)", str(e)).group(1))
    raise AssertionError("max_frame_size 1024 was accepted")


def _long_name(i: int) -> str:
    return f"T{i:05d}".ljust(TOPIC_MAX_LENGTH, "x")


async def _routed(client, namesrv: str, topic: str) -> bool:
    r = await call(client, namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
    return r.code == ResponseCode.SUCCESS and [b["broker_name"] for b in cbor2.loads(r.body)["broker_datas"]] == [
        "broker-a"]


async def _registrations(client, addr: str) -> tuple[int, int]:
    info = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
    return info["registrations_ok"], info["registrations_failed"]


@pytest.mark.slow
async def test_topics_past_the_registration_budget_are_refused_and_the_group_stays_routed(nursery, tmp_path):
    # The name server takes frames as large as the node's, as docs/operations.md asks (16 MiB both by default).
    # Before, topics were created up to max_topic_count: the registration outgrew the frame, the name server closed
    # the connection on it, and the group was out of the route.
    frame = _smallest_frame_size(tmp_path)
    host, port = await nursery.start(functools.partial(
        serve_namesrv, NamesrvConfig(listen="127.0.0.1:0", max_frame_size_bytes=frame)))
    namesrv = f"{host}:{port}"
    (config,) = broker_configs(tmp_path, namesrv, max_frame_size=frame, max_topic_count=200_000, **_SMALL)
    addr = await start_broker(nursery, config)
    fits = registration_body_budget(frame) // registration_entry_size(TopicConfig(_long_name(0)))
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        created, refused = [], None
        for i in range(fits + 20):
            r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": _long_name(i)})
            if r.code != ResponseCode.SUCCESS:
                refused = r
                break
            created.append(_long_name(i))
        assert refused is not None, f"{len(created)} topics created, none refused"
        assert refused.code == ResponseCode.INVALID_REQUEST, refused.remark
        assert f"over its budget of {registration_body_budget(frame)} (max_frame_size {frame}" in refused.remark
        assert fits - 10 <= len(created) <= fits, (len(created), fits)
        # An auto-create is refused alike; an existing topic is still sent to and updated.
        r = await _send(client, addr, topic=_long_name(99_999))
        assert r.code == ResponseCode.TOPIC_NOT_EXIST and "not auto-created" in r.remark, r.remark
        assert (await _send(client, addr, topic=created[-1])).code == ResponseCode.SUCCESS
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC,
                       {"topic_name": created[0], "read_queue_nums": 2, "write_queue_nums": 2})
        assert r.code == ResponseCode.SUCCESS, r.remark
        # Still registered, every topic routed: the last registration held them all.
        assert await _routed(client, namesrv, created[0]) and await _routed(client, namesrv, created[-1])
        ok, failed = await _registrations(client, addr)
        assert ok >= len(created) and failed == 0, (ok, failed)
        # An update that grows a topic's entry (a topic_sys_flag of 5 bytes for 1) is refused at the budget too.
        for topic in created[2:]:
            r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC,
                           {"topic_name": topic, "topic_sys_flag": 2 ** 31 - 1})
            if r.code != ResponseCode.SUCCESS:
                break
        assert r.code == ResponseCode.INVALID_REQUEST and "not updated" in r.remark, r.remark
        assert "over its budget" in r.remark, r.remark
        assert await _routed(client, namesrv, created[-1])
        # A deleted topic makes room.
        r = await call(client, addr, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": created[1]})
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": _long_name(99_998)})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert await _routed(client, namesrv, _long_name(99_998))
        assert (await _registrations(client, addr))[1] == 0


@pytest.mark.slow
async def test_a_table_stored_past_the_budget_starts_serves_and_refuses_new_topics(nursery, tmp_path, caplog):
    # Topics created under a larger max_frame_size than the node restarts with: it starts and serves them, warns,
    # registers them whole (this name server takes 16 MiB), and creates no topic until enough are deleted.
    frame = _smallest_frame_size(tmp_path)
    namesrv = await start_namesrv(nursery)
    (large,) = broker_configs(tmp_path, namesrv, max_frame_size=2 * frame, **_SMALL)
    small = dataclasses.replace(large, max_frame_size=frame)
    over = registration_body_budget(frame) // registration_entry_size(TopicConfig(_long_name(0))) + 5
    async with open_remoting_client() as client:
        async with trio.open_nursery() as first:
            addr = await start_broker(first, large)
            await wait_leader(client, addr)
            for i in range(over):
                r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": _long_name(i)})
                assert r.code == ResponseCode.SUCCESS, (i, r.remark)
            first.cancel_scope.cancel()
        with caplog.at_level(logging.WARNING, logger="broker.registration"):
            async with trio.open_nursery() as second:
                addr = await start_broker(second, small)
                await wait_leader(client, addr)
                assert (await _send(client, addr, topic=_long_name(0))).code == ResponseCode.SUCCESS
                r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "Brandnew"})
                assert r.code == ResponseCode.INVALID_REQUEST and "over its budget" in r.remark, r.remark
                # An update that does not grow the registration passes.
                r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC,
                               {"topic_name": _long_name(1), "read_queue_nums": 2, "write_queue_nums": 2})
                assert r.code == ResponseCode.SUCCESS, r.remark
                with trio.fail_after(10):
                    while not await _routed(client, namesrv, _long_name(1)):
                        await trio.sleep(0.05)
                for i in range(10):
                    r = await call(client, addr, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": _long_name(i)})
                    assert r.code == ResponseCode.SUCCESS, r.remark
                r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "Brandnew"})
                assert r.code == ResponseCode.SUCCESS, r.remark
                second.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if "over its budget" in r.getMessage()]
    assert warnings and "still sent" in warnings[0], warnings
