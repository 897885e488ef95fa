"""Records a broker stored from batches before it refused property blocks ``encode_properties`` would not write
(an empty name, a value holding \\x01): they read back as properties that cannot be encoded again, so POP's revive
dropped such a message from its checkpoint (lost to the group) and CONSUMER_SEND_MSG_BACK refused it for ever. Stored
again as they were, their block is copied. One in-process node; the records are appended as an older broker took
them, past today's send check."""

from __future__ import annotations

import pytest

from broker.pop import now_ms
from broker.topic_config import PERM_READ_WRITE, TopicConfig
from remoting.codes import RequestCode, ResponseCode
from remoting.message import check_topic, decode_record, encode_uniform_batch, ip_bytes, iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import call, wait_leader
from tests.integration.broker.test_pop_broker import FAR, _broker, _pop, _pop_keys

LEGACY_BLOCKS = [b"\x01v\x02UNIQ_KEY\x01u1\x02", b"a\x01b\x01c\x02UNIQ_KEY\x01u2\x02"]


async def _append_legacy(node, topic: str, block: bytes):
    """Append a message with ``block`` as properties, as a broker that took it from a batch stored it."""
    await node.ensure_topic(TopicConfig(topic, 1, 1, PERM_READ_WRITE))
    batch = encode_uniform_batch(check_topic(topic), 0, [(b"legacy", block, 0)], 1, (ip_bytes("127.0.0.1"), 1),
                                 (ip_bytes(node.store_host[0]), node.store_host[1]))
    (stored,) = await node.append_messages(batch)
    return stored


@pytest.mark.parametrize("block", LEGACY_BLOCKS)
async def test_a_popped_legacy_record_is_revived_to_the_dead_letters_as_stored(nursery, tmp_path, block):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _append_legacy(node, "PopLegacy", block)
        (got,) = await _pop(client, addr, "g", "PopLegacy")
        assert got[0].body == b"legacy"
        assert await node.pop.revive_expired(now=now_ms() + FAR) == 1
        assert [key for key in _pop_keys(node) if key.startswith("c\x01")] == []
        dlq = node.store.get_messages("%DLQ%g", 0, 0, 8, 1 << 30)
        (dead,) = iter_records(b"".join(bytes(m) for m in dlq.messages))
        assert dead.body == b"legacy" and dead.reconsume_times == 1
        assert bytes(dlq.messages[0]).endswith(len(block).to_bytes(2, "big") + block)  # the block, byte for byte


@pytest.mark.parametrize("block", LEGACY_BLOCKS)
async def test_a_legacy_record_sent_back_goes_to_the_dead_letters_as_stored(nursery, tmp_path, block):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        stored = await _append_legacy(node, "BackLegacy", block)
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK,
                       {"offset": stored.phy_offset, "group": "billing", "origin_topic": "BackLegacy",
                        "max_reconsume_times": 16})
        assert r.code == ResponseCode.SUCCESS and r.ext["dead"] is True, (r.code, r.remark)
        assert r.ext["topic"] == "%DLQ%billing" and r.ext["reconsume_times"] == 1
        viewed = await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": r.ext["msg_id"]})
        copy = decode_record(viewed.body)
        assert (copy.topic, copy.body, copy.reconsume_times) == ("%DLQ%billing", b"legacy", 1)
        assert bytes(viewed.body).endswith(len(block).to_bytes(2, "big") + block)
