"""An orderly queue given up (unsubscribed, closed) while its offset cannot be committed, against the in-memory fake
cluster on trio's MockClock: its lock is never given back ahead of its offset, and a release cut short by its
bound (twice the request timeout) leaves the lock to lapse on the broker instead of keeping it renewed for the
member's life (the queue was then nobody's: its new owner refused every half second, its messages never handled).
Also ``QueueLocks.abandon`` with a renewal on its way."""

from __future__ import annotations

import cbor2
import pytest
import trio

from client import open_push_consumer
from client.orderly import QueueLocks
from remoting.codes import RequestCode
from remoting.errors import ConnectError, RequestTimeoutError
from tests.unit.client.fake_cluster import NAMESRV, FakeRemoting, recording_fake, wait_until
from tests.unit.client.test_orderly_locks import A0, A1, FakeLockAPI
from tests.unit.client.test_runtime_subscribe import OPTS, Got, _record, _send

TIMEOUT_S = 3.0  # the consumers' request timeout (request_timeout_ms default): a release is bounded at twice that
OUTAGE_S = 15.0  # longer than that bound


class Outage:
    """Commits of the queues in ``queues`` fail while it lasts: ``refused`` at once (a broker group that cannot be
    reached) or ``stuck`` (answered by nobody, for longer than a release may take: a request redirected from node
    to node). Records every commit as (time, topic, queue_id, offset, went through) and every LOCK_BATCH_MQ and
    UNLOCK_BATCH_MQ as (time, "lock" | "unlock", [(topic, queue_id)])."""

    def __init__(self, fake: FakeRemoting, queues: set[tuple[str, int]], mode: str) -> None:
        self.queues = queues
        self.mode = mode
        self.started_at = self.ends_at = -1.0
        self.commits: list[tuple[float, str, int, int, bool]] = []
        self.locks: list[tuple[float, str, list[tuple[str, int]]]] = []
        answer = fake.invoke

        async def invoke(addr, request, timeout_s=3.0):
            code, ext, now = request.code, request.ext, trio.current_time()
            if code in (RequestCode.LOCK_BATCH_MQ, RequestCode.UNLOCK_BATCH_MQ):
                queues = sorted((q["topic"], q["queue_id"]) for q in cbor2.loads(request.body)["mq_set"])
                self.locks.append((now, "lock" if code == RequestCode.LOCK_BATCH_MQ else "unlock", queues))
            if code == RequestCode.UPDATE_CONSUMER_OFFSET and (ext["topic"], ext["queue_id"]) in self.queues \
                    and now < self.ends_at:
                self.commits.append((now, ext["topic"], ext["queue_id"], ext["commit_offset"], False))
                if self.mode == "refused":
                    raise ConnectError(addr, "connection refused")
                await trio.sleep(self.ends_at - now)
                raise RequestTimeoutError(addr, timeout_s, code)
            response = await answer(addr, request, timeout_s)
            if code == RequestCode.UPDATE_CONSUMER_OFFSET:
                self.commits.append((trio.current_time(), ext["topic"], ext["queue_id"], ext["commit_offset"], True))
            return response

        fake.invoke = invoke

    def start(self) -> None:
        self.started_at = trio.current_time()
        self.ends_at = self.started_at + OUTAGE_S

    def lock_requests_of(self, queue: tuple[str, int], since: float) -> list[float]:
        return [t for t, kind, queues in self.locks if kind == "lock" and queue in queues and t >= since]

    def unlocks_of(self, queue: tuple[str, int]) -> list[float]:
        return [t for t, kind, queues in self.locks if kind == "unlock" and queue in queues]

    def committed_at(self, queue: tuple[str, int], offset: int) -> list[float]:
        return [t for t, topic, q, o, ok in self.commits if ok and (topic, q) == queue and o == offset]


@pytest.fixture
def fake(monkeypatch):
    return _record(recording_fake(monkeypatch, 2))


@pytest.mark.parametrize("mode", ["refused", "stuck"])
async def test_a_queue_whose_commit_fails_past_the_release_bound_is_not_renewed_nor_given_back(fake, mode,
                                                                                                autojump_clock):
    """U is unsubscribed while its commits fail for longer than a release may take. Its queues stop being renewed
    once their releases end, and are not unlocked (their offsets never went through): the locks lapse on the
    broker. Before, a release cut short by its bound forgot nothing, and the member renewed U's locks every 20 s
    for its life, its last commit never sent. T's locks are renewed all along."""
    outage = Outage(fake, {("U", 0), ("U", 1)}, mode)
    got = Got()
    async with open_push_consumer(NAMESRV, subscriptions={"T": "*", "U": "*"}, handler=got, orderly=True,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", **OPTS) as consumer:
        await _send("U", ["u1", "u2", "u3"])
        await wait_until(lambda: len(got.messages) == 3)
        await trio.sleep(2)
        outage.start()
        unsubscribed_at = trio.current_time()
        await consumer.unsubscribe("U")
        await trio.sleep(80)  # four renewals
        released_by = unsubscribed_at + 2 * TIMEOUT_S
        for queue in (("U", 0), ("U", 1)):
            assert outage.lock_requests_of(queue, since=released_by) == [], f"{queue} still renewed"
            assert outage.unlocks_of(queue) == []
            assert queue in fake.holders  # the broker keeps the lock until it lapses there
        assert [mq.topic for mq in consumer._orderly.locks.held()] == ["T", "T"]
        assert len(outage.lock_requests_of(("T", 0), since=released_by)) >= 3
        # U's commits since the outage began never went through: the offsets were forgotten, not sent later.
        assert [c for c in outage.commits if c[1] == "U" and c[0] >= outage.started_at and c[4]] == []
    assert got.bodies("U") == ["u1", "u2", "u3"]


@pytest.mark.parametrize("mode", ["refused", "stuck"])
async def test_close_never_gives_a_lock_back_ahead_of_its_offset(fake, mode, autojump_clock):
    """Closing while queue 0's commits fail for longer than its release may take: queue 0 is never unlocked
    (before, close's last step gave back every lock still held, this one too, ahead of its offset, which the
    close committed after: a member starting between the two handled the messages again); queue 1, whose commit
    goes through, is committed and then unlocked."""
    outage = Outage(fake, {("T", 0)}, mode)
    got = Got()
    async with open_push_consumer(NAMESRV, topic="T", handler=got, orderly=True,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", **OPTS) as consumer:
        await _send("T", ["t1", "t2", "t3", "t4"])  # two on each queue
        await wait_until(lambda: len(got.messages) == 4)
        await trio.sleep(2)
        await _send("T", ["t5", "t6", "t7", "t8"])
        await wait_until(lambda: len(got.messages) == 8)
        outage.start()
        await consumer.close()
        await trio.sleep(OUTAGE_S)
    for queue in (("T", 0), ("T", 1)):
        committed = outage.committed_at(queue, 4)
        for unlocked_at in outage.unlocks_of(queue):
            assert committed and committed[0] <= unlocked_at, f"{queue} unlocked at {unlocked_at}, " \
                                                              f"its offset 4 committed at {committed}"
    assert outage.unlocks_of(("T", 1)) and ("T", 1) not in fake.holders
    assert outage.unlocks_of(("T", 0)) == [] and ("T", 0) in fake.holders  # it lapses on the broker


async def test_close_does_not_give_back_the_lock_of_a_handler_deaf_to_the_cancel(fake, autojump_clock):
    """A handler that shields itself outlasts close's wait for it: close's last step gave its queue's lock back
    while it still handled the message, ahead of the offset past it. Its own task commits and then unlocks, once
    the handler is done."""
    outage = Outage(fake, set(), "refused")
    ended: list[float] = []

    async def handler(msg) -> None:
        if msg.body == b"deaf":
            with trio.CancelScope(shield=True):
                await trio.sleep(20)
            ended.append(trio.current_time())

    async with open_push_consumer(NAMESRV, topic="T", handler=handler, orderly=True,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", **OPTS) as consumer:
        await _send("T", ["deaf"])  # queue 0
        await trio.sleep(1)
        await consumer.close()
    assert ended
    unlocked = outage.unlocks_of(("T", 0))
    assert unlocked and unlocked[0] >= ended[0], (unlocked, ended)
    assert outage.committed_at(("T", 0), 1) and outage.committed_at(("T", 0), 1)[0] <= unlocked[0]


def _locks(api: FakeLockAPI) -> QueueLocks:
    return QueueLocks(api, "me", renew_interval_ms=20_000, on_lost=lambda mq: None)  # type: ignore[arg-type]


async def test_an_abandoned_queue_is_not_trusted_again_by_a_renewal_on_its_way(autojump_clock):
    """A release cut short abandons its queue at once, a renewal of it perhaps on its way: the renewal's answer
    must not make it held again (it would be renewed for the member's life). The broker is not told: its lock
    lapses there. ``lock`` takes it again."""
    api = FakeLockAPI(delay_s=1.0)
    locks = _locks(api)
    await locks.lock([A0, A1])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(locks.renew)  # [A0, A1], answered 1 s from now
        await trio.sleep(0.1)
        locks.abandon(A0)
        assert locks.held() == [A1] and not locks.trusted(A0)
    assert locks.held() == [A1] and not locks.trusted(A0)
    assert api.holders == {A0: "me", A1: "me"}
    await locks.renew()
    assert api.requests[-1] == ("lock", [A1])
    assert await locks.lock([A0]) == {A0} and locks.trusted(A0)
