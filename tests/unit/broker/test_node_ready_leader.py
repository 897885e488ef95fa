"""Topic decisions on a leader elected a moment ago wait until its no-op is applied: only then does its topic table
hold every change its group committed (the entries of earlier terms apply after the no-op). A fake group plays the
new leader; its table gains the topics of the earlier term when it "applies" them."""

from __future__ import annotations

from typing import Any

import trio

from broker.config import BrokerConfig
from broker.node import TOPIC_TABLE, BrokerNode
from broker.topic_config import TopicConfig
from dledger import Role
from remoting.config import config_from_mapping
from tests.unit.broker.stand_in import MetadataReads

MEMBERS = [{"id": "n1", "raft_address": "127.0.0.1:20911", "service_address": "127.0.0.1:10911"}]


class NewLeaderGroup(MetadataReads):
    """A leader whose no-op is not applied until ``apply_earlier_term()``: ``metadata()`` answers the table it had
    applied so far, ``put_metadata`` applies a change after the earlier term's, as the Raft log orders them."""

    role, term, leader_id, is_leader = Role.LEADER, 3, "n1", True

    def __init__(self, applied: dict[str, Any], earlier_term: dict[str, Any]) -> None:
        self.tables: dict[str, dict[str, Any]] = {TOPIC_TABLE: dict(applied)}
        self._earlier_term = earlier_term
        self.is_ready_leader = False
        self._ready = trio.Event()
        self.written: list[dict[str, Any]] = []

    def apply_earlier_term(self) -> None:
        self.tables[TOPIC_TABLE].update(self._earlier_term)
        self.is_ready_leader = True
        self._ready.set()

    async def wait_ready_leader(self) -> None:
        await self._ready.wait()

    async def put_metadata(self, table: str, items: dict[str, Any], *, timeout_s: float) -> int:
        self.written.append(items)
        await self._ready.wait()
        target = self.tables.setdefault(table, {})
        for key, value in items.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
        return len(target)

    def member_address(self, member_id: str) -> None:
        return None

    def metadata_generation(self, table: str) -> int:
        return 0  # the node finds a table it mirrors changed by itself (a miss, or after its own change)

    def on_metadata_applied(self, callback: Any) -> None:
        pass


def _node(group: NewLeaderGroup, tmp_path) -> BrokerNode:
    config = config_from_mapping(BrokerConfig, {
        "store": {"store_dir": str(tmp_path / "store")},
        "dledger": {"group": "broker-a", "self_id": "n1", "secret": "unit-test-secret-0123456789",
                    "members": MEMBERS, "data_dir": str(tmp_path / "dledger")}})
    return BrokerNode(config, store=None, group=group, client=None)  # type: ignore[arg-type]


def _wire(topic: str, queues: int) -> dict[str, Any]:
    return TopicConfig(topic_name=topic, read_queue_nums=queues, write_queue_nums=queues).to_wire()


async def test_a_send_to_a_topic_the_new_leader_has_not_applied_yet_finds_it_instead_of_auto_creating_it(tmp_path):
    """'Fresh' was created with 8 queues (data version 6) just before the failover; the new leader gets a send
    for it before applying that. It used to auto-create it: 4 queues and data version 2, written after the
    creation in the log, so the topic lost its queues for good."""
    group = NewLeaderGroup(applied={"": 1}, earlier_term={"": 6, "Fresh": _wire("Fresh", 8)})
    node = _node(group, tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_apply_soon, group)
        config = await node.topic_for_send("Fresh")
    assert (config.read_queue_nums, config.write_queue_nums) == (8, 8)
    assert group.written == [] and group.tables[TOPIC_TABLE]["Fresh"]["write_queue_nums"] == 8
    assert node.topics.data_version == 6


async def test_a_topic_update_on_the_new_leader_raises_the_data_version_of_the_complete_table(tmp_path):
    group = NewLeaderGroup(applied={"": 1}, earlier_term={"": 6, "Fresh": _wire("Fresh", 8)})
    node = _node(group, tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_apply_soon, group)
        await node.update_topic(TopicConfig(topic_name="Other", read_queue_nums=2, write_queue_nums=2))
    assert group.written == [{"Other": _wire("Other", 2), "": 7}]
    assert node.topics.data_version == 7 and {c.topic_name for c in node.topics.all()} == {"Fresh", "Other"}


async def _apply_soon(group: NewLeaderGroup) -> None:
    await trio.sleep(0.05)
    group.apply_earlier_term()
