"""DLedgerConfig validation and the one place SyncObjConf is built (pysyncobj ignores misspelt options)."""

from __future__ import annotations

import re

import pytest

from dledger import DLedgerConfig, MemberAddress, build_syncobj_conf
from dledger.config import syncobj_options, unknown_syncobj_options
from dledger.entry import ENTRY_HEADER, EntryError, EntryTooLargeError, decode_entry, encode_entry
from remoting.config import ConfigError, config_from_mapping

MEMBERS = (MemberAddress(id="n0", raft_address="127.0.0.1:20911", service_address="127.0.0.1:30911"),
           MemberAddress(id="n1", raft_address="127.0.0.1:20912", service_address="127.0.0.1:30912"),
           MemberAddress(id="n2", raft_address="127.0.0.1:20913", service_address="127.0.0.1:30913"))
SECRET = "0123456789abcdef-secret"


def _config(**kw) -> DLedgerConfig:
    base = dict(group="broker-a", self_id="n0", members=MEMBERS, secret=SECRET)
    base.update(kw)
    return DLedgerConfig(**base)


def test_syncobj_conf_values_that_the_fixes_depend_on(tmp_path):
    cfg = _config(data_dir=tmp_path, flush_disk_type="SYNC_FLUSH")
    conf = build_syncobj_conf(cfg)
    assert conf.bindAddress == "127.0.0.1:20911"  # never 0.0.0.0
    assert conf.password is None  # authentication is dledger's frame MAC (patches), not Fernet
    assert conf.appendEntriesUseBatch is False
    assert conf.appendEntriesBatchSizeBytes == cfg.append_entries_batch_size_bytes
    assert cfg.max_entry_bytes < conf.appendEntriesBatchSizeBytes // 2  # chunked-send path unreachable
    # A 4 MiB message (RocketMQ's default max) plus its record fits one entry, proposed alone.
    assert cfg.max_batch_bytes < 4 * 1024 * 1024 + 64 * 1024 < cfg.max_record_bytes < cfg.max_entry_bytes
    assert conf.dynamicMembershipChange is True
    assert conf.journalFile == str(tmp_path / "raft.journal")
    assert conf.fullDumpFile == str(tmp_path / "raft.snapshot")
    assert conf.raftMinTimeout == 0.4 and conf.raftMaxTimeout == 0.9 and conf.appendEntriesPeriod == 0.05
    assert conf.commandsWaitLeader is False
    assert conf.logCompactionMinEntries == cfg.log_compaction_min_entries
    assert conf.useFork is False


def test_every_option_passed_is_a_real_syncobjconf_option():
    options = syncobj_options(_config(), serializer=None, deserializer=None, on_state_changed=None)
    assert unknown_syncobj_options(options) == []
    assert unknown_syncobj_options({"flushJournal": True, "raftMinTimeout": 1}) == ["flushJournal"]


@pytest.mark.parametrize("member, field, other", [
    (0, "raft_address", (0, "service_address")),  # one member's own two ports
    (1, "raft_address", (0, "service_address")),  # a peer's Raft port is this member's remoting port
    (1, "service_address", (0, "service_address")),  # two members advertise one remoting address
    (2, "service_address", (0, "raft_address")),
])
def test_every_member_address_is_distinct(member, field, other):
    # Accepted before: one server failed to bind after the store was opened, or (members on separate hosts) Raft
    # frames went to a remoting port, and routes and catch-ups to the wrong member.
    members = list(MEMBERS)
    address = getattr(members[other[0]], other[1])
    members[member] = MemberAddress(**{**vars(members[member]), field: address})
    with pytest.raises(ConfigError, match=f"must differ from every other member address, got '{address}'") as info:
        _config(members=tuple(members))
    # Both places the address is given are named, whichever comes first.
    assert f"members[n{member}].{field}" in str(info.value) and f"members[n{other[0]}].{other[1]}" in str(info.value)


@pytest.mark.parametrize("field, address", [
    ("raft_address", "0.0.0.0:20911"), ("raft_address", "[::]:20911"), ("raft_address", "224.0.0.1:20911"),
    ("service_address", "0.0.0.0:30911"), ("service_address", "255.255.255.255:30911"),
])
def test_a_member_address_is_one_peers_can_dial(field, address):
    # Accepted before: peers (and clients, given a service_address in routes) on other hosts dialed themselves.
    fields = {"id": "n1", "raft_address": "127.0.0.1:20911", "service_address": "127.0.0.1:30911", field: address}
    with pytest.raises(ConfigError, match=rf"^members\[n1\]\.{field} must be an address peers can dial, not an "
                                          rf"unspecified, multicast or broadcast one .*, got '{re.escape(address)}'$"):
        MemberAddress(**fields)
    assert MemberAddress(id="n1", raft_address="raft-1.example:20911").raft_address == "raft-1.example:20911"


@pytest.mark.parametrize("changes, message", [
    ({"secret": ""}, "dledger.secret must be at least 16 characters"),
    ({"secret": "short"}, "dledger.secret must be at least 16 characters"),
    # Not UTF-8 on a --set command line (a surrogate escape): FrameAuthenticator's encode() raised a traceback.
    ({"secret": "abcdefghijklmnop\udcff"}, "dledger.secret must be UTF-8 text (every Raft frame is authenticated "
                                           "with its bytes), got a character that is not at position 16"),
    ({"self_id": "n9"}, "dledger.self_id must name one of members"),
    ({"election_timeout_min_ms": 100, "heartbeat_interval_ms": 50}, "must be > 3 x heartbeat_interval_ms"),
    ({"election_timeout_max_ms": 300}, "election_timeout_max_ms must be > election_timeout_min_ms"),
    ({"max_batch_bytes": 16 << 20}, "dledger.max_batch_bytes must be <="),
    ({"max_batch_bytes": 300 * 1024, "append_entries_batch_size_bytes": 512 * 1024},
     "dledger.max_batch_bytes must be <="),
])
def test_bad_configs_are_named(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(**changes)


def test_loaded_from_a_mapping_with_members_table():
    cfg = config_from_mapping(DLedgerConfig, {
        "group": "broker-a", "self_id": "n1", "secret": SECRET,
        "members": [{"id": m.id, "raft_address": m.raft_address, "service_address": m.service_address}
                    for m in MEMBERS]})
    assert cfg.self_member == MEMBERS[1] and [p.id for p in cfg.peers] == ["n0", "n2"]
    with pytest.raises(ConfigError, match="needs a fixed port"):
        MemberAddress(id="n0", raft_address="127.0.0.1:0")
    with pytest.raises(ConfigError, match="unknown config key 'members\\[0\\].bogus'|unknown config key"):
        config_from_mapping(DLedgerConfig, {"self_id": "n0", "secret": SECRET,
                                            "members": [{"id": "n0", "raft_address": "1.2.3.4:5", "bogus": 1}]})


def test_entry_round_trip_and_size_limit():
    data = encode_entry(4096, 1_700_000_000_123, b"payload", max_entry_bytes=1024)
    assert data[:ENTRY_HEADER.size] == bytes.fromhex("d1" "0000000000001000" "0000018bcfe5687b" "00000007")
    entry = decode_entry(data)
    assert (entry.expected_start_offset, entry.store_timestamp, entry.payload) == (4096, 1_700_000_000_123,
                                                                                   b"payload")
    with pytest.raises(EntryTooLargeError, match="exceeds max_entry_bytes=100"):
        encode_entry(0, 0, b"x" * 100, max_entry_bytes=100)
    with pytest.raises(EntryError, match="magic"):
        decode_entry(b"\x00" + data[1:])
    with pytest.raises(EntryError, match="payload_length=7"):
        decode_entry(data[:-1])
