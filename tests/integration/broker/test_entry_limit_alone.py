"""A message a broker service stores again alone is judged against ``max_entry_bytes``, the send path's limit.

Rounds of two or more messages keep ``ENTRY_SLACK_BYTES`` (64) below the limit (their entry may cross a segment end
where the lone builds did not). A message going alone was held to that slack too: one whose copy makes an entry
within 64 bytes of the limit was dropped from delayed delivery or sent to the DLQ by POP revive, though the send
path had stored it. A transaction half and its op record share an entry: a half whose copy fitted alone but not with
its op record failed the check round every time, and no later half was checked. Against one in-process broker with
128 KiB entries; each message is sized (by its body) to the entry its copy makes, measured by ``entry_size``.
"""

from __future__ import annotations

import functools

import trio

from broker.node import BrokerNode, serve_broker
from broker.pop import now_ms
from broker.schedule import restored_message, stored_again
from broker.service_rounds import alone_entry_bytes, entry_limit, entry_room
from remoting.codes import RequestCode, ResponseCode
from remoting.message import (PROPERTY_DELAY, PROPERTY_ORIGIN_MESSAGE_ID, PROPERTY_REAL_QUEUE_ID, PROPERTY_REAL_TOPIC,
                              PROPERTY_RETRY_TOPIC, PROPERTY_TRANSACTION_CHECK_TIMES, SCHEDULE_TOPIC, TRANS_HALF_TOPIC,
                              MessageInput, decode_record)
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, wait_leader

KEYS = "k " * 3000  # 3,000 index entries: 36,000 bytes of entry, so a body within max_message_size fills one
SMALL_ENTRIES = {"dledger.append_entries_batch_size_bytes": 256 * 1024, "dledger.max_batch_bytes": 16 * 1024}
HOUR_MS = 3_600_000


def _body(node: BrokerNode, shape: MessageInput, entry_bytes: int) -> bytes:
    """A body that makes ``shape`` (its topic and properties) an entry of ``entry_bytes`` alone: the entry grows
    byte for byte with the body."""
    n = 1000
    n += entry_bytes - alone_entry_bytes(node, MessageInput(shape.topic, shape.queue_id, b"x" * n, shape.properties,
                                                             reconsume_times=shape.reconsume_times))
    assert n <= node.max_message_size
    return b"x" * n


def _stored(node: BrokerNode, topic: str, queue_id: int = 0) -> list:
    return [decode_record(raw) for raw in node.store.get_messages(topic, queue_id, 0, 64, 1 << 30).messages]


async def _send(client, addr: str, topic: str, body: bytes, **properties: str) -> None:
    r = await call(client, addr, RequestCode.SEND_MESSAGE, {"producer_group": "pg", "topic": topic, "queue_id": 0,
                                                            "properties": {"KEYS": KEYS, **properties}}, body)
    assert r.code == ResponseCode.SUCCESS, r.remark


async def test_a_copy_within_the_slack_of_the_limit_is_delivered_revived_and_a_half_too_big_with_its_op_settled(
        nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, message_delay_level="1s 1h", pop_revive_interval_ms=60_000,
                               transaction_check_interval_ms=3_600_000, **SMALL_ENTRIES)
    nodes: list[BrokerNode] = []
    host, port = await nursery.start(functools.partial(serve_broker, config, on_serving=nodes.append))
    node, addr = nodes[0], f"{host}:{port}"
    limit, room = entry_limit(node), entry_room(node)
    assert limit == node.config.dledger.max_entry_bytes and room == limit - 64
    async with open_remoting_client() as client:
        await wait_leader(client, addr)

        # Delayed delivery: the copy in the real topic (DELAY dropped) makes an entry 10 bytes past the slack.
        shape = MessageInput("DelayW", 0, b"", {"KEYS": KEYS, PROPERTY_REAL_TOPIC: "DelayW",
                                                PROPERTY_REAL_QUEUE_ID: "0"})
        await _send(client, addr, "DelayW", _body(node, shape, room + 10), DELAY="2")
        (parked,) = _stored(node, SCHEDULE_TOPIC, 1)
        assert room < alone_entry_bytes(node, restored_message(parked, (PROPERTY_DELAY,))) <= limit
        assert await node.schedule.deliver_due(now_ms=now_ms() + 2 * HOUR_MS) == 1
        assert (node.schedule.delivered, node.schedule.dropped) == (1, 0)
        (delivered,) = _stored(node, "DelayW")
        assert delivered.body == parked.body

        # POP revive: the copy in the retry topic (two properties more) makes an entry 10 bytes past the slack.
        shape = MessageInput("%RETRY%g+PopW", 0, b"", {"KEYS": KEYS, PROPERTY_RETRY_TOPIC: "PopW",
                                                       PROPERTY_ORIGIN_MESSAGE_ID: "0" * 32}, reconsume_times=1)
        await _send(client, addr, "PopW", _body(node, shape, room + 10))
        r = await call(client, addr, RequestCode.POP_MESSAGE,
                       {"consumer_group": "g", "topic": "PopW", "queue_id": 0, "max_msg_nums": 32,
                        "invisible_time_ms": 60_000, "init_mode": 0})
        assert r.code == ResponseCode.SUCCESS and len(r.ext["receipt_handles"]) == 1, r.remark
        assert await node.pop.revive_expired(now=now_ms() + 10 ** 9) == 1
        assert (node.pop.revived, node.pop.dead) == (1, 0)
        retry = "%RETRY%g+PopW"
        (revived,) = [m for q in range(node.topic(retry).write_queue_nums) for m in _stored(node, retry, q)]
        assert room < alone_entry_bytes(node, stored_again(revived, retry, 0, revived.properties)) <= limit

        # Transaction checks: the re-stored copy fits alone, within the slack even, but not with its op record.
        # Settled (discarded, as a half that cannot be stored again), and the half after it is checked.
        shape = MessageInput(TRANS_HALF_TOPIC, 0, b"", {
            "KEYS": KEYS, "TRAN_MSG": "true", "PGROUP": "pg", "UNIQ_KEY": "U-big", PROPERTY_REAL_TOPIC: "TxW",
            PROPERTY_REAL_QUEUE_ID: "0", PROPERTY_TRANSACTION_CHECK_TIMES: "1"})
        await _send(client, addr, "TxW", _body(node, shape, room - 10), TRAN_MSG="true", PGROUP="pg",
                    UNIQ_KEY="U-big")
        await _send(client, addr, "TxW", b"small", TRAN_MSG="true", PGROUP="pg", UNIQ_KEY="U-small")
        big, small = _stored(node, TRANS_HALF_TOPIC)
        copy = stored_again(big, TRANS_HALF_TOPIC, 0, {**big.properties, PROPERTY_TRANSACTION_CHECK_TIMES: "1"})
        assert alone_entry_bytes(node, copy) <= room
        assert await node.transactions.check_round(now_ms=now_ms() + 2 * HOUR_MS) == 2
        assert (node.transactions.checks, node.transactions.discarded) == (1, 1)
        copies = _stored(node, TRANS_HALF_TOPIC)[2:]
        assert [m.properties["UNIQ_KEY"] for m in copies] == ["U-small"]
