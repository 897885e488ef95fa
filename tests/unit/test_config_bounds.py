"""Every numeric key of the servers' and clients' configs has an upper bound, and no path key may be empty.

Keys with only a floor took any value and the process started: ``store.clean_interval_ms = 2**64`` turned
cleaning (and the disk-full check it carries) off, ``store.file_reserved_hours = inf`` kept every segment, and
``store_dir = ""`` put the commit log in the current directory (``Path("")`` is ``"."``)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from broker.config import BrokerConfig, load_broker_config
from broker.store.config import StoreConfig
from client.instance import ClientConfig
from client.producer import ProducerConfig
from client.pull_consumer import PullConsumerConfig
from client.push_consumer import PushConsumerConfig
from dledger.config import DLedgerConfig
from namesrv.config import NamesrvConfig
from raftmq.commands.broker import parse_overrides
from raftmq.commands.dledger_node import DLedgerNodeConfig
from remoting.config import ConfigError, config_from_mapping, load_config

_DLEDGER = {"group": "broker-a", "self_id": "n1", "secret": "0123456789abcdef-secret", "data_dir": "/tmp/x/dledger",
            "members": [{"id": f"n{i}", "raft_address": f"127.0.0.1:{20000 + i}",
                         "service_address": f"127.0.0.1:{10000 + i}"} for i in (1, 2, 3)]}
_BROKER = {"namesrv_addrs": ["127.0.0.1:9876"], "store": {"store_dir": "/tmp/x/store"}, "dledger": _DLEDGER}

_SERVER_CONFIGS = [BrokerConfig, StoreConfig, DLedgerConfig, NamesrvConfig, DLedgerNodeConfig]
_CLIENT_CONFIGS = [ClientConfig, ProducerConfig, PushConsumerConfig, PullConsumerConfig]


def _broker(**overrides: typing.Any) -> BrokerConfig:
    """A broker config as ``raftmq broker --config F --set KEY=VALUE`` builds it."""
    return config_from_mapping(BrokerConfig, _nested(_BROKER, overrides))


def _nested(base: dict, overrides: dict) -> dict:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for dotted, value in overrides.items():
        table, _, leaf = dotted.rpartition(".")
        (data.setdefault(table, {}) if table else data)[leaf] = value
    return data


@pytest.mark.parametrize("cls", _SERVER_CONFIGS + _CLIENT_CONFIGS, ids=lambda c: c.__name__)
def test_every_numeric_key_has_an_upper_bound(cls):
    hints = typing.get_type_hints(cls)
    unbounded = [f.name for f in dataclasses.fields(cls)
                 if hints[f.name] in (int, float) and (not f.metadata or f.metadata.get("max") is None)]
    assert unbounded == []


@pytest.mark.parametrize("key, value, bound", [
    ("store.hot_window_bytes", 2 ** 64, 2 ** 40),
    ("store.page_cache_window_bytes", 2 ** 64, 2 ** 40),
    ("store.dispatch_chunk_bytes", 2 ** 30, 16 * 1024 * 1024),
    ("store.min_retained_segments", 2 ** 64, 65_536),
    ("store.delete_segments_per_pass", 99_999_999_999_999_999_999, 100),
    ("store.clean_interval_ms", 2 ** 64, 3_600_000),
    ("store.file_reserved_hours", math.inf, 87_600.0),
    ("store.file_reserved_hours", 1e300, 87_600.0),
])
def test_an_absurd_broker_value_is_refused_naming_the_key_and_the_bound(key, value, bound):
    with pytest.raises(ConfigError) as error:
        _broker(**{key: value})
    assert str(error.value) == f"{key} must be <= {bound}, got {value!r}"
    _broker(**{key: bound})  # the bound itself is taken


def test_an_absurd_value_from_the_command_line_is_refused(tmp_path):
    # What `raftmq broker --config F --set store.clean_interval_ms=18446744073709551616` loads.
    path = tmp_path / "broker.toml"
    path.write_text('namesrv_addrs = ["127.0.0.1:9876"]\n[store]\nstore_dir = "s"\n[dledger]\ngroup = "broker-a"\n'
                    'self_id = "n1"\nsecret = "0123456789abcdef-secret"\ndata_dir = "d"\n'
                    'members = [{id = "n1", raft_address = "127.0.0.1:20001", service_address = "127.0.0.1:10001"}]\n')
    overrides = parse_overrides(["store.clean_interval_ms=18446744073709551616"])
    with pytest.raises(ConfigError, match=r"^store\.clean_interval_ms must be <= 3600000, got 18446744073709551616$"):
        load_broker_config(path, overrides)
    assert load_broker_config(path).store.clean_interval_ms == 10_000


def test_an_absurd_byte_log_segment_size_is_refused():
    with pytest.raises(ConfigError, match=r"^byte_log_segment_size_bytes must be <= 1099511627776, "
                                          r"got 18446744073709551616$"):
        config_from_mapping(DLedgerNodeConfig, {"dledger": _DLEDGER, "byte_log_segment_size_bytes": 2 ** 64})
    config = config_from_mapping(DLedgerNodeConfig, {"dledger": _DLEDGER, "byte_log_segment_size_bytes": 2 ** 40})
    assert config.byte_log_segment_size_bytes == 2 ** 40


def test_the_defaults_stay_within_the_new_bounds():
    config = _broker()
    assert config.store == StoreConfig(store_dir=config.store.store_dir)
    assert config_from_mapping(DLedgerNodeConfig, {"dledger": _DLEDGER}).byte_log_segment_size_bytes == 64 << 20


@pytest.mark.parametrize("value", ["", "  "])
@pytest.mark.parametrize("key", ["store.store_dir", "dledger.data_dir"])
def test_an_empty_broker_path_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError) as error:
        _broker(**{key: value})
    assert str(error.value) == (f"{key} must be a non-empty path (an empty one means the current directory), "
                                f"got {value!r}")


def test_an_empty_store_dir_from_the_command_line_is_refused():
    # `raftmq broker --config F --set 'store.store_dir=""'` (a TOML empty string) and `--set store.store_dir=`.
    for pair in ['store.store_dir=""', "store.store_dir="]:
        with pytest.raises(ConfigError, match=r"^store\.store_dir must be a non-empty path"):
            load_broker_config(None, {**parse_overrides([pair]), "dledger": _DLEDGER})


def test_an_empty_dledger_node_data_dir_is_refused(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('state_machine = "byte_log"\n[dledger]\ngroup = "broker-a"\nself_id = "n1"\n'
                    'secret = "0123456789abcdef-secret"\ndata_dir = ""\n'
                    'members = [{id = "n1", raft_address = "127.0.0.1:20001", service_address = "127.0.0.1:10001"}]\n')
    with pytest.raises(ConfigError, match=r"^dledger\.data_dir must be a non-empty path \(an empty one means the "
                                          r"current directory\), got ''$"):
        load_config(DLedgerNodeConfig, path)


def test_an_empty_path_built_directly_is_refused_as_a_loaded_one_is():
    with pytest.raises(ConfigError, match=r"^store_dir must be a non-empty path .*, got ''$"):
        StoreConfig(store_dir="")
    with pytest.raises(ConfigError, match=r"^data_dir must be a non-empty path .*, got ''$"):
        DLedgerConfig(**{**_DLEDGER, "members": (), "self_id": "n1", "data_dir": ""})


def test_the_current_directory_named_as_such_is_still_taken():
    assert str(_broker(**{"store.store_dir": "."}).store.store_dir) == "."


def test_bench_store_refuses_an_empty_dir(tmp_path, monkeypatch, capsys):
    from raftmq.cli import main

    monkeypatch.chdir(tmp_path)  # without the check the store went here
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "store", "--dir", "", "--messages", "1", "--modes", "ASYNC_FLUSH", "--segment-size-mb", "8"])
    assert exit_info.value.code == 2
    assert ("--dir must name a directory (an empty one means the current directory), got ''"
            in capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key, value, bound", [
    ("request_timeout_ms", 2 ** 64, 3_600_000), ("poll_name_server_interval_ms", 2 ** 64, 3_600_000),
    ("max_frame_size_bytes", 2 ** 40, 256 * 1024 * 1024), ("pull_threshold_for_queue", 70_000, 65_535),
    # The broker refused every send-back of a member asking for more than a Java int, INVALID_REQUEST.
    ("max_reconsume_times", 2 ** 40, 2 ** 31 - 1),
])
def test_a_client_key_past_its_bound_is_refused_naming_it(key, value, bound):
    with pytest.raises(ConfigError, match=f"^{key} must be <= {bound}, got {value}$"):
        PushConsumerConfig(**{key: value})
    assert getattr(PushConsumerConfig(**{key: bound}), key) == bound


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_offset_store_dir_is_refused(value):
    # A BROADCASTING member kept its offset files in the current directory.
    with pytest.raises(ConfigError, match="offset_store_dir must name a directory"):
        PushConsumerConfig(offset_store_dir=value)
