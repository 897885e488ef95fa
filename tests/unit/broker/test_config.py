from __future__ import annotations

import pytest

from broker.config import BrokerConfig, load_broker_config
from remoting.config import ConfigError, config_from_mapping

SECRET = "0123456789abcdef-secret"


def _mapping(**extra):
    data = {
        "namesrv_addrs": ["127.0.0.1:9876"],
        "store": {"store_dir": "/tmp/x/store"},
        "dledger": {"group": "broker-b", "self_id": "n2", "secret": SECRET, "data_dir": "/tmp/x/dledger",
                    "members": [{"id": f"n{i}", "raft_address": f"127.0.0.1:{20000 + i}",
                                 "service_address": f"127.0.0.1:{10000 + i}"} for i in (1, 2, 3)]},
    }
    data.update(extra)
    return data


def test_identity_comes_from_the_dledger_table():
    config = config_from_mapping(BrokerConfig, _mapping())
    assert config.broker_name == "broker-b" and config.broker_id == 2
    assert config.listen_address == "127.0.0.1:10002"
    assert config.long_polling_timeout_ms == 15_000 and config.default_topic_queue_nums == 4
    assert config.auto_create_topic_enable is True
    # RocketMQ's 4 MiB: one message is a record proposed alone, below pysyncobj's chunked-send threshold.
    assert config.max_message_size == config.store.max_message_size == 4 * 1024 * 1024
    assert config.max_message_size_reason == "store.max_message_size"
    assert config.max_message_size < config.dledger.max_record_bytes < config.dledger.max_entry_bytes
    assert config.dledger.max_entry_bytes < config.dledger.append_entries_batch_size_bytes // 2


def test_message_size_limit_is_capped_by_one_dledger_record():
    mapping = _mapping()
    mapping["dledger"]["append_entries_batch_size_bytes"] = 1 << 20
    mapping["dledger"]["max_batch_bytes"] = 128 * 1024  # at most a quarter of the batch size
    config = config_from_mapping(BrokerConfig, mapping)
    assert 400_000 < config.max_message_size < config.dledger.max_record_bytes < 512 * 1024
    assert "append_entries_batch_size_bytes" in config.max_message_size_reason


def test_frame_size_must_hold_one_whole_message():
    with pytest.raises(ConfigError, match="max_frame_size must be >= 4"):
        config_from_mapping(BrokerConfig, _mapping(max_frame_size=4 << 20))


def test_a_queue_lock_must_outlive_twice_a_deposed_leaders_fallback():
    # A member trusts a lock for half its life after asking; a deposed leader renews locks for up to
    # leader_fallback_timeout_ms after a new one restored them. The member must stop before the new copy lapses.
    assert config_from_mapping(BrokerConfig, _mapping()).rebalance_lock_max_live_time_ms == 60_000
    mapping = _mapping(rebalance_lock_max_live_time_ms=6000)
    with pytest.raises(ConfigError, match=r"^rebalance_lock_max_live_time_ms must be > 2 x "
                                          r"dledger.leader_fallback_timeout_ms \(6000\).*got 6000$"):
        config_from_mapping(BrokerConfig, mapping)
    mapping["dledger"]["leader_fallback_timeout_ms"] = 2000
    assert config_from_mapping(BrokerConfig, mapping).rebalance_lock_max_live_time_ms == 6000


def test_metrics_are_off_unless_an_address_is_given_and_port_0_picks_one():
    assert config_from_mapping(BrokerConfig, _mapping()).metrics_listen == ""
    assert config_from_mapping(BrokerConfig, _mapping(metrics_listen="127.0.0.1:0")).metrics_listen == "127.0.0.1:0"


def test_listen_binds_but_service_address_is_advertised():
    config = config_from_mapping(BrokerConfig, _mapping(listen="0.0.0.0:10002"))
    assert config.listen_address == "0.0.0.0:10002" and config.broker_addr == "127.0.0.1:10002"


@pytest.mark.parametrize("address,needle", [("127.0.0.1:0", "needs a fixed port"),
                                            ("broker1:10002", "must be an IPv4 address")])
def test_advertised_address_must_be_dialable_ipv4(address, needle):
    data = _mapping()
    data["dledger"]["members"][1]["service_address"] = address
    with pytest.raises(ConfigError, match=needle):
        config_from_mapping(BrokerConfig, data)


def test_missing_dledger_table_is_named():
    with pytest.raises(ConfigError, match=r"\[dledger\] table"):
        load_broker_config(None)


@pytest.mark.parametrize("key,value,needle", [
    # Was said twice: "namesrv_addrs namesrv_addrs must look like HOST:PORT, got 'nohost', got ('nohost',)".
    ("namesrv_addrs", ["nohost"], "^namesrv_addrs must look like HOST:PORT, got 'nohost'$"),
    # Dialed, never bound: port 0 was accepted and every registration failed (the group never in any route).
    ("namesrv_addrs", ["127.0.0.1:9876", "127.0.0.1:0"],
     r"^namesrv_addrs needs a fixed port \(it is dialed; .*\), got '127.0.0.1:0'$"),
    ("long_polling_timeout_ms", 0, "long_polling_timeout_ms must be >= 1"),
    ("cluster_name", "bad name", "cluster_name must be letters"),
    # The name servers take ASCII only and at most 127 characters: anything else was never registered.
    ("cluster_name", "Clusté", "cluster_name must be letters, digits, - or _ \\(ASCII, 1 to 127"),
    ("cluster_name", "c" * 128, "cluster_name must be letters"),
    # Past a name server's broker_expired_ms (120 s) between registrations the group fell out of every route.
    ("register_interval_ms", 600_000, r"^register_interval_ms must be <= 60000, got 600000$"),
    # Sent to the name servers, which evict the node after it: one lost registration must not.
    ("broker_not_active_timeout_ms", 59_999,
     r"^broker_not_active_timeout_ms must be >= 2 x register_interval_ms \(60000\), got 59999$"),
    # Shorter than a client's heartbeat interval (10 s by default): every live consumer left its group between two.
    ("channel_expired_timeout_ms", 5000, r"^channel_expired_timeout_ms must be >= 30000, got 5000$"),
    ("listen", "127.0.0.1:99999", "port must be within"),
    # Bound to a random port while the service_address's port was advertised and dialed: nobody reached the node.
    ("listen", "0.0.0.0:0",
     r"^listen needs a fixed port \(it is dialed; .*\), got '0.0.0.0:0'$"),
    ("auto_create_topic_enable", "yes", "must be true or false"),
    ("metrics_listen", "localhost", r"^metrics_listen must look like HOST:PORT, got 'localhost'$"),
    ("metrics_listen", "127.0.0.1:-1", "^metrics_listen must end in a numeric port"),
    ("metrics_listen", 9100, "^metrics_listen must be a string, got 9100$"),
    ("no_such_key", 1, "unknown config key 'no_such_key'"),
])
def test_bad_values_are_named(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_mapping(BrokerConfig, _mapping(**{key: value}))


@pytest.mark.parametrize("key,value,floor", [("disk_clean_forcibly_ratio", 0.0, 0.3), ("disk_reject_ratio", 0.0, 0.35),
                                             ("disk_reject_ratio", 0.2, 0.35)])
def test_disk_ratios_that_would_delete_or_refuse_everything_are_refused(key, value, floor):
    # Accepted before (min 0.0): a forcibly ratio of 0 deleted unexpired segments at every clean pass, a reject ratio
    # of 0 refused every send as DISK_FULL. The floors are RocketMQ's.
    data = _mapping()
    data["store"].update({"disk_clean_early_ratio": 0.0, key: value})
    with pytest.raises(ConfigError, match=rf"^store\.{key} must be >= {floor}, got {value}$"):
        config_from_mapping(BrokerConfig, data)


def test_more_index_slots_than_entries_is_refused():
    # Accepted before: index_max_entries lowered alone made every IndexFile 4 MB (the default 1,000,000 slots) for
    # 1000 keys: up to 4 KiB of disk per key, and one more mapped file per 1000 (max_map_count is 65530).
    data = _mapping()
    data["store"]["index_max_entries"] = 1000
    with pytest.raises(ConfigError, match=r"^store\.index_hash_slots must be <= index_max_entries \(1000\): an "
                                          r"IndexFile never uses more slots than entries, got 1000000$"):
        config_from_mapping(BrokerConfig, data)
    data["store"]["index_hash_slots"] = 1000
    assert config_from_mapping(BrokerConfig, data).store.index_max_entries == 1000


def test_no_delete_hour_is_refused():
    # Accepted before: no hour ever matched, and expired segments stayed until the disk was 75 % full.
    data = _mapping()
    data["store"]["delete_when_hours"] = []
    with pytest.raises(ConfigError, match=r"^store\.delete_when_hours must list at least one hour \(every hour: 0 to "
                                          r"23\), got \(\)$"):
        config_from_mapping(BrokerConfig, data)


@pytest.mark.parametrize("key", ["dledger.tick_interval_ms", "dledger.gil_switch_interval_ms",
                                 "dledger.commit_notice_delay_ms", "dledger.max_batch_delay_ms",
                                 "store.file_reserved_hours"])
def test_nan_is_refused(key):
    # NaN passed every bound: the tick loop died on it (trio refuses a NaN timeout), the GIL switch interval became
    # 292,000 years, and no segment ever expired.
    table, leaf = key.split(".")
    data = _mapping()
    data.setdefault(table, {})[leaf] = float("nan")
    with pytest.raises(ConfigError, match=f"^{key} must be a number, got nan$"):
        config_from_mapping(BrokerConfig, data)


@pytest.mark.parametrize("where,value", [("group", "brøker-a"), ("group", "b" * 128), ("self_id", "n٣")])
def test_a_group_or_member_name_the_name_servers_refuse_is_named(where, value):
    data = _mapping()
    data["dledger"][where] = value
    if where == "self_id":
        data["dledger"]["members"][0]["id"] = value
    with pytest.raises(ConfigError, match=r"must be letters, digits, - or _ \(ASCII, 1 to 127 characters\)"):
        config_from_mapping(BrokerConfig, data)


def test_file_round_trip(tmp_path):
    path = tmp_path / "broker.toml"
    path.write_text(
        'cluster_name = "C1"\nnamesrv_addrs = ["127.0.0.1:9876"]\n[dledger]\ngroup = "broker-a"\nself_id = "n1"\n'
        f'secret = "{SECRET}"\n'
        'members = [{id = "n1", raft_address = "127.0.0.1:20911", service_address = "127.0.0.1:10911"}]\n')
    config = load_broker_config(path, {"long_polling_timeout_ms": 500})
    assert (config.cluster_name, config.broker_id, config.long_polling_timeout_ms) == ("C1", 1, 500)


@pytest.mark.parametrize(("store", "ledger", "expected"), [
    (None, None, "ASYNC_FLUSH"),
    ("SYNC_FLUSH", None, "SYNC_FLUSH"),  # RocketMQ's one knob: the members' journals are synced too
    ("SYNC_FLUSH", "ASYNC_FLUSH", "ASYNC_FLUSH"),  # set apart when asked
    ("ASYNC_FLUSH", "SYNC_FLUSH", "SYNC_FLUSH"),
])
def test_the_raft_journal_is_flushed_as_the_store_is_unless_set_apart(tmp_path, store, ledger, expected):
    mapping = _mapping()
    overrides = {}
    if store:
        overrides["store.flush_disk_type"] = store
    if ledger:
        overrides["dledger.flush_disk_type"] = ledger
    path = tmp_path / "broker.toml"
    members = ", ".join(f'{{id = "{m["id"]}", raft_address = "{m["raft_address"]}", '
                        f'service_address = "{m["service_address"]}"}}' for m in mapping["dledger"]["members"])
    path.write_text(f'namesrv_addrs = ["127.0.0.1:9876"]\n[store]\nstore_dir = "{tmp_path}/store"\n'
                    f'[dledger]\ngroup = "broker-b"\nself_id = "n2"\nsecret = "{SECRET}"\n'
                    f'data_dir = "{tmp_path}/dledger"\nmembers = [{members}]\n')
    config = load_broker_config(path, overrides)
    assert config.dledger.flush_disk_type == expected
    assert config.store.flush_disk_type == (store or "ASYNC_FLUSH")
    with pytest.raises(ConfigError, match="store.flush_disk_type must be one of"):
        load_broker_config(path, {"store.flush_disk_type": "SOMETIMES"})
