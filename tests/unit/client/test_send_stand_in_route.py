"""A send made on a stand-in route (a topic no name server knows yet) tells the broker how many queues the producer
expects (``default_topic_queue_nums`` in the SEND ext, RocketMQ's defaultTopicQueueNums) and has the real route
fetched once answered; the usual send's ext stays the nine fields, encoded to cbor2's very bytes."""

from __future__ import annotations

import cbor2
import pytest
import trio

import client.producer
from client import Message, open_producer
from client.send_ext import SendExtEncoder, ext_fields
from remoting.codec import EncodedExt
from remoting.codes import RequestCode
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx


@pytest.mark.parametrize("queue_id, queue_nums", [(0, 1), (5, 8), (23, 24), (40, 1024)])
def test_the_stand_in_ext_is_the_map_with_default_topic_queue_nums_last(queue_id, queue_nums):
    encoder = SendExtEncoder("G")
    ext, uniq = encoder.single(Message("T", b"x", tags="a", keys="k"), 1_700_000_000_123)
    props = Message("T", b"x", tags="a", keys="k").wire_properties() | {"UNIQ_KEY": uniq}
    expected = ext_fields("G", "T", queue_id, 1_700_000_000_123, 0, props, False) | {
        "default_topic_queue_nums": queue_nums}
    got = ext.for_stand_in(queue_id, queue_nums)
    assert type(got) is EncodedExt and got.cbor == cbor2.dumps(expected)
    batch = encoder.batch("T", 1_700_000_000_123).for_stand_in(queue_id, queue_nums)
    assert batch.cbor == cbor2.dumps(ext_fields("G", "T", queue_id, 1_700_000_000_123, 0, {}, True) | {
        "default_topic_queue_nums": queue_nums})
    assert "default_topic_queue_nums" not in cbor2.loads(ext.for_queue(queue_id).cbor)


def test_the_stand_in_ext_of_a_topic_left_to_the_codec_is_the_map_too():
    ext, _ = SendExtEncoder("G").single(Message("T", b"x"), 1)
    ext._head = None  # as for a topic cbor2 cannot encode
    ext._fields = {"topic": "T", "queue_id": 0}
    assert ext.for_stand_in(3, 8) == {"topic": "T", "queue_id": 3, "default_topic_queue_nums": 8}


async def test_only_sends_on_a_stand_in_route_carry_the_queue_nums_and_the_first_answer_refreshes_it(
        monkeypatch, autojump_clock):
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1"])])
    fake.unknown_topics |= {"New", "Newer"}
    monkeypatch.setattr(client.producer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    asked: list[object] = []  # default_topic_queue_nums of each SEND_MESSAGE, None when absent
    answer = fake.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_MESSAGE:
            asked.append(request.ext.get("default_topic_queue_nums"))
            fake.unknown_topics.discard(request.ext["topic"])  # created by its first send, and registered
        return await answer(addr, request, timeout_s)

    fake.invoke = invoke
    async with open_producer(NAMESRV, default_topic_queue_nums=2) as p:
        await p.send(Message("New", b"1"))
        await p.send_oneway(Message("Newer", b"1"))  # a stand-in route too
        await trio.sleep(0.01)
        # The real route came at once, not at the periodic refresh 30 s on: the next send is an ordinary one.
        assert p.routes.cached_publish_info("New").stand_in is False
        await p.send(Message("New", b"2"))
        await p.send(Message("Old", b"1"))
    assert asked == [2, 2, None, None]
