"""RegistrationService against a fake pooled client: what a round that did not finish leaves behind."""

from __future__ import annotations

import trio
import trio.testing

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


class GatedNameServer:
    """A pooled client in front of an in-process name server: every REGISTER_BROKER waits on one gate (a
    reconnect), so the rounds waiting there are woken together, in whichever order trio runs them."""

    def __init__(self) -> None:
        from namesrv.processor import NamesrvProcessor
        from namesrv.route_info import RouteInfoManager
        self.table = RouteInfoManager()
        self.processor = NamesrvProcessor(self.table, clock_ms=lambda: 0)
        self.gate = trio.Event()
        self.arrived: list[str] = []

    async def invoke(self, addr, request, timeout_s=3.0):
        await self.gate.wait()
        self.arrived.append(request.ext["role"])
        return await self.processor.handle(request, "the-connection")

    def connections(self) -> dict:
        return {}


async def test_rounds_woken_in_reverse_order_leave_the_newest_snapshot_registered():
    # S1 (FOLLOWER, term 6) and S2 (LEADER, term 7) wait on one reconnect; trio wakes them in either order, and a
    # name server that took S1 last routed the group without its master until the next period (30 s).
    reversed_seen = 0
    for _ in range(24):  # trio reverses a batch half of the time: some rounds arrive S2 then S1
        client = GatedNameServer()
        snapshots = iter([
            RegistrationSnapshot("C", "broker-a", 1, "127.0.0.1:10911", "FOLLOWER", 6, 7, {}, 120_000),
            RegistrationSnapshot("C", "broker-a", 1, "127.0.0.1:10911", "LEADER", 7, 7, {}, 120_000)])
        service = RegistrationService(client, ("127.0.0.1:9876",), lambda: next(snapshots), interval_ms=30_000,
                                      timeout_ms=3_000)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.register_all)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(service.register_all)
            await trio.testing.wait_all_tasks_blocked()
            client.gate.set()
        reversed_seen += client.arrived == ["LEADER", "FOLLOWER"]
        (node,) = client.table.cluster_info(0).nodes["broker-a"]
        assert (node.role, node.term, node.is_master) == ("LEADER", 7, True), client.arrived
    assert reversed_seen > 0


class Recording:
    """A pooled client that answers every REGISTER_BROKER at once and records (name server, data_version); a name
    server in ``down`` refuses the connection."""

    def __init__(self, down=()) -> None:
        self.sent: list[tuple[str, int]] = []
        self.down = set(down)

    async def invoke(self, addr, request, timeout_s=3.0):
        from remoting.errors import ConnectError
        if addr in self.down:
            raise ConnectError(addr, "refused")
        self.sent.append((addr, request.ext["data_version"]))
        return make_response(request, ResponseCode.SUCCESS, ext={"master_addr": "127.0.0.1:10911"})

    def connections(self) -> dict:
        return {addr: None for addr, _ in self.sent}  # the pooled connections stay open


async def test_a_name_server_behind_is_registered_with_though_another_was_sent_the_new_table(autojump_clock):
    # registered_data_version was the last snapshot any round took: the reconnect task's round for a name server
    # that was down took the new table and vouched for the healthy one too, which kept the old table for a period.
    import dataclasses

    version = {"now": 1}
    client = Recording(down={"A"})
    service = RegistrationService(client, ("A", "B"),
                                  lambda: dataclasses.replace(_snapshot(), data_version=version["now"]),
                                  interval_ms=30_000, timeout_ms=3_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        await trio.sleep(0.1)
        assert client.sent == [("B", 1)] and service.registered_data_version == 1
        version["now"] = 2  # a topic change applied here
        await trio.sleep(1.5)  # the reconnect task tried A with the new table, B is still behind
        assert service.registered_data_version == 1
        service.trigger_behind(2)  # as the node's look does
        await trio.sleep(0.1)
        assert client.sent[-1] == ("B", 2) and service.registered_data_version == 2
        sent = len(client.sent)
        service.trigger_behind(2)  # nobody behind: no one is registered with again
        await trio.sleep(0.1)
        assert len(client.sent) == sent
        nursery.cancel_scope.cancel()


async def test_a_change_registered_after_the_service_stopped_waits_for_its_round_itself():
    # A change finishing at shutdown (a persisted config write, shielded) started its round in the stopped service's
    # closed nursery: RuntimeError, answered as a broker defect though the change was made.
    client = Recording()
    service = RegistrationService(client, ("A",), _snapshot, interval_ms=30_000, timeout_ms=3_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    await service.register_all()
    assert client.sent[-1] == ("A", 7)
