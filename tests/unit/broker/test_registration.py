"""RegistrationService against a fake pooled client: what a round that did not finish leaves behind."""

from __future__ import annotations

import trio

from broker.registration import RegistrationService, RegistrationSnapshot
from remoting.codec import make_response
from remoting.codes import ResponseCode


class HangingOnce:
    """A pooled client whose first REGISTER_BROKER never gets an answer; later ones succeed."""

    def __init__(self) -> None:
        self.calls = 0

    async def invoke(self, addr, request, timeout_s=3.0):
        self.calls += 1
        if self.calls == 1:
            await trio.sleep_forever()
        return make_response(request, ResponseCode.SUCCESS, ext={"master_addr": "127.0.0.1:10911"})

    def connections(self) -> dict:
        return {}


def _snapshot() -> RegistrationSnapshot:
    return RegistrationSnapshot("DefaultCluster", "broker-a", 0, "127.0.0.1:10911", "LEADER", 1, 7,
                                {"T": {"read_queue_nums": 4, "write_queue_nums": 4, "perm": 6}}, 120_000)


async def test_a_round_cancelled_midway_is_registered_again_by_the_reconnect_task():
    # A topic change registers inline, in its request's task; cancelled there (its client went away), the round
    # counted neither success nor failure, so nothing retried it and the name servers kept the old topic table
    # until the next periodic round (30 s).
    client = HangingOnce()
    service = RegistrationService(client, ("127.0.0.1:9876",), _snapshot, interval_ms=30_000, timeout_ms=3_000)
    with trio.move_on_after(0.1) as cancelled:
        await service.register_all()
    assert cancelled.cancelled_caught and not service.registered_once.is_set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service._serve_reconnect)
        with trio.fail_after(5):  # RECONNECT_INTERVAL_S is 1 s
            await service.registered_once.wait()
        nursery.cancel_scope.cancel()
    assert client.calls == 2 and service.statistics().successes == 1
