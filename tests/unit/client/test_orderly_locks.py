"""An orderly member's queue locks (client.orderly.QueueLocks) against a stand-in for LOCK_BATCH_MQ and
UNLOCK_BATCH_MQ, on trio's MockClock: how long a lock is trusted, what a refused renewal does, and that a renewal
cannot take back a queue being unlocked."""

from __future__ import annotations

import trio
import trio.testing

from client.message import MessageQueue
from client.orderly import QueueLocks
from remoting.errors import ConnectError

A0, A1, B0 = MessageQueue("T", "broker-a", 0), MessageQueue("T", "broker-a", 1), MessageQueue("T", "broker-b", 0)


class FakeLockAPI:
    """Holders per queue on the brokers; requests take ``delay_s``; a broker in ``down`` cannot be reached."""

    def __init__(self, life_ms: int = 60_000, delay_s: float = 0.0) -> None:
        self.holders: dict[MessageQueue, str] = {}
        self.life_ms = life_ms
        self.delay_s = delay_s
        self.down: set[str] = set()
        self.requests: list[tuple[str, list[MessageQueue]]] = []

    async def lock_batch(self, client_id: str, mqs):
        self.requests.append(("lock", list(mqs)))
        await trio.sleep(self.delay_s)
        if mqs[0].broker_name in self.down:
            raise ConnectError(mqs[0].broker_name, "down")
        for mq in mqs:
            self.holders.setdefault(mq, client_id)
        return {mq for mq in mqs if self.holders[mq] == client_id}, self.life_ms

    async def unlock_batch(self, client_id: str, mqs):
        # Takes effect at once, a lock only once its delay has passed: as a lock request that was redirected to
        # the leader (NOT_LEADER) arrives after an unlock sent later.
        self.requests.append(("unlock", list(mqs)))
        for mq in mqs:
            if self.holders.get(mq) == client_id:
                del self.holders[mq]
        await trio.sleep(self.delay_s)


def _locks(api: FakeLockAPI, lost: list[MessageQueue], interval_ms: int = 20_000) -> QueueLocks:
    return QueueLocks(api, "me", renew_interval_ms=interval_ms, on_lost=lost.append)  # type: ignore[arg-type]


async def test_a_lock_is_trusted_for_half_its_life_from_when_it_was_asked_for(autojump_clock):
    api = FakeLockAPI(life_ms=10_000, delay_s=1.0)
    api.holders[A1] = "other"
    locks = _locks(api, [])
    assert await locks.lock([A0, A1, B0]) == {A0, B0}
    assert [broker[0].broker_name for _, broker in api.requests] == ["broker-a", "broker-b"]  # one per group
    assert locks.held() == [A0, B0] and not locks.trusted(A1)
    # A0 was asked for at 0 s and answered at 1 s: trusted until 5 s, B0 (asked at 1 s) until 6 s. Now is 2 s.
    await trio.sleep(2.9)
    assert locks.trusted(A0) and locks.trusted(B0)
    await trio.sleep(0.2)
    assert not locks.trusted(A0) and locks.trusted(B0)
    # The renewal period follows the shortest life a broker gave: a third of it.
    assert locks.renew_interval_s() == 10 / 3


async def test_a_refused_renewal_reports_the_queue_lost_and_an_unreachable_group_keeps_its_trust(autojump_clock):
    api = FakeLockAPI()
    lost: list[MessageQueue] = []
    locks = _locks(api, lost)
    await locks.lock([A0, A1, B0])
    api.holders[A1] = "other"  # its lock lapsed on the broker and another member took it
    api.down.add("broker-b")
    await trio.sleep(10)
    await locks.renew()
    assert lost == [A1] and locks.held() == [A0, B0]
    assert locks.trusted(A0)  # renewed at 10 s: until 40 s
    await trio.sleep(20.5)
    assert locks.trusted(A0) and not locks.trusted(B0)  # B0 not renewed since 0 s: trusted until 30 s


async def test_an_unlock_waits_for_a_renewal_in_flight_and_a_renewal_waits_for_an_unlock(autojump_clock):
    api = FakeLockAPI(delay_s=1.0)
    locks = _locks(api, [])
    await locks.lock([A0, A1])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(locks.renew)  # [A0, A1], arriving at the broker 1 s from now
        await trio.sleep(0.1)
        nursery.start_soon(locks.unlock, [A0])  # would arrive first: the renewal would take A0 back
    assert api.holders == {A1: "me"} and locks.held() == [A1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(locks.unlock, [A1])
        await trio.sleep(0.1)
        nursery.start_soon(locks.renew)  # starts while the unlock is in flight: renews nothing
    assert api.holders == {} and locks.held() == []
    assert api.requests[-1] == ("unlock", [A1])


async def test_an_unlock_that_cannot_reach_the_broker_still_stops_renewing(autojump_clock):
    api = FakeLockAPI()
    locks = _locks(api, [])
    await locks.lock([B0])
    api.down.add("broker-b")

    async def refused(client_id, mqs):
        raise ConnectError("broker-b", "down")

    api.unlock_batch = refused  # type: ignore[method-assign]
    await locks.unlock([B0])
    assert locks.held() == [] and not locks.trusted(B0)
    api.requests.clear()
    await locks.renew()
    assert api.requests == []


async def test_forgotten_queues_are_not_renewed(autojump_clock):
    api = FakeLockAPI()
    locks = _locks(api, [])
    await locks.lock([A0, A1])
    await locks.forget(A0)
    await locks.renew()
    assert api.requests[-1] == ("lock", [A1])


async def test_a_queue_taken_away_twice_is_given_back_once():
    """A renewal finds a queue's lock lost while a rebalance that also takes the queue away waits on the network:
    both take it away. The second found nothing to pop and raised KeyError, which ended the consumer."""
    from types import SimpleNamespace

    from client.orderly import OrderlyService
    from client.push_consumer import ProcessQueue, PushConsumerConfig

    async def handler(msg) -> None:
        pass

    pq = ProcessQueue(A0)
    consumer = SimpleNamespace(_pqs={A0: pq}, _handler=handler, _instance=SimpleNamespace(timeout_s=3.0),
                               trigger_rebalance=lambda: None)
    service = OrderlyService(consumer, PushConsumerConfig(orderly=True), FakeLockAPI(), "me", None)  # type: ignore
    service.take_away(A0)
    service.take_away(A0)
    assert consumer._pqs == {} and service.releasing == {A0: pq} and pq.dropped
