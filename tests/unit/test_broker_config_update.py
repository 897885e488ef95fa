"""``broker_permission`` and the runtime part of ``BrokerConfig`` (UPDATE_BROKER_CONFIG): which keys may change on a
running node, how a value sent as text is read and judged (by the config file's own rules), the overrides file a
node keeps them in, the registration that carries the permission, and ``raftmq admin update-broker-config``'s
argument checks."""

from __future__ import annotations

import dataclasses
import json
import typing

import cbor2
import pytest

from broker.config import (RUNTIME_KEYS, BrokerConfig, RuntimeConfigError, check_runtime_key, parse_runtime_value,
                           read_runtime_overrides, runtime_overrides, with_runtime_values, write_runtime_overrides)
from broker.registration import RegistrationSnapshot
from raftmq.cli import main
from remoting.config import ConfigError, config_from_mapping


def _config(tmp_path, **keys: typing.Any) -> BrokerConfig:
    members = [{"id": f"n{i}", "raft_address": f"127.0.0.1:{20000 + i}", "service_address": f"127.0.0.1:{10000 + i}"}
               for i in (1, 2, 3)]
    return config_from_mapping(BrokerConfig, {
        "store": {"store_dir": str(tmp_path / "store")},
        "dledger": {"group": "broker-a", "self_id": "n1", "secret": "0123456789abcdef-secret",
                    "data_dir": str(tmp_path / "dledger"), "members": members},
        **keys})


def test_broker_permission_is_read_write_by_default_and_only_rocketmqs_values_are_taken(tmp_path):
    config = _config(tmp_path)
    assert config.broker_permission == 6 and config.writable and config.readable
    assert (_config(tmp_path, broker_permission=4).writable, _config(tmp_path, broker_permission=4).readable) == \
        (False, True)
    assert (_config(tmp_path, broker_permission=2).writable, _config(tmp_path, broker_permission=2).readable) == \
        (True, False)
    for bad in (3, 5):
        with pytest.raises(ConfigError, match=rf"^broker_permission must be one of 2, 4, 6, got {bad}$"):
            _config(tmp_path, broker_permission=bad)
    for bad, bound in ((0, ">= 2"), (1, ">= 2"), (-4, ">= 2"), (7, "<= 6"), (8, "<= 6")):
        with pytest.raises(ConfigError, match=rf"^broker_permission must be {bound}, got {bad}$"):
            _config(tmp_path, broker_permission=bad)
    for bad in ("4", True, 4.0):
        with pytest.raises(ConfigError, match="broker_permission must be an integer"):
            _config(tmp_path, broker_permission=bad)


def test_every_runtime_key_is_a_plain_top_level_key_with_its_bounds():
    fields = {f.name: f for f in dataclasses.fields(BrokerConfig)}
    hints = typing.get_type_hints(BrokerConfig)
    for key in RUNTIME_KEYS:
        assert key in fields and hints[key] in (int, bool), key
        meta = fields[key].metadata
        assert hints[key] is bool or meta["choices"] or meta["max"] is not None, key


@pytest.mark.parametrize("key, problem", [
    ("listen", "config key 'listen' cannot be changed at runtime: edit the node's config file and restart"),
    ("send_timeout_ms", "'send_timeout_ms' cannot be changed at runtime"),
    ("store.flush_disk_type", "'store.flush_disk_type' cannot be changed at runtime"),
    ("dledger.secret", "'dledger.secret' cannot be changed at runtime"),
    ("brokerPermission", "unknown config key 'brokerPermission' (keys that can change at runtime: broker_permission"),
    (7, "unknown config key 7"),
])
def test_only_runtime_keys_may_change_and_a_refusal_names_the_key(key, problem):
    with pytest.raises(RuntimeConfigError) as refused:
        check_runtime_key(key)
    assert problem in str(refused.value) and refused.value.key == str(key)
    assert all(check_runtime_key(k) == k for k in RUNTIME_KEYS)


def test_a_value_sent_as_text_is_read_as_the_toml_config_file_reads_it():
    assert parse_runtime_value("broker_permission", "4") == 4
    assert parse_runtime_value("max_transfer_count", "1_024") == 1024
    assert parse_runtime_value("auto_create_topic_enable", "false") is False
    # What TOML cannot read stays text, for the type check to refuse naming the key.
    assert parse_runtime_value("long_polling_timeout_ms", "soon") == "soon"
    assert parse_runtime_value("long_polling_timeout_ms", "") == ""
    with pytest.raises(RuntimeConfigError, match="max_transfer_count must be one value on one line"):
        parse_runtime_value("max_transfer_count", "7\nbroker_permission = 4")
    with pytest.raises(RuntimeConfigError, match="broker_permission must be sent as text, got 4"):
        parse_runtime_value("broker_permission", 4)


def test_runtime_values_are_judged_by_the_config_files_rules_and_leave_the_config_as_it_was(tmp_path):
    config = _config(tmp_path)
    changed = with_runtime_values(config, {"broker_permission": 4, "max_transfer_count": 7})
    assert (changed.broker_permission, changed.max_transfer_count) == (4, 7)
    assert (config.broker_permission, config.max_transfer_count) == (6, 1024)
    assert changed.dledger == config.dledger and changed.store == config.store
    refusals = [
        ({"broker_permission": 5}, "broker_permission", "broker_permission must be one of 2, 4, 6, got 5"),
        ({"long_polling_timeout_ms": 0}, "long_polling_timeout_ms", "long_polling_timeout_ms must be >= 1, got 0"),
        ({"max_transfer_count": 10**9}, "max_transfer_count", "max_transfer_count must be <= 65536, got 1000000000"),
        ({"auto_create_topic_enable": 1}, "auto_create_topic_enable", "must be true or false, got 1"),
        ({"max_batch_messages": "soon"}, "max_batch_messages", "must be an integer, got 'soon'"),
        # A check across keys: named by the key given and the value, then the rule's own sentence.
        ({"max_transfer_bytes": 64 << 20}, "max_transfer_bytes",
         f"max_transfer_bytes = {64 << 20} refused: max_frame_size must be >="),
        ({"broker_permission": 4, "listen": "127.0.0.1:1"}, "listen", "'listen' cannot be changed at runtime"),
    ]
    for values, key, problem in refusals:
        with pytest.raises(RuntimeConfigError) as refused:
            with_runtime_values(config, values)
        assert problem in str(refused.value) and refused.value.key == key, refused.value


def test_the_overrides_are_what_differs_from_the_config_file(tmp_path):
    base = _config(tmp_path, long_polling_timeout_ms=500)
    assert runtime_overrides(base, base) == {}
    now = with_runtime_values(base, {"broker_permission": 4, "long_polling_timeout_ms": 500})
    assert runtime_overrides(base, now) == {"broker_permission": 4}
    # Back to the file's value: no override left to mask a later edit of the file.
    assert runtime_overrides(base, with_runtime_values(now, {"broker_permission": 6})) == {}


def test_the_overrides_file_is_written_whole_and_read_over_the_config_file(tmp_path):
    base = _config(tmp_path)
    path = base.runtime_overrides_path
    assert path == tmp_path / "store" / "runtime_config.json"
    assert read_runtime_overrides(base) == (base, {})  # no file: the config file's config
    path.parent.mkdir(parents=True)
    write_runtime_overrides(path, {"max_transfer_count": 7, "broker_permission": 4})
    assert json.loads(path.read_text()) == {"broker_permission": 4, "max_transfer_count": 7}
    assert [p.name for p in path.parent.iterdir()] == ["runtime_config.json"]  # the temporary file is gone
    config, overrides = read_runtime_overrides(base)
    assert overrides == {"broker_permission": 4, "max_transfer_count": 7}
    assert (config.broker_permission, config.max_transfer_count) == (4, 7)
    write_runtime_overrides(path, {})
    assert read_runtime_overrides(base) == (base, {})


@pytest.mark.parametrize("text, problem", [
    ("{not json", "are not valid JSON"),
    ("[4]", "must be a JSON object of config key -> value, got list"),
    ('{"broker_permission": 5}', "broker_permission must be one of 2, 4, 6, got 5"),
    ('{"broker_permission": "4"}', "broker_permission must be an integer, got '4'"),
    ('{"listen": "127.0.0.1:1"}', "'listen' cannot be changed at runtime"),
])
def test_an_overrides_file_the_config_would_refuse_stops_the_node_naming_it(tmp_path, text, problem):
    base = _config(tmp_path)
    base.runtime_overrides_path.parent.mkdir(parents=True)
    base.runtime_overrides_path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        read_runtime_overrides(base)
    assert str(base.runtime_overrides_path) in str(refused.value) and problem in str(refused.value)


def _registered_perms(permission: int) -> dict[str, dict]:
    topics = {"rw": {"read_queue_nums": 4, "write_queue_nums": 4, "perm": 6},
              "inherit": {"read_queue_nums": 8, "write_queue_nums": 2, "perm": 7, "topic_sys_flag": 3, "order": True},
              "read_only": {"read_queue_nums": 1, "write_queue_nums": 1, "perm": 4},
              "write_only": {"read_queue_nums": 1, "write_queue_nums": 1, "perm": 2}}
    snap = RegistrationSnapshot("C", "broker-a", 1, "127.0.0.1:10911", "LEADER", 3, 9, topics, 120_000,
                                broker_permission=permission)
    return cbor2.loads(snap.body())


def test_a_node_registers_each_topic_perm_limited_by_its_broker_permission():
    assert {t: c["perm"] for t, c in _registered_perms(6).items()} == {
        "rw": 6, "inherit": 7, "read_only": 4, "write_only": 2}  # read|write: every perm as it is, inherit too
    assert {t: c["perm"] for t, c in _registered_perms(4).items()} == {
        "rw": 4, "inherit": 4, "read_only": 4, "write_only": 0}
    assert {t: c["perm"] for t, c in _registered_perms(2).items()} == {
        "rw": 2, "inherit": 2, "read_only": 0, "write_only": 2}
    # Only the perm: queue counts, sys flag and order go as they are.
    assert _registered_perms(4)["inherit"] == {"read_queue_nums": 8, "write_queue_nums": 2, "perm": 4,
                                               "topic_sys_flag": 3, "order": True}


def test_update_broker_config_args_are_checked_before_anything_is_sent(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["admin", "--namesrv", "127.0.0.1:1", "update-broker-config", "--addr", "127.0.0.1:2", "-k", "listen",
              "-v", "x"])
    assert exit_info.value.code == 2
    assert "config key 'listen' cannot be changed at runtime" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["admin", "update-broker-config", "-k", "broker_permission", "-v", "4"])  # neither --broker nor --addr
    assert exit_info.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["admin", "update-broker-config", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert all(key in usage for key in RUNTIME_KEYS), usage
