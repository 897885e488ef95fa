"""The topic and subscription group tables past what one frame carries: GET_ALL_TOPIC_CONFIG (21) and
GET_ALL_SUBSCRIPTIONGROUP_CONFIG (201) naming one entry (ext ``topic`` / ``group_name``) or paging (ext ``after``,
``limit``, answer ``next_after``), the refusal an older client's unpaged request gets when the table does not fit,
and the admin client (``subscription_groups``, ``update_topic_perm``) on such a table.

The broker's ``max_frame_size`` is set near its least (100,000 bytes) so a few hundred long names are more than one
answer holds: the same as ~23,600 groups with 255-character names at the default 16 MiB, where every listing (and
``raftmq admin sub-group-list -g GROUP``, ``update-topic-perm``) failed for good."""

from __future__ import annotations

import cbor2
import trio

from client import open_admin
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, start_namesrv, wait_leader

MAX_FRAME_SIZE = 100_000
# The least max_frame_size takes with these (broker/config.py: a message, a pull, a catch-up chunk, and slack).
SMALL_FRAMES = {"max_frame_size": MAX_FRAME_SIZE, "store.max_message_size": 1024, "max_transfer_bytes": 1024,
                "dledger.catch_up_chunk_bytes": 4096}
GROUPS = 300  # ~710 bytes each: ~213 KB of table
TOPICS = 350  # ~363 bytes each: ~127 KB of table (a registration carries ~200 bytes a topic: ~70 KB, it fits)


def _group(i: int) -> str:
    return f"G{i:04d}" + "y" * 250  # 255 characters, the longest group name


def _topic(i: int) -> str:
    return f"T{i:04d}" + "x" * 122  # 127 characters, the longest topic name


async def _node(nursery, tmp_path) -> tuple[str, str]:
    namesrv = await start_namesrv(nursery)
    (config,) = broker_configs(tmp_path, namesrv, **SMALL_FRAMES)
    return namesrv, await start_broker(nursery, config)


async def _create_all(client, addr: str, code: int, exts: list[dict]) -> None:
    limiter = trio.Semaphore(32)

    async def one(ext: dict) -> None:
        async with limiter:
            r = await call(client, addr, code, ext, timeout_s=20)
            assert r.code == ResponseCode.SUCCESS, r.remark

    async with trio.open_nursery() as nursery:
        for ext in exts:
            nursery.start_soon(one, ext)


async def _pages(client, addr: str, code: int, key: str, **ext) -> tuple[dict, int]:
    """The whole table, paged with ``ext``; (the table, how many pages)."""
    table: dict = {}
    after = ""
    pages = 0
    while True:
        r = await call(client, addr, code, {"after": after, **ext})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert len(r.body) < MAX_FRAME_SIZE
        answer = cbor2.loads(r.body)
        page = answer[key]
        assert list(page) == sorted(page) and all(name > after for name in page)
        assert not table.keys() & page.keys()
        table.update(page)
        pages += 1
        if answer["next_after"] is None:
            return table, pages
        assert answer["next_after"] == max(page)
        after = answer["next_after"]


async def test_subscription_groups_past_one_frame_are_paged_and_one_is_looked_up_alone(nursery, tmp_path):
    namesrv, addr = await _node(nursery, tmp_path)
    code = RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _create_all(client, addr, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP,
                          [{"group_name": _group(i), "retry_max_times": i % 17} for i in range(GROUPS)])
        ours = {_group(i) for i in range(GROUPS)}

        # An older client's request (no paging field): refused naming the field it lacks, not a frame the broker
        # cannot send (that was a SYSTEM_ERROR and an ERROR logged per call).
        r = await call(client, addr, code)
        assert r.code == ResponseCode.INVALID_REQUEST, r.remark
        assert r.ext["field"] == "limit" and "'after' and 'limit'" in r.remark
        assert f"max_frame_size {MAX_FRAME_SIZE}" in r.remark

        # One group, named.
        r = await call(client, addr, code, {"group_name": _group(123)})
        assert r.code == ResponseCode.SUCCESS, r.remark
        answer = cbor2.loads(r.body)
        assert list(answer["subscription_groups"]) == [_group(123)] and answer["next_after"] is None
        assert answer["subscription_groups"][_group(123)]["retry_max_times"] == 123 % 17
        r = await call(client, addr, code, {"group_name": "nobody"})
        assert r.code == ResponseCode.SUCCESS and cbor2.loads(r.body)["subscription_groups"] == {}

        # Pages of a count, and pages the frame ends (no limit): each the next names in order, all of them once.
        by_count, pages = await _pages(client, addr, code, "subscription_groups", limit=50)
        assert by_count.keys() >= ours and pages == (len(by_count) + 49) // 50  # no empty last page
        by_size, pages = await _pages(client, addr, code, "subscription_groups")
        assert by_size == by_count and pages >= 3
        assert by_size[_group(7)]["retry_max_times"] == 7

        # Bad paging fields, named.
        for ext, field in (({"limit": 0}, "limit"), ({"after": 5}, "after"), ({"limit": "10"}, "limit"),
                           ({"group_name": _group(1), "limit": 10}, "group_name"), ({"group_name": ""}, "group_name")):
            r = await call(client, addr, code, ext)
            assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == field, (ext, r.remark)

    async with open_admin(namesrv) as admin:
        with trio.fail_after(10):  # liveness: the group registered
            while not (await admin.cluster_info()).broker_addrs:
                await trio.sleep(0.05)
        listed = await admin.subscription_groups()
        assert {g.group_name for g in listed} >= ours and len(listed) == len(by_size)
        (one,) = await admin.subscription_groups(_group(42))
        assert (one.group_name, one.broker_name, one.retry_max_times) == (_group(42), "broker-a", 42 % 17)
        assert await admin.subscription_groups("nobody") == []
    # A client whose frames are smaller than the broker's asks pages it can take.
    async with open_admin(namesrv, max_frame_size_bytes=48 * 1024) as admin:
        assert [g.group_name for g in await admin.subscription_groups()] == sorted(by_size)


async def test_topics_past_one_frame_are_paged_and_update_topic_perm_reads_its_topic_alone(nursery, tmp_path):
    namesrv, addr = await _node(nursery, tmp_path)
    code = RequestCode.GET_ALL_TOPIC_CONFIG
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _create_all(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC,
                          [{"topic": _topic(i), "read_queue_nums": 2, "write_queue_nums": 1} for i in range(TOPICS)])
        r = await call(client, addr, code)
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "limit", r.remark
        r = await call(client, addr, code, {"topic": _topic(9)})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert list(cbor2.loads(r.body)["topic_configs"]) == [_topic(9)]
        table, pages = await _pages(client, addr, code, "topic_configs")
        assert table.keys() >= {_topic(i) for i in range(TOPICS)} and pages >= 2

    async with open_admin(namesrv) as admin:
        with trio.fail_after(10):  # liveness: the topic routed
            while True:
                try:
                    await admin.get_route(_topic(200))
                    break
                except Exception:
                    await trio.sleep(0.05)
        (update,) = await admin.update_topic_perm(_topic(200), 4)
        assert (update.broker_name, update.previous_perm, update.perm) == ("broker-a", 6, 4)
        assert (update.read_queue_nums, update.write_queue_nums) == (2, 1)
    async with open_remoting_client() as client:
        r = await call(client, addr, code, {"topic": _topic(200)})
        assert cbor2.loads(r.body)["topic_configs"][_topic(200)]["perm"] == 4


async def test_a_table_that_fits_is_answered_whole_to_an_unpaged_request(nursery, tmp_path):
    _namesrv, addr = await _node(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _create_all(client, addr, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP,
                          [{"group_name": f"g{i}"} for i in range(5)])
        r = await call(client, addr, RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG)
        assert r.code == ResponseCode.SUCCESS, r.remark
        answer = cbor2.loads(r.body)
        assert set(answer["subscription_groups"]) >= {f"g{i}" for i in range(5)} and answer["next_after"] is None
