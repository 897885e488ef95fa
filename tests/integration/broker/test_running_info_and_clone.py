"""GET_CONSUMER_RUNNING_INFO (307) relayed by an in-process broker node to a member over the connection it heartbeats
on (its answer handed back, a member not online, one that does not answer, one that refuses), CLONE_GROUP_OFFSET
(314), and the subscription group config a heartbeat creates."""

from __future__ import annotations

import cbor2
import trio

from remoting.codec import make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_connection, open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, wait_leader


async def _node(nursery, tmp_path, **overrides) -> str:
    (config,) = broker_configs(tmp_path, None, **overrides)
    return await start_broker(nursery, config)


def _heartbeat(client_id: str, group: str) -> bytes:
    return cbor2.dumps({"client_id": client_id, "consumers": [{"consumer_group": group,
                                                               "subscriptions": [{"topic": "T"}]}]})


async def _groups(client, addr: str) -> dict:
    r = await call(client, addr, RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG)
    assert r.code == ResponseCode.SUCCESS, r.remark
    return cbor2.loads(r.body)["subscription_groups"]


class _Member:
    """A consumer's side of its connection: answers GET_CONSUMER_RUNNING_INFO as told (``mode``)."""

    def __init__(self) -> None:
        self.mode = "answer"
        self.asked: list[dict] = []

    async def handle(self, request, conn):
        if request.code != RequestCode.GET_CONSUMER_RUNNING_INFO:
            return None
        self.asked.append(dict(request.ext))
        if self.mode == "silent":
            await trio.sleep_forever()
        if self.mode == "refuse":
            return make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED, remark="no consumer here")
        return make_response(request, ResponseCode.SUCCESS,
                             body=cbor2.dumps({"client_id": request.ext["client_id"], "queues": []}))


async def test_running_info_is_relayed_to_the_member_and_its_absence_or_silence_is_named(nursery, tmp_path):
    addr = await _node(nursery, tmp_path)
    member = _Member()
    async with open_remoting_client() as admin, open_connection(addr, handler=member) as conn:
        await wait_leader(admin, addr)
        r = await conn.invoke(make_request(RequestCode.HEART_BEAT, body=_heartbeat("c1", "g")))
        assert r.code == ResponseCode.SUCCESS, r.remark
        ask = {"consumer_group": "g", "client_id": "c1"}

        r = await call(admin, addr, RequestCode.GET_CONSUMER_RUNNING_INFO, {**ask, "jstack": True})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert cbor2.loads(r.body) == {"client_id": "c1", "queues": []}  # the member's answer, as it came
        assert member.asked == [{"consumer_group": "g", "client_id": "c1", "jstack": True}]

        r = await call(admin, addr, RequestCode.GET_CONSUMER_RUNNING_INFO, {**ask, "client_id": "c2"})
        assert r.code == ResponseCode.CONSUMER_NOT_ONLINE
        assert "<c2> of group 'g' is not online" in r.remark and "members online here: c1" in r.remark
        r = await call(admin, addr, RequestCode.GET_CONSUMER_RUNNING_INFO, {**ask, "consumer_group": "other"})
        assert r.code == ResponseCode.CONSUMER_NOT_ONLINE and "members online here: none" in r.remark

        member.mode = "refuse"
        r = await call(admin, addr, RequestCode.GET_CONSUMER_RUNNING_INFO, ask)
        assert r.code == ResponseCode.SYSTEM_ERROR
        assert r.remark == "the consumer <c1> of group 'g' answered code 3: no consumer here"
        member.mode = "silent"
        r = await call(admin, addr, RequestCode.GET_CONSUMER_RUNNING_INFO, {**ask, "timeout_ms": 200})
        assert r.code == ResponseCode.SYSTEM_ERROR
        assert r.remark == "the consumer <c1> of group 'g' did not answer within 200 ms"

        for ext, field in (({**ask, "timeout_ms": 0}, "timeout_ms"), ({"consumer_group": "g"}, "client_id"),
                           ({**ask, "jstack": "yes"}, "jstack"), ({**ask, "consumer_group": "bad group"},
                                                                  "consumer_group")):
            r = await call(admin, addr, RequestCode.GET_CONSUMER_RUNNING_INFO, ext)
            assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == field, (ext, r.remark)
    # Its connection closed, the member is gone: not online, as for a member that never was.
    async with open_remoting_client() as admin:
        with trio.fail_after(10):  # liveness: the node sees the close
            while True:
                r = await call(admin, addr, RequestCode.GET_CONSUMER_RUNNING_INFO,
                               {"consumer_group": "g", "client_id": "c1"})
                if r.code == ResponseCode.CONSUMER_NOT_ONLINE:
                    break
                await trio.sleep(0.05)


async def test_clone_gives_the_destination_the_source_offsets_of_the_topic_only(nursery, tmp_path):
    addr = await _node(nursery, tmp_path, consumer_offset_flush_interval_ms=20)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for topic in ("T", "Other"):
            r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC,
                           {"topic": topic, "read_queue_nums": 4, "write_queue_nums": 4})
            assert r.code == ResponseCode.SUCCESS, r.remark
        commits = [("A", "T", 0, 7), ("A", "T", 2, 3), ("A", "Other", 0, 9), ("B", "T", 0, 1), ("B", "T", 1, 5)]
        for group, topic, queue_id, offset in commits:
            r = await call(client, addr, RequestCode.UPDATE_CONSUMER_OFFSET,
                           {"consumer_group": group, "topic": topic, "queue_id": queue_id, "commit_offset": offset})
            assert r.code == ResponseCode.SUCCESS, r.remark

        async def clone(src: str, dest: str, topic: str):
            return await call(client, addr, RequestCode.CLONE_GROUP_OFFSET,
                              {"src_group": src, "dest_group": dest, "topic": topic})

        r = await clone("A", "B", "T")
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert cbor2.loads(r.body) == {"offsets": [{"queue_id": 0, "offset": 7, "previous": 1},
                                                   {"queue_id": 2, "offset": 3, "previous": None}],
                                       "consumer_ids": []}

        async def offset_of(group: str, topic: str, queue_id: int) -> int | None:
            r = await call(client, addr, RequestCode.QUERY_CONSUMER_OFFSET,
                           {"consumer_group": group, "topic": topic, "queue_id": queue_id})
            return r.ext["offset"] if r.code == ResponseCode.SUCCESS else None

        # A's queues of T copied; B's own offset of a queue A never committed is kept; Other is not touched.
        assert [await offset_of("B", "T", q) for q in range(4)] == [7, 5, 3, None]
        assert await offset_of("B", "Other", 0) is None
        assert [await offset_of("A", "T", q) for q in range(4)] == [7, None, 3, None]

        r = await clone("C", "B", "T")
        assert r.code == ResponseCode.QUERY_NOT_FOUND
        assert r.remark == ("consumer group 'C' has no committed offset of topic 'T' on broker broker-a: nothing to "
                            "clone")
        r = await clone("A", "A", "T")
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "dest_group"
        r = await clone("A", "B", "NoSuch")
        assert r.code == ResponseCode.TOPIC_NOT_EXIST


async def test_a_heartbeat_creates_the_group_config_on_the_leader_and_is_never_refused_for_it(nursery, tmp_path):
    auto = await _node(nursery, tmp_path / "auto")
    manual = await _node(nursery, tmp_path / "manual", auto_create_subscription_group=False)
    async with open_remoting_client() as client:
        for addr in (auto, manual):
            await wait_leader(client, addr)
            assert await _groups(client, addr) == {}
        async with open_connection(auto) as c1, open_connection(manual) as c2:
            for conn in (c1, c2):
                r = await conn.invoke(make_request(RequestCode.HEART_BEAT, body=_heartbeat("c1", "hb-group")))
                assert r.code == ResponseCode.SUCCESS, r.remark
            with trio.fail_after(10):  # liveness: created in a task of the leader, replicated
                while "hb-group" not in (groups := await _groups(client, auto)):
                    await trio.sleep(0.02)
            assert groups["hb-group"]["consume_enable"] is True and groups["hb-group"]["retry_max_times"] == 16
            # auto_create_subscription_group false: the heartbeat is served, nothing is created.
            assert await _groups(client, manual) == {}
