"""Each consumer's bound on what a compressed body inflates to (``max_inflated_body_size_bytes``, 4 MiB by default,
at most 256 MiB): a producer's zlib bomb, a few KiB stored, inflated to 256 MiB in every consumer before (32 such
a pull, before any flow control counted a body). A body that would inflate further is delivered as stored, its
compression flag kept, and logged at ERROR naming the message, the bound and the key; the consumer goes on.

Against the fake cluster, the records written into its log as a producer (this one, or a hostile one) stored them.
Each test fails on the code before the change (checked on a copy of the tree with the original client files): the
bomb came out inflated, the key was refused as unknown, and ``decompressed_body`` had no bound but 256 MiB."""

from __future__ import annotations

import logging
import tracemalloc
import zlib

import pytest
import trio

import client.lite_pull_consumer
import client.message
import client.pull_consumer
import client.push_consumer
from client import (ConfigError, LitePullConsumerConfig, MessageQueue, PullConsumerConfig, PushConsumerConfig,
                    open_lite_pull_consumer, open_pull_consumer, open_push_consumer)
from client.message import DEFAULT_MAX_INFLATED_BODY, MAX_INFLATED_BODY, decompressed_body
from remoting.message import COMPRESSED_FLAG, MessageInput, encode_record, record_size
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx

MiB = 1024 * 1024
MQ = MessageQueue("T", "broker-a", 0)
BOMB_BODY = bytes(8 * MiB)  # zeros: what a bomb is made of
BOMB = zlib.compress(BOMB_BODY, 9)
# A body a producer with the default max_message_size_bytes sends: text, compressed as the producer does.
NORMAL_BODY = b"".join(b"record %07d: the quick brown fox jumps over the lazy dog\n" % i for i in range(20_000))[:MiB]
NORMAL = zlib.compress(NORMAL_BODY, 5)
KEY = "max_inflated_body_size_bytes"


def test_the_bomb_is_a_few_kib_stored_and_the_normal_body_a_real_one():
    assert len(BOMB) < 16 * 1024 and len(BOMB_BODY) == 2 * DEFAULT_MAX_INFLATED_BODY
    assert len(NORMAL_BODY) == MiB and len(NORMAL) < MiB // 4


@pytest.fixture
def cluster(monkeypatch):
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"])])
    for mod in (client.pull_consumer, client.push_consumer, client.lite_pull_consumer):
        monkeypatch.setattr(mod, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


def _store(cluster: FakeRemoting, *records: tuple[bytes, int]) -> None:
    """Append ``(body, sys_flag)`` records to queue T:0 of broker-a, as a producer's sends would be stored."""
    group = cluster.groups[0]
    log = group.logs[("T", 0)]
    for body, sys_flag in records:
        offset = len(log)
        m = MessageInput("T", 0, body, {"UNIQ_KEY": f"U{offset}"}, sys_flag=sys_flag)
        buf = bytearray(record_size(len(body), 1, 64))
        size = encode_record(buf, 0, m, queue_offset=offset, phy_offset=group.phy, store_timestamp=1,
                             store_host=("127.0.0.1", 1))
        group.phy += size
        log.append(bytes(buf[:size]))


def _store_bomb_between_two(cluster: FakeRemoting) -> None:
    _store(cluster, (NORMAL, COMPRESSED_FLAG), (BOMB, COMPRESSED_FLAG), (b"after", 0))


def _cap_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and r.name == "client.message"]


def _check_bomb_logged(caplog, cap: int) -> None:
    (error,) = _cap_errors(caplog)
    assert "topic=T broker_name=broker-a queue_id=0 queue_offset=1" in error
    assert f"body_size={len(BOMB)}" in error
    assert f"inflates past {cap} bytes" in error and KEY in error


# -- decompressed_body ----------------------------------------------------------------------------------------------

def test_a_bomb_is_returned_as_stored_and_logged_under_the_default_bound(caplog):
    with caplog.at_level(logging.ERROR, logger="client.message"):
        got = decompressed_body(BOMB, COMPRESSED_FLAG, "T", "broker-a", 0, 1, DEFAULT_MAX_INFLATED_BODY, KEY)
    assert got == (BOMB, COMPRESSED_FLAG)
    _check_bomb_logged(caplog, DEFAULT_MAX_INFLATED_BODY)
    assert f"up to {MAX_INFLATED_BODY}" in _cap_errors(caplog)[0]


def test_a_bomb_under_a_raised_bound_inflates_and_a_normal_body_under_the_default(caplog):
    with caplog.at_level(logging.ERROR, logger="client.message"):
        assert decompressed_body(BOMB, COMPRESSED_FLAG, "T", "b", 0, 1, 16 * MiB, KEY) == (BOMB_BODY, 0)
        assert decompressed_body(NORMAL, COMPRESSED_FLAG, "T", "b", 0, 0, DEFAULT_MAX_INFLATED_BODY, KEY) == (
            NORMAL_BODY, 0)
    assert not _cap_errors(caplog)


def test_a_body_of_exactly_the_bound_inflates_and_one_byte_more_does_not(caplog):
    for size in (2, 1000, 4096, 65_537):
        for body in (bytes(size), NORMAL_BODY[:size]):
            stored = zlib.compress(body)
            assert decompressed_body(stored, COMPRESSED_FLAG, "T", "b", 0, 0, size, KEY) == (body, 0)
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="client.message"):
                got = decompressed_body(stored, COMPRESSED_FLAG, "T", "b", 0, 0, size - 1, KEY)
            assert got == (stored, COMPRESSED_FLAG)
            assert f"inflates past {size - 1} bytes" in _cap_errors(caplog)[0]


def test_inflating_a_bomb_stops_at_the_bound():
    # 64 MiB of zeros, 64 KiB stored: what the refusal takes is the bound, a constant (zlib's last step, 1 MiB,
    # held twice) and the stored body, never the 64 MiB. (Inflated in one call bounded by max_size, zlib held the
    # bound twice: 16 MiB here.)
    bomb = zlib.compress(bytes(64 * MiB), 9)
    for cap in (1, 100_000, MiB - 1, MiB, 8 * MiB):
        tracemalloc.start()
        try:
            got = decompressed_body(bomb, COMPRESSED_FLAG, "T", "b", 0, 0, cap, KEY)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert got == (bomb, COMPRESSED_FLAG)
        assert peak < cap + MiB + 4 * len(bomb) + 64 * 1024, (cap, peak)


def test_the_bound_is_checked():
    for bad in (0, -1, MAX_INFLATED_BODY + 1, True, 4.0, None):
        with pytest.raises(ValueError, match="max_size must be an integer within 1..268435456"):
            decompressed_body(BOMB, COMPRESSED_FLAG, "T", "b", 0, 0, bad, KEY)


def test_at_the_largest_bound_the_log_does_not_say_to_raise_it(caplog, monkeypatch):
    # Nothing to raise it to: the most a producer may send, as admin lookups and transaction checks say (the
    # largest bound made small here, so as not to inflate 256 MiB).
    monkeypatch.setattr(client.message, "MAX_INFLATED_BODY", 1024)
    bomb = zlib.compress(bytes(4096))
    with caplog.at_level(logging.ERROR, logger="client.message"):
        assert decompressed_body(bomb, COMPRESSED_FLAG, "T", "b", 0, 0, 1024, KEY) == (bomb, COMPRESSED_FLAG)
        assert decompressed_body(bomb, COMPRESSED_FLAG, "T", "b", 0, 0, 512, KEY) == (bomb, COMPRESSED_FLAG)
    largest, lower = _cap_errors(caplog)
    assert "inflates past 1024 bytes, the most a producer may send" in largest and KEY not in largest
    assert f"inflates past 512 bytes, this client's {KEY} (raise it, up to 1024, to take such bodies)" in lower


# -- the consumers' config ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config_class", [PushConsumerConfig, LitePullConsumerConfig, PullConsumerConfig])
def test_every_consumer_has_the_key_bounded_with_the_producers_default(config_class):
    assert getattr(config_class(), KEY) == DEFAULT_MAX_INFLATED_BODY == 4 * MiB
    assert getattr(config_class(**{KEY: MAX_INFLATED_BODY}), KEY) == MAX_INFLATED_BODY
    for bad in (0, -5, MAX_INFLATED_BODY + 1, "4MiB", True):
        with pytest.raises(ConfigError, match=KEY):
            config_class(**{KEY: bad})


async def test_the_pull_consumer_delivers_the_bomb_as_stored_and_goes_on(cluster, caplog):
    _store_bomb_between_two(cluster)
    with caplog.at_level(logging.ERROR, logger="client.message"):
        async with open_pull_consumer(NAMESRV, consumer_group="g") as c:
            got = (await c.pull(MQ, 0, 32)).messages
    assert [(m.queue_offset, m.body, m.sys_flag) for m in got] == [
        (0, NORMAL_BODY, 0), (1, BOMB, COMPRESSED_FLAG), (2, b"after", 0)]
    _check_bomb_logged(caplog, DEFAULT_MAX_INFLATED_BODY)


async def test_the_pull_consumer_with_a_raised_bound_inflates_the_bomb(cluster, caplog):
    _store_bomb_between_two(cluster)
    with caplog.at_level(logging.ERROR, logger="client.message"):
        async with open_pull_consumer(NAMESRV, consumer_group="g", **{KEY: 8 * MiB}) as c:
            got = (await c.pull(MQ, 0, 32)).messages
    assert [(m.body, m.sys_flag) for m in got] == [(NORMAL_BODY, 0), (BOMB_BODY, 0), (b"after", 0)]
    assert not _cap_errors(caplog)


async def _push_consume(n: int, **options) -> list[tuple[int, bytes, int]]:
    got: list[tuple[int, bytes, int]] = []
    done = trio.Event()

    async def handler(msg):
        got.append((msg.queue_offset, msg.body, msg.sys_flag))
        if len(got) == n:
            done.set()

    async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group="g",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=50,
                                  broker_suspend_max_time_ms=50, **options):
        with trio.fail_after(10):
            await done.wait()
    return sorted(got)


async def test_the_push_consumer_delivers_the_bomb_as_stored_under_its_default(cluster, caplog):
    _store_bomb_between_two(cluster)
    with caplog.at_level(logging.ERROR, logger="client.message"):
        got = await _push_consume(3)
    assert got == [(0, NORMAL_BODY, 0), (1, BOMB, COMPRESSED_FLAG), (2, b"after", 0)]
    _check_bomb_logged(caplog, DEFAULT_MAX_INFLATED_BODY)


async def test_the_push_consumer_honours_its_config(cluster, caplog):
    _store_bomb_between_two(cluster)
    with caplog.at_level(logging.ERROR, logger="client.message"):
        got = await _push_consume(3, **{KEY: 16 * MiB})
    assert got == [(0, NORMAL_BODY, 0), (1, BOMB_BODY, 0), (2, b"after", 0)]
    assert not _cap_errors(caplog)


async def test_a_push_consumer_with_a_lower_bound_keeps_even_a_normal_body_compressed(cluster, caplog):
    _store_bomb_between_two(cluster)
    with caplog.at_level(logging.ERROR, logger="client.message"):
        got = await _push_consume(3, **{KEY: MiB - 1})
    assert got == [(0, NORMAL, COMPRESSED_FLAG), (1, BOMB, COMPRESSED_FLAG), (2, b"after", 0)]
    errors = _cap_errors(caplog)
    assert len(errors) == 2 and all(f"inflates past {MiB - 1} bytes, this client's {KEY}" in e for e in errors)


async def _lite_poll(n: int, **options) -> list[tuple[int, bytes, int]]:
    got: list[tuple[int, bytes, int]] = []
    async with open_lite_pull_consumer(NAMESRV, consumer_group="g", consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                       broker_suspend_max_time_ms=50, **options) as consumer:
        consumer.assign([MQ])
        with trio.fail_after(10):
            while len(got) < n:
                got += [(m.queue_offset, m.body, m.sys_flag) for m in await consumer.poll(timeout_s=1)]
    return got


async def test_the_lite_pull_consumer_delivers_the_bomb_as_stored_under_its_default(cluster, caplog):
    _store_bomb_between_two(cluster)
    with caplog.at_level(logging.ERROR, logger="client.message"):
        got = await _lite_poll(3)
    assert got == [(0, NORMAL_BODY, 0), (1, BOMB, COMPRESSED_FLAG), (2, b"after", 0)]
    _check_bomb_logged(caplog, DEFAULT_MAX_INFLATED_BODY)


async def test_the_lite_pull_consumer_honours_its_config(cluster, caplog):
    _store_bomb_between_two(cluster)
    with caplog.at_level(logging.ERROR, logger="client.message"):
        got = await _lite_poll(3, **{KEY: 16 * MiB})
    assert got == [(0, NORMAL_BODY, 0), (1, BOMB_BODY, 0), (2, b"after", 0)]
    assert not _cap_errors(caplog)


async def test_a_transaction_check_inflates_up_to_the_producers_max_message_size(monkeypatch, caplog):
    """A broker's CHECK_TRANSACTION_STATE carries the half message: its body went to the listener's ``check``
    inflated up to 256 MiB, ``transaction_check_concurrency`` (16) at a time. Now up to the producer's own
    ``max_message_size_bytes`` (no half of its group is larger unless they allow more): a bomb past it reaches
    ``check`` as stored, logged naming that key; a body within it inflated as before."""
    import client.producer
    from client import TransactionState, open_producer
    from remoting.codec import make_request
    from remoting.codes import RequestCode

    fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"])])
    monkeypatch.setattr(client.producer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    caplog.set_level(logging.ERROR, logger="client.message")
    checked = []

    class Listener:
        async def execute(self, msg, arg):
            return TransactionState.COMMIT

        async def check(self, msg):
            checked.append((msg.queue_offset, msg.body, msg.sys_flag))
            return TransactionState.COMMIT

    def check_request(body: bytes, offset: int):
        props = {"TRAN_MSG": "true", "PGROUP": "g", "UNIQ_KEY": f"U-{offset}", "REAL_TOPIC": "T", "REAL_QID": "0"}
        half = MessageInput("RMQ_SYS_TRANS_HALF_TOPIC", 0, body, props, sys_flag=0x4 | COMPRESSED_FLAG)
        buf = bytearray(record_size(len(body), len(half.topic), 200))
        size = encode_record(buf, 0, half, queue_offset=offset, phy_offset=4096 * (offset + 1), store_timestamp=1,
                             store_host=("127.0.0.1", 10911))
        return make_request(RequestCode.CHECK_TRANSACTION_STATE, {
            "producer_group": "g", "broker_name": "broker-a", "tran_state_table_offset": offset}, bytes(buf[:size]))

    async with open_producer(NAMESRV, producer_group="g", transaction_listener=Listener(),
                             max_message_size_bytes=2 * MiB) as producer:
        producer._on_check(check_request(BOMB, 0))
        producer._on_check(check_request(NORMAL, 1))
        with trio.fail_after(10):
            while len(checked) < 2:
                await trio.sleep(0.01)
    # Answered side by side, in any order.
    assert sorted(checked) == [(0, BOMB, 0x4 | COMPRESSED_FLAG), (1, NORMAL_BODY, 0x4)]
    (error,) = [r.getMessage() for r in caplog.records]
    assert "inflates past 2097152 bytes, this client's max_message_size_bytes" in error
