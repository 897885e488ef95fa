"""Batch consumption in the concurrent handler form (``batch_handler=``, ``consume_message_batch_max_size``,
RocketMQ's consumeMessageBatchMaxSize), against the in-memory fake cluster on trio's MockClock: a call gets at most
the size, of one queue only, in offset order, and takes one slot; a failed batch sends back each of its messages
(all, or those after ``ReconsumeLater.ack_index``), and those the broker refused, or a broadcasting consumer's, are
retried here together; the committed offset never passes a batch whose call has not finished; the consume timeout
cancels the batch call; a plain ``handler`` never gets a sequence, whatever the config says. Nothing here measures
wall-clock time: handlers wait on events, and tests wait for counts."""

from __future__ import annotations

import logging

import pytest
import trio

from client import ConsumeStatus, MessageExt, ReconsumeLater, open_push_consumer
from client.errors import ConfigError
from client.push_consumer import PushConsumerConfig
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from tests.unit.client.fake_cluster import NAMESRV, recording_fake, send_numbered, wait_until

GROUP = "g"
FIRST = dict(consumer_group=GROUP, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
             persist_consumer_offset_interval_ms=100, rebalance_interval_ms=1_000)


def _with_send_backs(fake):
    """Record every send-back's commit-log offset and delay level; refuse the next ``fake.refuse_send_backs``."""
    fake.send_backs = []
    fake.refuse_send_backs = 0
    answer = fake.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.CONSUMER_SEND_MSG_BACK:
            fake.send_backs.append((request.ext["offset"], request.ext["delay_level"]))
            if fake.refuse_send_backs:
                fake.refuse_send_backs -= 1
                return make_response(request, ResponseCode.SYSTEM_ERROR, "store unavailable")
            return make_response(request, ResponseCode.SUCCESS)
        return await answer(addr, request, timeout_s)

    fake.invoke = invoke
    return fake


@pytest.fixture
def one_queue(monkeypatch):
    return _with_send_backs(recording_fake(monkeypatch, 1))


@pytest.fixture
def two_queues(monkeypatch):
    return _with_send_backs(recording_fake(monkeypatch, 2))


def _bodies(batch) -> list[bytes]:
    return [m.body for m in batch]


class Batches:
    """A batch handler recording each call's messages (body, reconsume_times); a call holds while any of its
    messages is in ``gated``, until ``open_all``; ``answers`` maps a first body to what that call says (an
    exception is raised) on its first attempt."""

    def __init__(self, gated: set[bytes] = frozenset(), answers: dict | None = None) -> None:
        self.gated = set(gated)
        self.gate = trio.Event()
        self.answers = answers or {}
        self.calls: list[list[tuple[bytes, int]]] = []
        self.queues: list[set[int]] = []
        self.offsets: list[list[int]] = []
        self.finished: list[bytes] = []
        self.cancelled: list[bytes] = []
        self.running = 0

    def open_all(self) -> None:
        self.gated = set()
        self.gate.set()

    async def __call__(self, batch) -> object:
        self.calls.append([(m.body, m.reconsume_times) for m in batch])
        self.queues.append({m.queue_id for m in batch})
        self.offsets.append([m.queue_offset for m in batch])
        self.running += 1
        try:
            if self.gated & set(_bodies(batch)):
                await self.gate.wait()
            else:
                await trio.sleep(0)
        except trio.Cancelled:
            self.cancelled.extend(_bodies(batch))
            raise
        finally:
            self.running -= 1
        answer = self.answers.get(batch[0].body) if batch[0].reconsume_times == 0 else None
        if isinstance(answer, BaseException):
            raise answer
        if answer is None:
            self.finished.extend(_bodies(batch))
        return answer


def test_consume_message_batch_max_size_defaults_to_rocketmqs_1_and_is_bounded_as_there():
    assert PushConsumerConfig().consume_message_batch_max_size == 1  # consumeMessageBatchMaxSize
    for value, problem in ((0, ">= 1"), (1025, "<= 1024"), (-3, ">= 1")):
        with pytest.raises(ConfigError, match=f"^consume_message_batch_max_size must be {problem}, got {value}$"):
            PushConsumerConfig(consume_message_batch_max_size=value)
    assert PushConsumerConfig(consume_message_batch_max_size=1024).consume_message_batch_max_size == 1024
    # Orderly consumption stays one message at a time: refused, not ignored.
    with pytest.raises(ConfigError, match="^consume_message_batch_max_size is for the concurrent handler form "
                                          r"\(batch_handler\); orderly=True handles one message at a time, got 8$"):
        PushConsumerConfig(consume_message_batch_max_size=8, orderly=True)
    assert PushConsumerConfig(orderly=True).consume_message_batch_max_size == 1


def test_reconsume_later_checks_its_ack_index():
    assert ReconsumeLater().ack_index is None
    assert ReconsumeLater(ack_index=-1).ack_index == -1 and ReconsumeLater(ack_index=7).ack_index == 7
    for bad in (-2, True, "1", 1.0):
        with pytest.raises(ValueError, match=r"^ReconsumeLater.ack_index must be None or an int >= -1 \(the index"):
            ReconsumeLater(ack_index=bad)


async def test_bad_handler_and_batch_size_combinations_are_refused_before_anything_is_opened(one_queue):
    async def batch_handler(batch) -> None:
        pass

    async def handler(msg) -> None:
        pass

    def two_args(batch, extra) -> None:
        pass

    async def async_two_args(batch, extra) -> None:
        pass

    cases = [
        # A handler written for one message is never handed a sequence because a config key says so.
        (dict(handler=handler, consume_message_batch_max_size=4), ConfigError,
         "^consume_message_batch_max_size 4 needs batch_handler= "),
        (dict(consume_message_batch_max_size=4), ConfigError, "^consume_message_batch_max_size 4 needs batch_handler="),
        (dict(handler=handler, batch_handler=batch_handler), ValueError, "^give handler= .* or batch_handler= .*"),
        (dict(batch_handler=batch_handler, orderly=True), ValueError,
         "^orderly=True handles one message at a time: it takes handler=, not batch_handler=$"),
        (dict(batch_handler=two_args), TypeError, "^batch_handler must be an async function taking a sequence of "),
        (dict(batch_handler=async_two_args), TypeError, "^batch_handler must take the sequence of messages as its "),
    ]
    for options, error, match in cases:
        with pytest.raises(error, match=match):
            async with open_push_consumer(NAMESRV, topic="T", **FIRST, **options):
                pytest.fail("opened")
    assert one_queue.codes == []  # refused before a request was sent


async def test_a_plain_handler_still_gets_one_message_and_a_batch_handler_of_size_1_a_sequence_of_one(
        one_queue, autojump_clock):
    singles: list[object] = []

    async def handler(msg) -> None:
        singles.append(msg)

    batches = Batches()
    await send_numbered(5)
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, **FIRST) as consumer:
        await wait_until(lambda: len(singles) == 5)
        assert consumer.config.consume_message_batch_max_size == 1
    assert all(type(m) is MessageExt for m in singles)
    async with open_push_consumer(NAMESRV, topic="T", batch_handler=batches, **(FIRST | {"consumer_group": "g1"})):
        await wait_until(lambda: len(batches.finished) == 5)
    assert batches.calls == [[(b"%d" % i, 0)] for i in range(5)]


async def test_batches_never_exceed_the_size_never_mix_queues_and_come_in_offset_order(two_queues, autojump_clock):
    """25 messages in each of two queues, batches of at most 4: each call gets one queue's messages, contiguous and
    in offset order (RocketMQ's consumeMessageBatchMaxSize pages of a pull), every message once; the statistics
    count messages, not calls."""
    batches = Batches()
    await send_numbered(25, queue_id=0, prefix=b"a")
    await send_numbered(25, queue_id=1, prefix=b"b")
    async with open_push_consumer(NAMESRV, topic="T", batch_handler=batches, consume_message_batch_max_size=4,
                                  **FIRST) as consumer:
        await wait_until(lambda: len(batches.finished) == 50)
        await wait_until(lambda: consumer.statistics().cached == 0)
        stats = consumer.statistics()
        assert (stats.delivered, stats.handling) == (50, 0)
    assert all(len(offsets) <= 4 for offsets in batches.offsets)
    assert all(len(queues) == 1 for queues in batches.queues)
    assert all(offsets == list(range(offsets[0], offsets[0] + len(offsets))) for offsets in batches.offsets)
    for queue_id, prefix in ((0, b"a"), (1, b"b")):
        calls = [call for call, queues in zip(batches.calls, batches.queues) if queues == {queue_id}]
        assert [body for call in calls for body, _ in call] == [prefix + b"%d" % i for i in range(25)]
        assert [len(call) for call in calls] == [4] * 6 + [1]  # one pull brought all 25: full pages, then the rest
    assert two_queues.groups[0].offsets[(GROUP, "T", 0)] == two_queues.groups[0].offsets[(GROUP, "T", 1)] == 25


async def test_a_batch_takes_one_slot_and_the_calls_in_flight_count_as_handling(one_queue, autojump_clock):
    batches = Batches(gated={b"%d" % i for i in range(12)})
    await send_numbered(12)
    async with open_push_consumer(NAMESRV, topic="T", batch_handler=batches, consume_message_batch_max_size=3,
                                  max_concurrent_handlers=2, **FIRST) as consumer:
        await wait_until(lambda: batches.running == 2)
        await trio.sleep(5)
        assert batches.running == 2 and consumer.statistics().handling == 2
        assert batches.offsets == [[0, 1, 2], [3, 4, 5]]
        assert consumer.statistics().cached == 12
        batches.open_all()
        await wait_until(lambda: len(batches.finished) == 12)
        assert consumer.statistics().delivered == 12
    assert batches.offsets == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


async def test_a_failed_batch_sends_back_each_message_or_those_after_ack_index(one_queue, autojump_clock, caplog):
    """RECONSUME_LATER, an unknown answer, an exception: every message of the batch is sent back, each on its own
    (RocketMQ's processConsumeResult, ackIndex -1). ReconsumeLater(ack_index=1): the first two were consumed, only
    the rest go back, with its delay level. The queue moves on past all of them."""
    caplog.set_level(logging.ERROR, logger="client")
    batches = Batches(answers={b"0": ConsumeStatus.RECONSUME_LATER, b"3": "RECONSUME_LATER",
                               b"6": RuntimeError("boom"), b"9": ReconsumeLater(ack_index=1, delay_level=5),
                               b"c": ReconsumeLater(ack_index=7)})
    await send_numbered(12)
    await send_numbered(3, prefix=b"c")  # "c0".."c2": an ack_index past the batch's end marks it all consumed
    phy: dict[bytes, int] = {}

    async def handler(batch):
        phy.update((m.body, m.phy_offset) for m in batch)
        if batch[0].body == b"c0":
            raise batches.answers[b"c"]
        return await batches(batch)

    async with open_push_consumer(NAMESRV, topic="T", batch_handler=handler, consume_message_batch_max_size=3,
                                  max_concurrent_handlers=1, **FIRST) as consumer:
        await wait_until(lambda: one_queue.groups[0].offsets.get((GROUP, "T", 0)) == 15)
        assert consumer.statistics().delivered == 15
    assert batches.offsets == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    by_phy = {offset: body for body, offset in phy.items()}
    assert [(by_phy[offset], level) for offset, level in one_queue.send_backs] == [
        (b"0", 0), (b"1", 0), (b"2", 0), (b"3", 0), (b"4", 0), (b"5", 0), (b"6", 0), (b"7", 0), (b"8", 0),
        (b"11", 5)]
    errors = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("handler returned a str, not None or a ConsumeStatus") for m in errors), errors
    assert any(m.startswith("batch handler failed mq=") and "offsets=6..8 messages=3" in m for m in errors), errors


async def test_failed_messages_whose_send_back_fails_are_retried_here_together(one_queue, autojump_clock):
    """Clustering: of a failed batch (0, 1, 2), the broker refuses 0's and 2's send-backs: those two are called
    again together after reconsume_delay_ms, reconsume_times counted up (RocketMQ resubmits the msgBackFailed list),
    while 1 is done; the queue starts no other call meanwhile; once they succeed, it moves on."""
    batches = Batches(answers={b"0": ReconsumeLater()})
    refused = iter((True, False, True))
    answer = one_queue.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.CONSUMER_SEND_MSG_BACK:
            one_queue.refuse_send_backs = int(next(refused))
        return await answer(addr, request, timeout_s)

    one_queue.invoke = invoke
    await send_numbered(5)
    async with open_push_consumer(NAMESRV, topic="T", batch_handler=batches, consume_message_batch_max_size=3,
                                  reconsume_delay_ms=10_000, **FIRST):
        await wait_until(lambda: len(batches.calls) == 1)
        await trio.sleep(5)
        assert batches.calls == [[(b"0", 0), (b"1", 0), (b"2", 0)]]  # the retry holds the queue
        await wait_until(lambda: len(batches.finished) == 4)
        await wait_until(lambda: one_queue.groups[0].offsets.get((GROUP, "T", 0)) == 5)
    assert batches.calls == [[(b"0", 0), (b"1", 0), (b"2", 0)], [(b"0", 1), (b"2", 1)], [(b"3", 0), (b"4", 0)]]
    assert len(one_queue.send_backs) == 3


async def test_broadcasting_retries_a_failed_batchs_tail_here_up_to_max_reconsume_times(one_queue, autojump_clock,
                                                                                        tmp_path, caplog):
    """Nothing is sent back (broadcasting): the messages after ack_index are called again together, reconsume_times
    counted up, up to max_reconsume_times retries, then logged and skipped; the queue moves on."""
    caplog.set_level(logging.ERROR, logger="client.consume_service")
    calls: list[list[tuple[bytes, int]]] = []

    async def handler(batch):
        calls.append([(m.body, m.reconsume_times) for m in batch])
        if batch[0].body == b"0":
            raise ReconsumeLater(ack_index=0)
        if batch[0].body == b"1":
            return ConsumeStatus.RECONSUME_LATER
        return None

    await send_numbered(5)
    async with open_push_consumer(NAMESRV, topic="T", batch_handler=handler, consume_message_batch_max_size=3,
                                  consumer_group=GROUP, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                  message_model="BROADCASTING", offset_store_dir=str(tmp_path), max_reconsume_times=2,
                                  reconsume_delay_ms=100) as consumer:
        await wait_until(lambda: [(b"3", 0), (b"4", 0)] in calls)
        await wait_until(lambda: consumer.statistics().cached == 0)
        assert consumer.statistics().delivered == 5
    assert calls == [[(b"0", 0), (b"1", 0), (b"2", 0)], [(b"1", 1), (b"2", 1)], [(b"1", 2), (b"2", 2)],
                     [(b"3", 0), (b"4", 0)]]
    skipped = [r.getMessage() for r in caplog.records if "skipped after 3 failed attempts" in r.getMessage()]
    assert len(skipped) == 2 and one_queue.send_backs == []


async def test_the_committed_offset_never_passes_a_batch_whose_call_has_not_finished(one_queue, autojump_clock):
    """The batch (3, 4, 5) is held while the batches before and after it finish: every commit stops at 3, however
    often offsets are persisted; once it finishes, the offset moves to the end."""
    batches = Batches(gated={b"4"})
    await send_numbered(10)
    async with open_push_consumer(NAMESRV, topic="T", batch_handler=batches, consume_message_batch_max_size=3,
                                  **FIRST) as consumer:
        await wait_until(lambda: len(batches.finished) == 7)
        assert batches.running == 1 and consumer.statistics().handling == 1
        await trio.sleep(5)  # fifty persist intervals
        assert one_queue.commits and max(offset for _, offset in one_queue.commits) == 3
        assert one_queue.groups[0].offsets[(GROUP, "T", 0)] == 3
        assert consumer.statistics().cached == 3
        held = len(one_queue.commits)
        batches.open_all()
        await wait_until(lambda: one_queue.groups[0].offsets[(GROUP, "T", 0)] == 10)
    assert all(offset <= 3 for _, offset in one_queue.commits[:held])


async def test_a_batch_call_past_consume_timeout_is_cancelled_and_each_message_sent_back(one_queue, autojump_clock,
                                                                                        caplog):
    """consume_timeout_min bounds the batch call: cancelled after a minute, its messages all count as failed (each
    sent back), the batches after it went on meanwhile, and the offset waited for it."""
    caplog.set_level(logging.WARNING, logger="client.consume_service")
    batches = Batches(gated={b"1"})
    await send_numbered(6)
    async with open_push_consumer(NAMESRV, topic="T", batch_handler=batches, consume_message_batch_max_size=2,
                                  consume_timeout_min=1, **FIRST):
        await wait_until(lambda: len(batches.finished) == 4)
        started = trio.current_time()
        assert one_queue.groups[0].offsets.get((GROUP, "T", 0), 0) == 0
        await wait_until(lambda: one_queue.groups[0].offsets[(GROUP, "T", 0)] == 6, timeout_s=120)
        assert trio.current_time() - started >= 55
    assert batches.cancelled == [b"0", b"1"] and len(one_queue.send_backs) == 2
    (warning,) = [r.getMessage() for r in caplog.records if "consume_timeout_min" in r.getMessage()]
    assert warning.startswith("batch handler cancelled after consume_timeout_min=1, its messages count as failed")
    assert "queue_id=0 offsets=0..1 messages=2" in warning
