"""A batch of messages with many keys against a real 3-process group: refused at once, the leadership kept.

Found by review: a legal SEND_BATCH_MESSAGE (64 messages, each with 15,000 one-character keys in KEYS: 1.9 MB,
within max_message_size) stalled the leader. It learnt the batch's DLedger entry was too large (13.4 MB: 12 bytes
per index key) only after building it on the thread that ticks Raft (0.5 s), then built it again to name the
index entries in its refusal; with no heartbeat for ~1 s the followers elected another leader, 2-4 times a call.
The broker now refuses such a batch from its bytes, before anything is built (broker/processor/send_message.py).
"""

from __future__ import annotations

import pytest
import trio

from client import open_admin
from raftmq.commands.dev import NODE_IDS
from remoting.codes import RequestCode, ResponseCode
from remoting.message import MessageInput, encode_batch
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import start_cluster
from tests.integration.broker.helpers import call

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOPIC = "ManyKeysT"
KEYS = " ".join(str(i % 10) for i in range(15_000))  # 15,000 one-character keys, 30 KB of KEYS


async def _statuses(admin, addrs: list[str]) -> dict[str, tuple[str, int]]:
    return {addr: ((s := await admin.broker_status(addr))["role"], s["term"]) for addr in addrs}


async def _settled(admin, addrs: list[str]) -> dict[str, tuple[str, int]]:
    """The members' (role, term) once one leads and all three are in its term."""
    with trio.fail_after(30):
        while True:
            seen = await _statuses(admin, addrs)
            if [r for r, _ in seen.values()].count("LEADER") == 1 and len({t for _, t in seen.values()}) == 1:
                return seen
            await trio.sleep(0.1)


@pytest.mark.timeout(180)
async def test_a_batch_of_messages_with_many_keys_is_refused_with_no_election_the_leader_answering_meanwhile(
        spawn, tmp_path):
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic(TOPIC, 1)
    addrs = [cluster.addr_of[nid] for nid in NODE_IDS]
    # 128 such messages: 3.8 MB of batch within max_message_size (4 MiB), 1,920,000 index keys, a 27 MB entry.
    body = encode_batch([MessageInput(TOPIC, 0, b"b%d" % i, {"KEYS": KEYS}) for i in range(128)], ("127.0.0.1", 1))
    async with open_admin(cluster.namesrv) as admin, open_remoting_client() as client:
        before = await _settled(admin, addrs)
        leader = next(addr for addr, (role, _) in before.items() if role == "LEADER")
        await trio.sleep(1)  # every member heard the leader's heartbeats for a while: nothing left of the election
        assert await _statuses(admin, addrs) == before
        roles: list[str] = []
        done = trio.Event()

        async def ping() -> None:
            # The leader's other requests are answered, and it leads, all along the send and after it.
            while not done.is_set():
                r = await call(client, leader, RequestCode.GET_BROKER_RUNTIME_INFO)
                assert r.code == ResponseCode.SUCCESS, r.remark
                roles.append((await admin.broker_status(leader))["role"])
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ping)
            r = await call(client, leader, RequestCode.SEND_BATCH_MESSAGE, {"topic": TOPIC, "queue_id": 0}, body,
                           timeout_s=30)
            # Longer than the followers' election timeout (at most 900 ms): a stall would have made one by now.
            await trio.sleep(2)
            done.set()
        assert r.code == ResponseCode.MESSAGE_ILLEGAL, (r.code, r.remark)
        assert await _statuses(admin, addrs) == before, "a member changed role or term: the leader stalled"
        assert roles and set(roles) == {"LEADER"}, roles
        assert f"the batch of 128 messages ({len(body)} bytes) makes a DLedger entry of at least " in r.remark
        assert "its 1920000 index entries" in r.remark, r.remark
