"""Which checkpoint answers an ack or a change "superseded" (broker/pop.py ``CheckPoint.supersedes``): only one a
CHANGE of that handle (or of one a CHANGE of it returned) made. A message handed out again after an offset reset is
in another checkpoint too, but a retried ack of its first delivery was acked already, and is answered so. A checkpoint
written before checkpoints were marked ("v") is judged as then.
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


async def test_a_retried_ack_of_a_redelivery_first_in_its_checkpoint_is_not_taken_for_the_chains(nursery, tmp_path):
    # The re-delivery's handle starts its checkpoint at its message, as a CHANGE's does, and was popped after the
    # chain began: only the chain's kept pop times tell it is not one of the chain's.
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for i in range(2):
            await _send(client, addr, "T", f"m{i}".encode())
        _h0, h1 = (h for _m, h in await _pop(client, addr, "g", "T"))
        await trio.sleep(0.002)
        r = await _change(client, addr, h1)
        assert r.code == ResponseCode.SUCCESS, r.remark
        changed = r.ext["receipt_handle"]
        await trio.sleep(0.002)
        await node.reset_offsets("g", "T", {0: 1})
        again = [h for _m, h in await _pop(client, addr, "g", "T")]
        redelivered = ReceiptHandle.decode(again[0])
        assert (redelivered.queue_offset, redelivered.start_offset) == (1, 1)
        assert (await _ack(client, addr, "g", "T", again[0])).ext["acked"] is True
        await trio.sleep(0.002)
        r = await _change(client, addr, changed)  # the chain's CHANGE, later than the re-delivery's pop
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await _ack(client, addr, "g", "T", again[0])
        assert r.code == ResponseCode.SUCCESS and r.ext["acked"] is False, r.remark
        _r, entries = await _batch_ack(client, addr, "g", [again[0]])
        assert entries == [{"code": 0, "acked": False}]
        # The chain's own handles are still superseded.
        for old in (h1, changed):
            r = await _ack(client, addr, "g", "T", old)
            assert r.code == ResponseCode.NO_MESSAGE and "superseded" in r.remark, r.remark


async def test_a_change_checkpoint_written_before_the_marker_still_supersedes(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for i in range(2):
            await _send(client, addr, "T", f"m{i}".encode())
        _h0, h1 = (h for _m, h in await _pop(client, addr, "g", "T"))
        await trio.sleep(0.002)
        r = await _change(client, addr, h1)
        assert r.code == ResponseCode.SUCCESS, r.remark
        changed = r.ext["receipt_handle"]
        key = ReceiptHandle.decode(changed).checkpoint_key
        # The CHANGE's checkpoint as a node before "f" wrote it (or a snapshot it took holds it): no "f", no "v".
        await node.pop.write({key: {k: v for k, v in node.pop.table()[key].items() if k not in ("f", "v")}})
        r = await _ack(client, addr, "g", "T", h1)
        assert r.code == ResponseCode.NO_MESSAGE and "superseded" in r.remark, r.remark
        _r, entries = await _batch_ack(client, addr, "g", [h1])
        assert entries[0]["code"] == ResponseCode.NO_MESSAGE and "superseded" in entries[0]["remark"]
        assert (await _ack(client, addr, "g", "T", changed)).ext["acked"] is True
