"""Which checkpoint answers an ack or a change "superseded" (broker/pop.py ``CheckPoint.supersedes``): only one a
CHANGE of that handle (or of one a CHANGE of it returned) made. A message handed out again after an offset reset is
in another checkpoint too, but a retried ack of its first delivery was acked already, and is answered so.
"""

from __future__ import annotations

import trio

from broker.pop import ReceiptHandle
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import call, wait_leader
from tests.integration.broker.test_pop_broker import _ack, _batch_ack, _broker, _pop, _send


async def _change(client, addr: str, handle: str):
    return await call(client, addr, RequestCode.CHANGE_MESSAGE_INVISIBLETIME,
                      {"consumer_group": "g", "topic": "T", "receipt_handle": handle, "invisible_time_ms": 60_000})


async def test_a_retried_ack_after_an_offset_reset_handed_the_message_out_again_is_acked_already(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for i in range(2):
            await _send(client, addr, "T", f"m{i}".encode())
        h0, h1 = (h for _m, h in await _pop(client, addr, "g", "T"))
        assert (await _ack(client, addr, "g", "T", h0)).ext["acked"] is True
        await trio.sleep(0.002)  # the next POP's pop time is later than h0's
        await node.reset_offsets("g", "T", {0: 0})
        again = [h for _m, h in await _pop(client, addr, "g", "T")]
        assert [ReceiptHandle.decode(h).queue_offset for h in again] == [0, 1]
        # The response to h0's ack was lost, the client acks again: acked already, not superseded.
        r = await _ack(client, addr, "g", "T", h0)
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert r.ext["acked"] is False
        _r, entries = await _batch_ack(client, addr, "g", [h0])
        assert entries == [{"code": 0, "acked": False}]
        r = await _change(client, addr, h0)
        assert r.code == ResponseCode.NO_MESSAGE and "acked already" in r.remark, r.remark
        # A CHANGE of the second delivery supersedes its handle, not the first delivery's.
        r = await _change(client, addr, again[0])
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await _ack(client, addr, "g", "T", h0)
        assert r.code == ResponseCode.SUCCESS and r.ext["acked"] is False, r.remark
        r = await _ack(client, addr, "g", "T", again[0])
        assert r.code == ResponseCode.NO_MESSAGE and "superseded" in r.remark, r.remark
        # h1, never acked, still acks its message (held by both deliveries' checkpoints).
        assert (await _ack(client, addr, "g", "T", h1)).ext["acked"] is True


async def test_every_handle_before_a_change_of_the_delivery_is_superseded(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for i in range(2):
            await _send(client, addr, "T", f"m{i}".encode())
        _h0, h1 = (h for _m, h in await _pop(client, addr, "g", "T"))
        chain = [h1]
        for _ in range(2):
            await trio.sleep(0.002)
            r = await _change(client, addr, chain[-1])
            assert r.code == ResponseCode.SUCCESS, r.remark
            chain.append(r.ext["receipt_handle"])
        for old in chain[:-1]:
            r = await _ack(client, addr, "g", "T", old)
            assert r.code == ResponseCode.NO_MESSAGE and "superseded" in r.remark, r.remark
            r = await _change(client, addr, old)
            assert r.code == ResponseCode.NO_MESSAGE and "superseded" in r.remark, r.remark
        _r, entries = await _batch_ack(client, addr, "g", chain[:-1])
        assert [e["code"] for e in entries] == [ResponseCode.NO_MESSAGE] * 2
        assert all("superseded" in e["remark"] for e in entries)
        assert (await _ack(client, addr, "g", "T", chain[-1])).ext["acked"] is True
