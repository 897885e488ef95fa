"""Orderly consumers' queue locks across a lost and regained leadership, on a ``BrokerNode`` whose Raft group is a
stand-in: the test moves the term and applies what another leader replicated, at the moments it chooses.

What these pin: a change of the lock table that waited (for the lock mutex, or for an offset flush) while the node
lost its leadership and won it back never replicates what it decided on the past term's table. Another leader may
have given the queue to another client in between, and deleting that client's key would let a third one take the
queue while the second still consumes it: two orderly consumers on one queue.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import trio
import trio.testing

from broker.node import LOCK_TABLE, OFFSET_TABLE, BrokerNode, _offset_key
from broker.offset_manager import ConsumerOffsetTable
from broker.rebalance_lock import RebalanceLockManager
from tests.unit.broker.stand_in import MetadataReads

GROUP, TOPIC = "orderly_group", "OrderT"
QUEUE = (TOPIC, 0)
KEY = _offset_key(GROUP, TOPIC, 0)
LIFE_MS = 1_000


class StandInGroup(MetadataReads):
    """The Raft group as the node's lock code sees it: a term, leadership, and the replicated tables. A put to a
    table in ``held`` waits for that event first (a commit that takes a while)."""

    def __init__(self) -> None:
        self.term = 5
        self.is_leader = True
        self.is_ready_leader = True
        self.leader_id: str | None = "n1"
        self.tables: dict[str, dict[str, Any]] = {}
        self.held: dict[str, trio.Event] = {}
        self.puts: list[tuple[str, dict[str, Any]]] = []

    def member_address(self, member_id: str) -> Any:
        return None

    async def wait_ready_leader(self) -> None:
        pass

    async def put_metadata(self, table: str, items: dict[str, Any], *, timeout_s: float) -> int:
        if table in self.held:
            await self.held[table].wait()
        self.apply(table, items)
        self.puts.append((table, dict(items)))
        return 1

    def apply(self, table: str, items: dict[str, Any]) -> None:
        rows = self.tables.setdefault(table, {})
        for key, value in items.items():
            if value is None:
                rows.pop(key, None)
            else:
                rows[key] = value

    def another_leader_gives_the_queue_to(self, client_id: str) -> None:
        """Term 6 led by another member, which gave the queue to ``client_id``; then this node wins term 7."""
        self.is_leader = self.is_ready_leader = False
        self.term, self.leader_id = 6, "n2"
        self.apply(LOCK_TABLE, {KEY: client_id})
        self.term, self.leader_id = 7, "n1"
        self.is_leader = self.is_ready_leader = True


def stand_in_node(clock: trio.testing.MockClock) -> BrokerNode:
    """A ``BrokerNode`` with only what its queue-lock methods use, the lock table on the mock clock."""
    node = object.__new__(BrokerNode)
    node.group = StandInGroup()
    node.config = SimpleNamespace(broker_name="broker-a", send_timeout_ms=3_000)
    node.broker_addr, node.broker_id = "127.0.0.1:10911", 1
    node.queue_locks = RebalanceLockManager(LIFE_MS, clock=clock.current_time)
    node._queue_locks_term = None
    node._queue_lock_mutex = trio.Lock()
    node.offsets = ConsumerOffsetTable()
    node._offset_lock = trio.Lock()
    return node


async def test_a_prune_that_waited_out_two_elections_leaves_the_new_holders_lock(mock_clock):
    node = stand_in_node(mock_clock)
    assert await node.lock_queues(GROUP, "client-a", [QUEUE]) == [QUEUE]
    mock_clock.jump(2 * LIFE_MS / 1000)  # client-a's lock lapsed on this (term 5) table
    prune_done = trio.Event()

    async def prune() -> None:
        await node.prune_queue_locks()
        prune_done.set()

    async with trio.open_nursery() as nursery:
        async with node._queue_lock_mutex:  # a lock request being served: the prune waits for it
            nursery.start_soon(prune)
            await trio.testing.wait_all_tasks_blocked()
            node.group.another_leader_gives_the_queue_to("client-b")
    assert prune_done.is_set()
    assert node.group.tables[LOCK_TABLE] == {KEY: "client-b"}
    # client-b consumes the queue: a third member asking here is refused it.
    assert await node.lock_queues(GROUP, "client-c", [QUEUE]) == []
    assert await node.lock_queues(GROUP, "client-b", [QUEUE]) == [QUEUE]


async def test_an_unlock_whose_offset_flush_outlasted_two_elections_leaves_the_new_holders_lock():
    node = stand_in_node(trio.testing.MockClock())
    assert await node.lock_queues(GROUP, "client-a", [QUEUE]) == [QUEUE]
    node.offsets.commit(GROUP, TOPIC, 0, 42)  # client-a's last commit, pending when it unlocks
    node.group.held[OFFSET_TABLE] = flushed = trio.Event()
    released: list[Any] = []

    async def unlock() -> None:
        released.append(await node.unlock_queues(GROUP, "client-a", [QUEUE]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(unlock)
        await trio.testing.wait_all_tasks_blocked()  # the unlock waits for its offset flush
        # Meanwhile client-a's retry reached the next leader, which released the queue and gave it to client-b.
        node.group.another_leader_gives_the_queue_to("client-b")
        flushed.set()
    assert released == [[]]  # not client-a's any more: nothing of it to release
    assert node.group.tables[LOCK_TABLE] == {KEY: "client-b"}
    assert node.group.tables[OFFSET_TABLE] == {KEY: 42}
    assert await node.lock_queues(GROUP, "client-c", [QUEUE]) == []


async def test_an_unlock_within_one_term_releases_after_the_flush():
    node = stand_in_node(trio.testing.MockClock())
    assert await node.lock_queues(GROUP, "client-a", [QUEUE]) == [QUEUE]
    node.offsets.commit(GROUP, TOPIC, 0, 42)
    assert await node.unlock_queues(GROUP, "client-a", [QUEUE]) == [QUEUE]
    # The offsets first, then the release: a next holder never starts before client-a's last commit.
    assert [table for table, _items in node.group.puts] == [LOCK_TABLE, OFFSET_TABLE, LOCK_TABLE]
    assert node.group.tables[LOCK_TABLE] == {}
    assert await node.lock_queues(GROUP, "client-c", [QUEUE]) == [QUEUE]
