"""Deletes racing POP writes on an in-process broker (broker/pop.py, "Nothing comes back after a delete"): a delete
waits for a POP whose write is on its way, and writes planned while a delete removes the keys are left out. Each
race is made by holding one POP-table write (a patched ``put_metadata``) and starting the other side meanwhile."""

from __future__ import annotations

import trio

from broker.pop import POP_TABLE
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import call, wait_leader
from tests.integration.broker.test_pop_broker import _broker, _pop, _send


def _hold_first_pop_write(node, of_key) -> tuple[trio.Event, trio.Event]:
    """Hold the first POP-table write with a key ``of_key`` accepts until ``release`` is set: (blocked, release)."""
    blocked, release = trio.Event(), trio.Event()
    put_metadata = node.group.put_metadata

    async def holding(table, items, **kw):
        if table == POP_TABLE and not blocked.is_set() and any(of_key(key) for key in items):
            blocked.set()
            await release.wait()
        return await put_metadata(table, items, **kw)

    node.group.put_metadata = holding  # type: ignore[method-assign]
    return blocked, release


def _keys(node, *, group: str | None = None, topic: str | None = None) -> list[str]:
    return [key for key in node.pop.table()
            if (group is not None and key.split("\x01")[1] == group) or (topic is not None and topic in key)]


async def test_a_delete_topic_waits_for_a_pop_whose_write_is_on_its_way(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, "PopDel", b"m0")
        blocked, release = _hold_first_pop_write(node, lambda key: key.split("\x01")[2] == "PopDel")
        answers: dict[str, object] = {}

        async def request(name: str, code: int, ext: dict) -> None:
            async with open_remoting_client() as own:
                answers[name] = await call(own, addr, code, ext)

        async with trio.open_nursery() as inner:
            inner.start_soon(request, "pop", RequestCode.POP_MESSAGE,
                             {"consumer_group": "g", "topic": "PopDel", "queue_id": 0, "invisible_time_ms": 60_000,
                              "init_mode": 0})
            await blocked.wait()  # the POP holds queue 0's lock; its pop offset and checkpoint are on their way
            inner.start_soon(request, "delete", RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": "PopDel"})
            with trio.fail_after(10):  # liveness only: the delete either answers or waits for the POP's lock
                while "delete" not in answers and node.pop._locks[("g", "PopDel", 0)].users < 2:
                    await trio.sleep(0.01)
            assert "delete" not in answers  # it waits for the POP in flight ...
            release.set()
        assert answers["delete"].code == ResponseCode.SUCCESS, answers["delete"].remark
        assert answers["pop"].code == ResponseCode.SUCCESS, answers["pop"].remark  # written before the delete
        # ... so what the POP wrote, and the consumer offset it committed after, went with the topic.
        assert _keys(node, topic="PopDel") == []
        assert [key for key in node.offsets.offsets_of_group("g") if key[0] == "PopDel"] == []


async def test_writes_planned_while_a_delete_group_removes_its_keys_are_left_out(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, "PopDelG", b"m0")
        ((_msg, handle),) = await _pop(client, addr, "gdel", "PopDelG")
        await _send(client, addr, "PopDelG", b"m1")
        # The first write of gdel's keys from now on is the delete's removal of them.
        blocked, release = _hold_first_pop_write(node, lambda key: key.split("\x01")[1] == "gdel")
        answers: dict[str, object] = {}

        async def delete() -> None:
            async with open_remoting_client() as own:
                answers["delete"] = await call(own, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "gdel"})

        async with trio.open_nursery() as inner:
            inner.start_soon(delete)
            await blocked.wait()
            # Both read a table that still holds gdel's checkpoint and pop offset, and would write after the
            # removal: a new checkpoint (the change), a pop offset and a checkpoint (the POP).
            r = await call(client, addr, RequestCode.CHANGE_MESSAGE_INVISIBLETIME,
                           {"consumer_group": "gdel", "topic": "PopDelG", "receipt_handle": handle,
                            "invisible_time_ms": 60_000})
            assert r.code == ResponseCode.SUCCESS, r.remark
            assert await _pop(client, addr, "gdel", "PopDelG") == []  # nothing recorded, nothing handed out
            release.set()
        assert answers["delete"].code == ResponseCode.SUCCESS, answers["delete"].remark
        assert _keys(node, group="gdel") == []
        assert node.offsets.offsets_of_group("gdel") == {}
        assert node.pop._forgetting == []
