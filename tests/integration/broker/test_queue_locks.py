"""LOCK_BATCH_MQ and UNLOCK_BATCH_MQ against in-process broker nodes: one node, and a 3-node group losing its
leader."""

from __future__ import annotations

import cbor2
import trio

from broker.node import LOCK_TABLE, BrokerNode, serve_broker
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, wait_leader
from tests.integration.broker.test_group_registration import _leader

# The nodes running in this process, by address: the tests read their replicated lock table.
_NODES: dict[str, BrokerNode] = {}


async def _start(nursery, config, scopes: dict[str, trio.CancelScope] | None = None) -> str:
    async def run(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            if scopes is not None:
                scopes[config.broker_addr] = scope
            await serve_broker(config, on_serving=lambda node: _NODES.__setitem__(config.broker_addr, node),
                               task_status=task_status)

    host, port = await nursery.start(run)
    return f"{host}:{port}"


def _lock_table(addr: str) -> dict[str, str]:
    return {k.replace("\x01", "/"): v for k, v in _NODES[addr].group.metadata(LOCK_TABLE).items()}


def _body(client_id: str, *queues: int, group: str = "cg", topic: str = "T") -> bytes:
    return cbor2.dumps({"consumer_group": group, "client_id": client_id,
                        "mq_set": [{"topic": topic, "broker_name": "broker-a", "queue_id": q} for q in queues]})


async def _create_topic(client, addr: str, topic: str = "T", queues: int = 8) -> None:
    r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC,
                   {"topic_name": topic, "read_queue_nums": queues, "write_queue_nums": queues, "perm": 6})
    assert r.code == ResponseCode.SUCCESS, r.remark


async def _lock(client, addr: str, client_id: str, *queues: int, **kw) -> list[int]:
    r = await call(client, addr, RequestCode.LOCK_BATCH_MQ, body=_body(client_id, *queues, **kw))
    assert r.code == ResponseCode.SUCCESS, r.remark
    return sorted(mq["queue_id"] for mq in cbor2.loads(r.body)["lock_ok_mq_set"])


async def test_locks_are_per_group_and_client_and_an_unlock_frees_only_the_callers_own(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None)
    addr = await _start(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _create_topic(client, addr)
        r = await call(client, addr, RequestCode.LOCK_BATCH_MQ, body=_body("c1", 0, 1))
        assert r.code == ResponseCode.SUCCESS and r.ext["rebalance_lock_max_live_time_ms"] == 60_000
        assert await _lock(client, addr, "c2", 1, 2) == [2]
        assert await _lock(client, addr, "c1", 0, 1, 2) == [0, 1]  # renewed; 2 is c2's
        assert await _lock(client, addr, "c3", 0, group="other") == [0]
        # The same map inline in ext, as a heartbeat may come.
        r = await call(client, addr, RequestCode.LOCK_BATCH_MQ, cbor2.loads(_body("c2", 2, 3)))
        assert r.code == ResponseCode.SUCCESS
        assert [mq["queue_id"] for mq in cbor2.loads(r.body)["lock_ok_mq_set"]] == [2, 3]

        r = await call(client, addr, RequestCode.UNLOCK_BATCH_MQ, body=_body("c2", 0, 1, 2))
        assert r.code == ResponseCode.SUCCESS and r.ext["unlocked"] == 1  # only its own queue 2
        assert await _lock(client, addr, "c1", 0, 1, 2) == [0, 1, 2]
        r = await call(client, addr, RequestCode.UNLOCK_BATCH_MQ, body=_body("c9", 0, group="never_seen"))
        assert r.code == ResponseCode.SUCCESS and r.ext["unlocked"] == 0
        # Holders are replicated (a new leader restores them); an unlock removes its entries.
        assert _lock_table(addr) == {"cg/T/0": "c1", "cg/T/1": "c1", "cg/T/2": "c1", "cg/T/3": "c2",
                                     "other/T/0": "c3"}


async def test_bad_lock_requests_get_invalid_request_naming_the_field(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None)
    addr = await _start(nursery, config)
    good = {"consumer_group": "cg", "client_id": "c1", "mq_set": [{"topic": "T", "queue_id": 0}]}
    cases = [
        (b"\xff\x00", "body", "not valid CBOR"),
        (cbor2.dumps([1, 2]), "body", "must be a CBOR map"),
        (cbor2.dumps({**good, "consumer_group": "bad group!"}), "consumer_group", "illegal"),
        (cbor2.dumps({k: v for k, v in good.items() if k != "client_id"}), "client_id", "is required"),
        (cbor2.dumps({**good, "client_id": "x" * 256}), "client_id", "at most 255"),
        (cbor2.dumps({k: v for k, v in good.items() if k != "mq_set"}), "mq_set", "is required"),
        (cbor2.dumps({**good, "mq_set": {"topic": "T"}}), "mq_set", "must be a list"),
        (cbor2.dumps({**good, "mq_set": [{"topic": "T", "queue_id": 0}, "T:1"]}), "mq_set[1]", "must be a map"),
        (cbor2.dumps({**good, "mq_set": [{"topic": "bad topic", "queue_id": 0}]}), "mq_set[0].topic", "illegal"),
        (cbor2.dumps({**good, "mq_set": [{"queue_id": 0}]}), "mq_set[0].topic", "non-empty string"),
        (cbor2.dumps({**good, "mq_set": [{"topic": "T", "queue_id": -1}]}), "mq_set[0].queue_id", "0..2147483647"),
        (cbor2.dumps({**good, "mq_set": [{"topic": "T", "queue_id": True}]}), "mq_set[0].queue_id", "integer"),
        (cbor2.dumps({**good, "mq_set": [{"topic": "T", "queue_id": 0, "broker_name": "broker-b"}]}),
         "mq_set[0].broker_name", "'broker-b'"),
        (cbor2.dumps({**good, "mq_set": [{"topic": "T", "queue_id": 0}] * 16_385}), "mq_set", "at most 16384"),
    ]
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _create_topic(client, addr)
        for code in (RequestCode.LOCK_BATCH_MQ, RequestCode.UNLOCK_BATCH_MQ):
            for body, field, words in cases:
                r = await call(client, addr, code, body=body)
                assert r.code == ResponseCode.INVALID_REQUEST, (code, field, r.code, r.remark)
                assert r.ext["field"] == field and f"'{field}'" in r.remark and words in r.remark, r.remark
        # Nothing of it was locked, and the node goes on serving.
        assert await _lock(client, addr, "c2", 0) == [0]


async def test_followers_refuse_locks_and_a_new_leader_keeps_the_holders_of_the_old(nursery, tmp_path):
    """RocketMQ keeps queue locks in the master's memory only: a new master lets anyone lock any queue at once, while
    the old holders still consume. Here a change of holder is replicated, and a new leader restores the holders,
    each as if renewed when its term started: the holder keeps its queues, everyone else is refused."""
    scopes: dict[str, trio.CancelScope] = {}
    addrs = [await _start(nursery, config, scopes) for config in broker_configs(tmp_path, None, n=3)]
    async with open_remoting_client() as client:
        leader = await _leader(client, addrs)
        await _create_topic(client, leader)
        assert await _lock(client, leader, "c1", 0, 1) == [0, 1]
        for follower in (a for a in addrs if a != leader):
            r = await call(client, follower, RequestCode.LOCK_BATCH_MQ, body=_body("c2", 2))
            assert r.code == ResponseCode.NOT_LEADER and r.ext["leader_addr"] == leader, r.remark
            r = await call(client, follower, RequestCode.UNLOCK_BATCH_MQ, body=_body("c1", 0))
            assert r.code == ResponseCode.NOT_LEADER
        with trio.fail_after(5):  # the followers applied the holders
            while any(len(_lock_table(a)) < 2 for a in addrs):
                await trio.sleep(0.02)

        scopes[leader].cancel()
        survivors = [a for a in addrs if a != leader]
        new_leader = await _leader(client, survivors)
        assert await _lock(client, new_leader, "c2", 0, 1, 2) == [2]
        assert await _lock(client, new_leader, "c1", 0, 1) == [0, 1]
        r = await call(client, new_leader, RequestCode.UNLOCK_BATCH_MQ, body=_body("c1", 0))
        assert r.code == ResponseCode.SUCCESS and r.ext["unlocked"] == 1
        assert await _lock(client, new_leader, "c2", 0, 1) == [0]


async def test_only_queues_of_existing_topics_below_their_counts_are_locked(nursery, tmp_path):
    """Holders are replicated: a lock of any name let one client write made-up queues to the group's log and
    snapshots by the thousand a request."""
    (config,) = broker_configs(tmp_path, None)
    addr = await _start(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _create_topic(client, addr, "T", 4)
        assert await _lock(client, addr, "c1", *range(100)) == [0, 1, 2, 3]
        assert await _lock(client, addr, "c1", 0, 1, topic="NoSuchTopic") == []
        assert _lock_table(addr) == {f"cg/T/{q}": "c1" for q in range(4)}
        # Fewer read queues (the ones consumers are given): the others are no longer renewed.
        await _create_topic(client, addr, "T", 2)
        assert await _lock(client, addr, "c1", 0, 1, 2, 3) == [0, 1]
        # Unlocking is not checked: the queues of a topic deleted since can still be given back.
        r = await call(client, addr, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": "T"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await call(client, addr, RequestCode.UNLOCK_BATCH_MQ, body=_body("c1", 0, 1, 2, 3))
        assert r.code == ResponseCode.SUCCESS and r.ext["unlocked"] == 4
        assert _lock_table(addr) == {}
