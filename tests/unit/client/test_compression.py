"""Body compression, RocketMQ's way (client/producer.py ``_single_body``, client/message.py ``decompressed_body``):
a single send's body of at least ``compress_msg_body_over_howmuch`` bytes travels and is stored zlib-compressed with
sys_flag bit 0x1, batches never; every path that turns records into ``MessageExt`` inflates it. Against the fake
cluster, whose broker here keeps a send's sys_flag as broker/processor/send_message.py does.

Each test fails without the change (checked with the original client files copied back): the producer sent every
body as it was with sys_flag 0, and the consumers handed out stored bodies unchanged."""

from __future__ import annotations

import logging
import os
import zlib

import pytest
import trio

import client.admin
import client.producer
import client.pull_consumer
import client.push_consumer
from client import (ConfigError, Message, MessageQueue, MessageTooLargeError, SendStatus, TransactionState,
                    open_producer, open_pull_consumer, open_push_consumer)
from client.pull_consumer import to_message_ext
from client.transaction import read_check_request
from crc32c import crc32c
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.message import (COMPRESSED_FLAG, MessageInput, create_msg_id, decode_batch, decode_record,
                              encode_record, record_size)
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx

TEXT = b"".join(b"line %05d: the quick brown fox jumps over the lazy dog\n" % i for i in range(1200))[:64 * 1024]
MQ = MessageQueue("T", "broker-a", 0)


class FlagKeepingRemoting(FakeRemoting):
    """The fake broker, storing a single send's sys_flag (its SEND_MESSAGE drops it) as the real broker does, and
    ending transactions; every send request is kept for the tests to read what went on the wire."""

    def __init__(self, groups: list[FakeGroup]) -> None:
        super().__init__(groups)
        self.sends: list = []

    async def invoke(self, addr, request, timeout_s=3.0):
        if request.code in (RequestCode.SEND_MESSAGE, RequestCode.SEND_BATCH_MESSAGE):
            self.sends.append(request)
        if request.code == RequestCode.END_TRANSACTION:
            return make_response(request, ResponseCode.SUCCESS)
        if request.code == RequestCode.SEND_MESSAGE and addr in self.by_addr:
            g = self.by_addr[addr]
            ext = request.ext
            m = MessageInput(ext["topic"], ext["queue_id"], request.body, ext["properties"],
                             sys_flag=ext.get("sys_flag", 0), born_timestamp=ext["born_timestamp"])
            off = g.append(ext["topic"], ext["queue_id"], m)
            self.wake.set()
            self.wake = trio.Event()
            return make_response(request, ResponseCode.SUCCESS,
                                 ext={"msg_id": create_msg_id(("127.0.0.1", 1), off), "queue_id": ext["queue_id"],
                                      "queue_offset": off})
        return await super().invoke(addr, request, timeout_s)

    def stored(self, queue_id: int = 0):
        return [decode_record(r) for r in self.groups[0].logs[("T", queue_id)]]


@pytest.fixture
def cluster(monkeypatch):
    fake = FlagKeepingRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"])])
    for mod in (client.producer, client.pull_consumer, client.push_consumer, client.admin):
        monkeypatch.setattr(mod, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


def _record(body: bytes, sys_flag: int, queue_offset: int = 0) -> bytes:
    m = MessageInput("T", 0, body, {"UNIQ_KEY": f"U{queue_offset}", "TAGS": "A"}, sys_flag=sys_flag)
    buf = bytearray(record_size(len(body), 1, 64))
    return bytes(buf[:encode_record(buf, 0, m, queue_offset=queue_offset, phy_offset=queue_offset * 1000,
                                    store_timestamp=1, store_host=("127.0.0.1", 1))])


async def test_a_large_single_send_is_stored_compressed_and_pulled_as_sent(cluster):
    message = Message("T", TEXT, tags="TagA", keys=["k1", "k2"], properties={"p": "v"})
    async with open_producer(NAMESRV) as p:
        result = await p.send(message, queue=MQ)
    assert result.send_status is SendStatus.SEND_OK
    assert message.body == TEXT  # the caller's message is left as it was
    (request,) = cluster.sends
    assert request.ext["sys_flag"] == COMPRESSED_FLAG and zlib.decompress(request.body) == TEXT
    (view,) = cluster.stored()
    assert view.sys_flag == COMPRESSED_FLAG and len(view.body) < len(TEXT) // 4
    assert view.body_crc == crc32c(view.body)  # the CRC is of the stored (compressed) body, as RocketMQ's
    assert view.tags == "TagA" and view.keys == ["k1", "k2"] and view.properties["p"] == "v"
    async with open_pull_consumer(NAMESRV, consumer_group="g") as c:
        (got,) = (await c.pull(MQ, 0, 32, expression="TagA")).messages
    assert got.body == TEXT and got.sys_flag == 0  # inflated, the compressed bit cleared
    assert (got.tags, got.keys, got.properties["p"], got.msg_id) == ("TagA", ["k1", "k2"], "v", result.msg_id)


async def test_the_threshold_is_rocketmqs_at_least_and_a_body_that_does_not_shrink_goes_as_it_is(cluster):
    async with open_producer(NAMESRV) as p:
        for body in (TEXT[:1024], TEXT[:4095], TEXT[:4096], os.urandom(64 * 1024)):
            await p.send(Message("T", body), queue=MQ)
    async with open_producer(NAMESRV, compress_msg_body_over_howmuch=0, compress_level=9) as p:
        await p.send(Message("T", b"ab" * 20), queue=MQ)
    async with open_producer(NAMESRV, compress_msg_body_over_howmuch=2 ** 31 - 1) as p:
        await p.send(Message("T", TEXT), queue=MQ)
    assert [(v.sys_flag, len(v.body) < 1000) for v in cluster.stored()] == [
        (0, False), (0, False), (COMPRESSED_FLAG, True), (0, False), (COMPRESSED_FLAG, True), (0, False)]
    async with open_pull_consumer(NAMESRV, consumer_group="g") as c:
        bodies = [m.body for m in (await c.pull(MQ, 0, 32)).messages]
    assert bodies[:3] == [TEXT[:1024], TEXT[:4095], TEXT[:4096]] and bodies[4:] == [b"ab" * 20, TEXT]


async def test_batches_and_auto_batched_sends_are_not_compressed(cluster):
    async with open_producer(NAMESRV) as p:
        await p.send_batch([Message("T", TEXT), Message("T", TEXT[:8192])], queue=MQ)
        await p.send(Message("T", TEXT[:8192]), queue=MQ)  # the same body alone is
    async with open_producer(NAMESRV, auto_batch=True) as p:
        await p.send(Message("T", TEXT[:8192]), queue=MQ)  # under auto_batch_max_bytes: it goes in a batch
    single = [r for r in cluster.sends if r.code == RequestCode.SEND_MESSAGE]
    assert [r.ext["sys_flag"] for r in single] == [COMPRESSED_FLAG]
    batches = [r for r in cluster.sends if r.code == RequestCode.SEND_BATCH_MESSAGE]
    assert len(batches) == 2 and len(cluster.sends) == 3
    entries = [m for r in batches for m in decode_batch(r.body)[1]]
    assert [(m.sys_flag, m.body) for m in entries] == [(0, TEXT), (0, TEXT[:8192]), (0, TEXT[:8192])]


async def test_oneway_and_half_messages_are_compressed_too(cluster):
    executed = []

    class Listener:
        async def execute(self, msg, arg):
            executed.append(msg.body)
            return TransactionState.COMMIT

        async def check(self, msg):
            return TransactionState.COMMIT

    async with open_producer(NAMESRV, transaction_listener=Listener()) as p:
        await p.send_oneway(Message("T", TEXT), queue=MQ)
        await p.send_in_transaction(Message("T", TEXT))
    oneway, half = cluster.sends
    assert oneway.ext["sys_flag"] == COMPRESSED_FLAG and zlib.decompress(oneway.body) == TEXT
    assert half.ext["sys_flag"] == 0x4 | COMPRESSED_FLAG and zlib.decompress(half.body) == TEXT
    assert executed == [TEXT]  # execute sees the message as given


async def test_max_message_size_limits_the_body_given_before_compression(cluster):
    # RocketMQ's Validators.checkMessage: the limit is on the body given, so no consumer inflates one past it.
    async with open_producer(NAMESRV, max_message_size_bytes=16 * 1024) as p:
        assert (await p.send(Message("T", TEXT[:16 * 1024]), queue=MQ)).send_status is SendStatus.SEND_OK
        for send in (p.send, p.send_oneway):
            with pytest.raises(MessageTooLargeError, match=r"message body of 65536 bytes exceeds max_message_size"):
                await send(Message("T", TEXT), queue=MQ)  # 64 KiB of text would be a few KiB compressed
        with pytest.raises(MessageTooLargeError, match="65536 bytes exceeds"):
            await p.send_batch([Message("T", TEXT)], queue=MQ)
    assert len(cluster.sends) == 1 and cluster.sends[0].ext["sys_flag"] == COMPRESSED_FLAG


async def test_a_push_consumer_gets_the_body_as_sent(cluster):
    got = []
    done = trio.Event()

    async def handler(msg):
        got.append((msg.body, msg.sys_flag))
        if len(got) == 2:
            done.set()

    # As a producer (this one, or RocketMQ's) stored it: compressed, with the flag.
    cluster.groups[0].logs[("T", 0)].append(_record(zlib.compress(TEXT), COMPRESSED_FLAG, 0))
    async with open_producer(NAMESRV) as p:
        await p.send(Message("T", b"small"), queue=MQ)
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group="g",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=50,
                                  broker_suspend_max_time_ms=50):
        with trio.fail_after(10):
            await done.wait()
    assert got == [(TEXT, 0), (b"small", 0)]


async def test_a_body_that_cannot_be_decompressed_is_delivered_as_stored_and_logged(cluster, caplog):
    log = cluster.groups[0].logs[("T", 0)]
    log += [_record(b"not zlib at all", COMPRESSED_FLAG, 0), _record(zlib.compress(b"fine"), 0x301, 1),
            _record(zlib.compress(b"lz4?"), 0x101, 2), _record(b"plain", 0, 3)]
    with caplog.at_level(logging.ERROR, logger="client.message"):
        async with open_pull_consumer(NAMESRV, consumer_group="g") as c:
            res = await c.pull(MQ, 0, 32)
    # RocketMQ 5 writes zlib as type 3 (0x300): read too, and its bits cleared with the flag.
    assert [(m.body, m.sys_flag) for m in res.messages] == [
        (b"not zlib at all", COMPRESSED_FLAG), (b"fine", 0), (zlib.compress(b"lz4?"), 0x101), (b"plain", 0)]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert "cannot be decompressed" in errors[0] and "topic=T broker_name=broker-a queue_id=0 queue_offset=0" \
        in errors[0]
    assert "queue_offset=2" in errors[1] and "compression type 1 is not zlib" in errors[1]


async def test_a_body_that_would_inflate_past_the_consumers_bound_is_delivered_as_stored(cluster, caplog):
    # A few KiB of zeros can inflate to gigabytes: a consumer stops at its max_inflated_body_size_bytes
    # (tests/unit/client/test_inflate_cap.py has the rest).
    bomb = zlib.compress(bytes(4096))
    cluster.groups[0].logs[("T", 0)].append(_record(bomb, COMPRESSED_FLAG, 0))
    with caplog.at_level(logging.ERROR, logger="client.message"):
        async with open_pull_consumer(NAMESRV, consumer_group="g", max_inflated_body_size_bytes=1024) as c:
            [m] = (await c.pull(MQ, 0, 32)).messages
    assert (m.body, m.sys_flag) == (bomb, COMPRESSED_FLAG)
    assert any("inflates past 1024 bytes" in r.getMessage() for r in caplog.records)


def test_admin_lookups_and_transaction_checks_inflate_too():
    view = decode_record(_record(zlib.compress(TEXT), COMPRESSED_FLAG, 5))
    msg = to_message_ext(view, "broker-a")  # what query_message and view_message return
    assert (msg.body, msg.sys_flag, msg.tags, msg.queue_offset) == (TEXT, 0, "A", 5)
    props = {"TRAN_MSG": "true", "PGROUP": "g", "UNIQ_KEY": "U-7", "REAL_TOPIC": "Orders", "REAL_QID": "2"}
    half = MessageInput("RMQ_SYS_TRANS_HALF_TOPIC", 0, zlib.compress(TEXT), props, sys_flag=0x4 | COMPRESSED_FLAG)
    buf = bytearray(record_size(len(half.body), len(half.topic), 200))
    size = encode_record(buf, 0, half, queue_offset=3, phy_offset=4096, store_timestamp=1,
                         store_host=("127.0.0.1", 10911))
    _, _, _, checked = read_check_request({"producer_group": "g", "broker_name": "broker-a",
                                           "tran_state_table_offset": 3}, bytes(buf[:size]))
    assert (checked.body, checked.sys_flag) == (TEXT, 0x4)


def test_the_config_keys_are_bounded_and_the_flag_is_rocketmqs():
    assert (client.producer.ProducerConfig().compress_msg_body_over_howmuch,
            client.producer.ProducerConfig().compress_level) == (4096, 5)
    for bad in ({"compress_level": 10}, {"compress_level": -1}, {"compress_msg_body_over_howmuch": -1},
                {"compress_msg_body_over_howmuch": 2 ** 31}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            client.producer.ProducerConfig(**bad)
    # RocketMQ's MessageSysFlag.COMPRESSED_FLAG; _to_messages tests it as the literal 1 on its hot path.
    assert COMPRESSED_FLAG == 1
