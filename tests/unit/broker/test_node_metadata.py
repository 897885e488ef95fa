"""What a broker node pays to read its replicated metadata, and what it promises about offset commits, on a
``BrokerNode`` whose Raft group is a stand-in: tables applied in memory, puts that store new objects (as a
decoded Raft entry does) and can be held, the test counting the work.

Costs are pinned by counting, never by timing: the configs parsed for one topic change, the offset tables copied
or walked for one lookup, the wire forms built for one registration. A group holds up to 50,000 topics and
hundreds of thousands of offsets, and all of this runs on the trio thread, in the Raft tick for the mirror."""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import trio
import trio.testing

import broker.topic_config as topic_config_module
from broker.config import BrokerConfig
from broker.node import OFFSET_TABLE, TOPIC_TABLE, BrokerNode, _offset_key
from broker.processor.base import RequestRejected
from broker.registration import RegistrationService, RegistrationSnapshot
from broker.status import registration_snapshot
from broker.topic_config import TopicConfig, TopicConfigTable
from dledger import Role
from dledger.group import RoleChange
from remoting.codes import ResponseCode
from remoting.config import config_from_mapping

MEMBERS = [{"id": "n1", "raft_address": "127.0.0.1:20911", "service_address": "127.0.0.1:10911"},
           {"id": "n2", "raft_address": "127.0.0.1:20912", "service_address": "127.0.0.1:10912"}]


class CountingView(Mapping[str, Any]):
    """A read-only view of a table that counts the walks over it."""

    def __init__(self, group: StandInGroup, rows: dict[str, Any]) -> None:
        self._group, self._rows = group, rows

    def __getitem__(self, key: str) -> Any:
        return self._rows[key]

    def __iter__(self) -> Iterator[str]:
        self._group.walks += 1
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


class StandInGroup:
    """The Raft group as the node sees it. ``metadata`` (a copy) counts as a walk of the table, as does iterating
    a view; a put to a table in ``held`` waits for that event; every put stores new objects and tells the node."""

    def __init__(self, tables: dict[str, dict[str, Any]] | None = None) -> None:
        self.tables = tables or {}
        self.generations: dict[str, int] = {}
        self.walks = 0
        self.held: dict[str, trio.Event] = {}
        self.puts: list[tuple[str, dict[str, Any]]] = []
        self.role, self.term, self.leader_id = Role.LEADER, 3, "n1"
        self.is_leader = self.is_ready_leader = True
        self.transfer_phase = ""
        self.transfer_started = trio.Event()
        self.transfer_may_end = trio.Event()
        self._listeners: list[Any] = []

    def metadata(self, table: str) -> dict[str, Any]:
        self.walks += 1
        return dict(self.tables.get(table, {}))

    def metadata_view(self, table: str) -> Mapping[str, Any]:
        return CountingView(self, self.tables.get(table, {}))

    def metadata_get(self, table: str, key: str, default: Any = None) -> Any:
        return self.tables.get(table, {}).get(key, default)

    def metadata_generation(self, table: str) -> int:
        return self.generations.get(table, 0)

    def on_metadata_applied(self, callback: Any) -> None:
        self._listeners.append(callback)

    def apply(self, table: str, items: dict[str, Any]) -> None:
        rows = self.tables.setdefault(table, {})
        for key, value in pickle.loads(pickle.dumps(items)).items():  # new objects, as a decoded entry holds
            if value is None:
                rows.pop(key, None)
            else:
                rows[key] = value
        self.generations[table] = self.generations.get(table, 0) + 1
        for callback in self._listeners:
            callback()

    async def put_metadata(self, table: str, items: dict[str, Any], *, timeout_s: float) -> int:
        self.puts.append((table, dict(items)))
        if table in self.held:
            await self.held[table].wait()
        self.apply(table, items)
        return len(self.tables[table])

    async def wait_ready_leader(self) -> None:
        pass

    def member_address(self, member_id: str) -> Any:
        return None

    def statistics(self) -> Any:
        return type("Stats", (), {"connected_peers": ("n2",)})()

    async def transfer_leadership(self, to: str | None = None, *, timeout_s: float = 3.0) -> RoleChange:
        self.transfer_started.set()
        await self.transfer_may_end.wait()
        self.role, self.term, self.leader_id = Role.FOLLOWER, 4, "n2"
        self.is_leader = self.is_ready_leader = False
        return RoleChange(Role.FOLLOWER, 4, "n2", "127.0.0.1:10912")


class StandInRegistration:
    """The node's registration rounds: each waits for ``may_end`` (a slow name server)."""

    def __init__(self) -> None:
        self.rounds = 0
        self.may_end = trio.Event()

    async def register_all(self) -> None:
        self.rounds += 1
        await self.may_end.wait()


def _node(group: StandInGroup, tmp_path) -> BrokerNode:
    config = config_from_mapping(BrokerConfig, {
        "store": {"store_dir": str(tmp_path / "store")},
        "dledger": {"group": "broker-a", "self_id": "n1", "secret": "unit-test-secret-0123456789",
                    "members": MEMBERS, "data_dir": str(tmp_path / "dledger")}})
    return BrokerNode(config, store=None, group=group, client=None)  # type: ignore[arg-type]


def _topics(n: int) -> dict[str, Any]:
    return {"": 1, **{f"t{i}": TopicConfig(f"t{i}").to_wire() for i in range(n)}}


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """The topic names ``TopicConfig.from_wire`` parsed."""
    seen: list[str] = []
    original = TopicConfig.from_wire.__func__  # type: ignore[attr-defined]

    def counting(cls: type[TopicConfig], data: Mapping[str, Any], *, stored: bool = False) -> TopicConfig:
        seen.append(data.get("topic_name"))
        return original(cls, data, stored=stored)

    monkeypatch.setattr(TopicConfig, "from_wire", classmethod(counting))
    return seen


# --- the topic mirror --------------------------------------------------------------------------------------------
def test_one_topic_change_parses_one_config_however_many_the_group_holds(tmp_path, parses):
    group = StandInGroup({TOPIC_TABLE: _topics(500)})
    node = _node(group, tmp_path)
    assert len(node.topics) == 500 and len(parses) == 500  # the first mirror is built whole
    parses.clear()
    group.apply(TOPIC_TABLE, {"": 2, "new": TopicConfig("new", 8, 8).to_wire()})
    assert parses == ["new"] and node.topics.get("new") == TopicConfig("new", 8, 8) and len(node.topics) == 501
    group.apply(TOPIC_TABLE, {"": 3, "t7": None})
    assert parses == ["new"] and node.topics.get("t7") is None and node.topics.data_version == 3


def test_the_mirror_follows_any_sequence_of_changes_as_a_full_rebuild_would(tmp_path):
    rng = random.Random(7)
    group = StandInGroup({TOPIC_TABLE: _topics(30)})
    node = _node(group, tmp_path)
    for version in range(2, 200):
        items: dict[str, Any] = {"": version}
        for _ in range(rng.randint(0, 3)):
            name = f"t{rng.randrange(40)}"
            queues = rng.randint(1, 8)
            items[name] = None if rng.random() < 0.3 else TopicConfig(name, queues, queues).to_wire()
        if version % 50 == 0:
            # A snapshot load: every table replaced by new objects (the node rebuilds the whole mirror).
            group.tables = pickle.loads(pickle.dumps(group.tables))
        group.apply(TOPIC_TABLE, items)
        full = TopicConfigTable()
        full.restore({"data_version": version, "topics": [v for k, v in group.tables[TOPIC_TABLE].items() if k]})
        assert node.topics.to_wire() == full.to_wire() and node.topics.data_version == version
        assert {c.topic_name for c in node.topics.all() if node.topics.sendable(c.topic_name)} == \
            {c.topic_name for c in full.all() if full.sendable(c.topic_name)}


def test_a_stored_config_that_does_not_parse_leaves_the_mirror_as_it_was_and_is_tried_again(tmp_path):
    group = StandInGroup({TOPIC_TABLE: _topics(3)})
    node = _node(group, tmp_path)
    with pytest.raises(topic_config_module.TopicConfigError):
        group.apply(TOPIC_TABLE, {"": 2, "ok": TopicConfig("ok").to_wire(), "bad": {"topic_name": "bad", "perm": 99}})
    assert node.topics.get("ok") is None and node.topics.data_version == 1
    group.apply(TOPIC_TABLE, {"": 3, "bad": None})
    assert node.topics.get("ok") == TopicConfig("ok") and node.topics.data_version == 3


def test_registrations_build_the_topic_part_once_per_change_of_the_table(tmp_path, monkeypatch):
    group = StandInGroup({TOPIC_TABLE: {**_topics(200), "Orders\n": TopicConfig("Orders\n").to_wire()}})
    node = _node(group, tmp_path)
    built: list[str] = []
    change = {"": 2, "t3": TopicConfig("t3", 2, 2).to_wire()}
    original = TopicConfig.to_wire
    monkeypatch.setattr(TopicConfig, "to_wire", lambda self: built.append(self.topic_name) or original(self))
    first = registration_snapshot(node)
    again = registration_snapshot(node)
    assert built == [] and again.topic_configs is first.topic_configs
    assert len(first.topic_configs) == 200 and "Orders\n" not in first.topic_configs  # refused by name servers
    group.apply(TOPIC_TABLE, change)
    changed = registration_snapshot(node)
    assert built == ["t3"] and changed.topic_configs["t3"]["read_queue_nums"] == 2


async def test_a_registration_round_encodes_the_body_once_for_every_name_server_and_round(monkeypatch):
    class Client:
        def __init__(self) -> None:
            self.bodies: list[bytes] = []

        async def invoke(self, addr: str, request: Any, *, timeout_s: float) -> Any:
            self.bodies.append(request.body)
            return type("Response", (), {"code": ResponseCode.SUCCESS, "ext": {}, "remark": ""})()

    encoded: list[int] = []
    original = RegistrationSnapshot.body
    monkeypatch.setattr(RegistrationSnapshot, "body", lambda self: encoded.append(1) or original(self))
    topics = {f"t{i}": TopicConfig(f"t{i}").to_wire() for i in range(50)}  # one object while the table stays

    def snapshot() -> RegistrationSnapshot:
        return RegistrationSnapshot("c", "broker-a", 0, "127.0.0.1:10911", "LEADER", 3, 1, topics, 30_000)

    client = Client()
    service = RegistrationService(client, ("ns1:9876", "ns2:9876"), snapshot, interval_ms=30_000, timeout_ms=1_000)
    await service.register_all()
    await service.register_all()
    assert len(encoded) == 1 and len(client.bodies) == 4 and len(set(client.bodies)) == 1
    topics = {**topics, "t0": TopicConfig("t0", 2, 2).to_wire()}
    await service.register_all()
    assert len(encoded) == 2 and client.bodies[-1] != client.bodies[0]


async def test_a_topic_change_does_not_hold_the_next_one_while_it_registers(tmp_path):
    group = StandInGroup({TOPIC_TABLE: _topics(2)})
    node = _node(group, tmp_path)
    node.registration = StandInRegistration()  # type: ignore[assignment]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node.update_topic, TopicConfig("A"))
        await trio.testing.wait_all_tasks_blocked()
        assert node.registration.rounds == 1  # A is applied and registering, its answer not sent yet
        nursery.start_soon(node.update_topic, TopicConfig("B"))
        await trio.testing.wait_all_tasks_blocked()
        assert [items.keys() - {""} for _table, items in group.puts] == [{"A"}, {"B"}]
        assert node.registration.rounds == 2 and node.topics.data_version == 3
        node.registration.may_end.set()


# --- consumer offsets ---------------------------------------------------------------------------------------------
def _offsets(groups: int, queues: int) -> dict[str, int]:
    return {_offset_key(f"g{g}", "T", q): q for g in range(groups) for q in range(queues)}


async def test_offset_lookups_and_commits_neither_copy_nor_walk_the_offset_table(tmp_path):
    group = StandInGroup({TOPIC_TABLE: _topics(1), OFFSET_TABLE: _offsets(50, 20)})
    node = _node(group, tmp_path)
    walks = group.walks
    assert node.offsets.query("g3", "T", 5) == 5 and node.offsets.query("g3", "T", 99) is None
    await node.commit_offset("g3", "T", 5, 6)  # not the first: pending, no replication
    assert node.offsets.query("g3", "T", 5) == 6 and group.puts == []
    assert group.walks == walks


def test_a_groups_offsets_are_read_from_an_index_built_once_per_change_of_the_table(tmp_path):
    group = StandInGroup({TOPIC_TABLE: _topics(1), OFFSET_TABLE: _offsets(50, 20)})
    node = _node(group, tmp_path)
    walks = group.walks
    expected = {("T", q): q for q in range(20)}
    assert node.offsets.offsets_of_group("g7") == expected and node.offsets.offsets_of_group("g8") == expected
    assert node.offsets.offsets_of_group("nobody") == {}
    assert group.walks == walks + 1
    group.apply(OFFSET_TABLE, {_offset_key("g7", "T", 3): None, _offset_key("g7", "U", 0): 9})
    got = node.offsets.offsets_of_group("g7")
    assert ("T", 3) not in got and got[("U", 0)] == 9 and len(got) == 20
    assert group.walks == walks + 2
    assert sorted(node.committed_offsets("g8")) == [("g8", "T", q, q) for q in range(20)]


async def test_a_second_first_commit_of_a_queue_waits_for_the_first_ones_replication(tmp_path):
    """The docs promise a group's first offset of a queue is replicated before the commit is answered; a second
    commit arriving while the first one's replication was in flight found it pending and was answered at once."""
    group = StandInGroup({TOPIC_TABLE: _topics(1)})
    node = _node(group, tmp_path)
    group.held[OFFSET_TABLE] = trio.Event()
    answered: list[int] = []

    async def commit(offset: int) -> None:
        await node.commit_offset("g", "T", 0, offset)
        answered.append(offset)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(commit, 4)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(commit, 5)
        await trio.testing.wait_all_tasks_blocked()
        assert answered == [] and group.metadata_get(OFFSET_TABLE, _offset_key("g", "T", 0)) is None
        group.held[OFFSET_TABLE].set()
    assert sorted(answered) == [4, 5] and group.tables[OFFSET_TABLE][_offset_key("g", "T", 0)] == 5


async def test_commits_during_a_clean_stops_hand_over_are_refused_for_the_next_leader(tmp_path):
    """Taken during the transfer, a commit was answered SUCCESS and then dropped with the leadership (the flush
    waited for the transfer and failed): the docs promised consumers no redelivery of what they committed."""
    group = StandInGroup({TOPIC_TABLE: _topics(1), OFFSET_TABLE: {_offset_key("g", "T", 0): 1}})
    node = _node(group, tmp_path)
    await node.commit_offset("g", "T", 0, 2)  # pending when the stop begins: replicated before the transfer
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node.hand_over_leadership)
        await group.transfer_started.wait()
        assert group.tables[OFFSET_TABLE][_offset_key("g", "T", 0)] == 2
        with pytest.raises(RequestRejected) as refused:
            await node.commit_offset("g", "T", 0, 3)
        assert refused.value.code == ResponseCode.NOT_LEADER and "handing its leadership over" in str(refused.value)
        group.transfer_may_end.set()
    assert not node.offsets.has_pending() and group.tables[OFFSET_TABLE][_offset_key("g", "T", 0)] == 2
