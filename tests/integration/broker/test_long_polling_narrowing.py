"""A consumer group's subscription group narrowing against an in-process node: the group's held pull is refused or
held again, the other group's pull stays held, untouched, and each pull counts once in ``long_polling_held``
(broker/long_polling.py; the logic alone: tests/unit/broker/test_long_polling_groups.py)."""

from __future__ import annotations

import contextlib

import cbor2
import trio

from remoting.codes import RequestCode, ResponseCode
from remoting.message import iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, wait_leader


async def _held(client, addr: str) -> tuple[int, int, int]:
    info = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
    return (info["long_polling_held"], info["long_polling_resumed_by_arrival"],
            info["long_polling_resumed_by_timeout"])


async def _update(client, addr: str, **fields) -> None:
    r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=cbor2.dumps(fields))
    assert r.code == ResponseCode.SUCCESS, r.remark


@contextlib.asynccontextmanager
async def _holding_node(nursery, tmp_path, groups):
    """``(client, addr, held_since)`` of a node whose holds outlast the test, with no periodic check (only a
    narrowing or a message answers a held request), one message in queue 0 of T and a subscription group config
    for each of ``groups``; ``held_since()`` is ``_held``'s counts since then."""
    (config,) = broker_configs(tmp_path, None, long_polling_timeout_ms=3_600_000,
                               long_polling_check_interval_ms=60_000)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": "T", "queue_id": 0}, b"m0")
        assert r.code == ResponseCode.SUCCESS, r.remark
        for group in groups:
            await _update(client, addr, group_name=group)
        before = await _held(client, addr)

        async def held_since() -> tuple[int, ...]:
            return tuple(now - then for now, then in zip(await _held(client, addr), before))

        yield client, addr, held_since


async def test_a_narrowing_wakes_only_its_groups_pulls_and_a_pull_held_again_counts_once(nursery, tmp_path):
    async with _holding_node(nursery, tmp_path, ("narrowed", "other")) as (client, addr, held_since):
        answers: dict[str, object] = {}

        async def hold(group: str) -> None:
            answers[group] = await call(client, addr, RequestCode.PULL_MESSAGE,
                                        {"consumer_group": group, "topic": "T", "queue_id": 0, "queue_offset": 1,
                                         "max_msg_nums": 32, "sys_flag": 0x2, "suspend_timeout_millis": 3_600_000},
                                        timeout_s=60)

        async with trio.open_nursery() as waiting:
            waiting.start_soon(hold, "narrowed")
            waiting.start_soon(hold, "other")
            with trio.fail_after(10):  # liveness
                while (await held_since())[0] < 2:
                    await trio.sleep(0.02)
            # Broadcasting refused, the group clustering (no member says otherwise): its pull is woken, judged
            # again and held again for the time it has left; counted once all the same.
            await _update(client, addr, group_name="narrowed", consume_broadcast_enable=False)
            await trio.sleep(0.3)
            assert not answers
            assert await held_since() == (2, 0, 0)
            # Stopped: its pull is refused; the other group's stays held.
            await _update(client, addr, group_name="narrowed", consume_enable=False)
            with trio.fail_after(10):  # liveness
                while "narrowed" not in answers:
                    await trio.sleep(0.02)
            assert answers["narrowed"].code == ResponseCode.NO_PERMISSION
            await trio.sleep(0.3)
            assert "other" not in answers
            r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": "T", "queue_id": 0}, b"m1")
            assert r.code == ResponseCode.SUCCESS, r.remark
        assert answers["other"].code == ResponseCode.SUCCESS
        assert [m.body for m in iter_records(answers["other"].body)] == [b"m1"]
        assert await held_since() == (2, 1, 0)


async def test_a_held_pop_names_its_group_and_counts_once_whatever_queues_it_waits_on(nursery, tmp_path):
    async with _holding_node(nursery, tmp_path, ("popper", "other")) as (client, addr, held_since):
        answers: list = []

        async def pop() -> None:
            # Every queue of T (no queue_id), from the max offsets (init_mode 1): nothing to hand out, so it waits on
            # each of them.
            answers.append(await call(client, addr, RequestCode.POP_MESSAGE,
                                      {"consumer_group": "popper", "topic": "T", "max_msg_nums": 32,
                                       "invisible_time_ms": 60_000, "init_mode": 1, "poll_time_ms": 3_600_000},
                                      timeout_s=60))

        async with trio.open_nursery() as waiting:
            waiting.start_soon(pop)
            with trio.fail_after(10):  # liveness
                while (await held_since())[0] < 1:
                    await trio.sleep(0.02)
            await trio.sleep(0.3)
            assert await held_since() == (1, 0, 0)  # one POP request, however many queues it waits on
            # Another group's narrowing leaves it held, not re-run.
            await _update(client, addr, group_name="other", consume_enable=False)
            await trio.sleep(0.3)
            assert not answers and await held_since() == (1, 0, 0)
            r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": "T", "queue_id": 0}, b"m1")
            assert r.code == ResponseCode.SUCCESS, r.remark
        (answer,) = answers
        assert answer.code == ResponseCode.SUCCESS, answer.remark
        assert [m.body for m in iter_records(answer.body)] == [b"m1"]
        assert await held_since() == (1, 1, 0)
