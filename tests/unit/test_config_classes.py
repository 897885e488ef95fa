"""Every config dataclass of the project checks its fields when built, not only when loaded: one built directly in
Python (``PushConsumerConfig(instance_name="a/b")``, ``StoreConfig(flush_disk_type="SYNC")``) was taken as is,
while the same value in a TOML file or as an ``open_*`` option was refused. Both ways now give the same sentence,
for a value out of bounds and for one of the wrong type."""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from remoting.config import ConfigError, config_from_mapping

_DLEDGER = {"group": "broker-a", "self_id": "n0", "secret": "s" * 16,
            "members": [{"id": "n0", "raft_address": "127.0.0.1:20911", "service_address": "127.0.0.1:10911"}]}

# What each class needs besides its defaults to be built at all.
_BASE: dict[str, dict[str, Any]] = {
    "broker.config.BrokerConfig": {"dledger": _DLEDGER},
    "dledger.config.DLedgerConfig": _DLEDGER,
    "dledger.config.MemberAddress": {"id": "n0", "raft_address": "127.0.0.1:20911"},
    "raftmq.commands.dledger_node.DLedgerNodeConfig": {"dledger": _DLEDGER},
}

# A value each ``check=`` refuses (min, max and choices give theirs).
_REFUSED_BY_CHECK = {
    "cluster_name": "", "group": "", "id": "", "consumer_group": "", "producer_group": "", "instance_name": "a/b",
    "client_ip": "not an ip", "namesrv_addrs": ("127.0.0.1:0",), "listen": "", "delete_when_hours": (24,),
    "message_delay_level": "1s 5x", "metrics_listen": "127.0.0.1:99999", "offset_store_dir": "",
    "allocate_strategy": "AllocateMessageQueueNowhere", "trace_topic": "", "msg_trace_topic_name": "bad topic",
}


def _config_classes() -> dict[str, type]:
    """Every dataclass in our packages with a field declared by ``bounded``."""
    found = {}
    for package in ("broker", "client", "dledger", "namesrv", "remoting", "raftmq"):
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == info.name
                        and any("check" in f.metadata for f in dataclasses.fields(obj))):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def _refused_value(field: dataclasses.Field) -> Any:
    meta = field.metadata
    if meta["min"] is not None:
        return meta["min"] - 1
    if meta["max"] is not None:
        return meta["max"] + 1
    if meta["choices"] is not None:
        return "NO_SUCH_CHOICE"
    if meta["check"] is not None:
        assert field.name in _REFUSED_BY_CHECK, f"give _REFUSED_BY_CHECK a value {field.name}'s check refuses"
        return _REFUSED_BY_CHECK[field.name]
    return None


def test_the_config_classes_are_found():
    assert set(_config_classes()) >= {"broker.config.BrokerConfig", "broker.store.config.StoreConfig",
                                      "client.push_consumer_config.PushConsumerConfig", "namesrv.config.NamesrvConfig"}



def _assert_refused_alike(cls: type, base: dict, built: Any, key: str, value: Any) -> None:
    """``key = value`` is refused with the same sentence, naming the key, loaded (TOML) and built directly."""
    with pytest.raises(ConfigError) as loaded:
        config_from_mapping(cls, {**base, key: value})
    with pytest.raises(ConfigError) as direct:
        dataclasses.replace(built, **{key: value})
    assert str(direct.value) == str(loaded.value)
    assert str(direct.value).startswith(f"{key} ")

@pytest.mark.parametrize("name, cls", sorted(_config_classes().items()))
def test_a_config_built_directly_is_refused_as_a_loaded_one_is(name, cls):
    base = _BASE.get(name, {})
    built = config_from_mapping(cls, base)
    checked = [(f.name, _refused_value(f)) for f in dataclasses.fields(cls) if f.metadata]
    checked = [(key, value) for key, value in checked if value is not None]
    assert checked
    for key, value in checked:
        _assert_refused_alike(cls, base, built, key, value)


def _wrong_typed_values(hint: Any) -> list[Any]:
    """Values the loader refuses for a field of type ``hint``: another Literal choice, an int for a bool, a bool
    for an int, a number for a str, NaN for a float, ..."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        # Refused only if every option refuses it.
        first, *rest = [_wrong_typed_values(a) for a in typing.get_args(hint) if a is not type(None)]
        return [v for v in first if all(v in r for r in rest)]
    if origin is Literal:
        return ["NO_SUCH_CHOICE"]
    if origin in (tuple, list):
        return ["not a list", 7]
    if origin is dict or dataclasses.is_dataclass(hint):
        return ["not a table"]
    if hint is bool:
        return [1, "true"]
    if hint is int:
        return [True, "1", 1.0]
    if hint is float:
        return [math.nan, "1.5", False]
    if hint is str:
        return [1, b"x"]
    if hint is Path:
        return [1]
    return []


@pytest.mark.parametrize("name, cls", sorted(_config_classes().items()))
def test_a_config_built_directly_with_a_value_of_the_wrong_type_is_refused_as_a_loaded_one_is(name, cls):
    base = _BASE.get(name, {})
    built = config_from_mapping(cls, base)
    hints = typing.get_type_hints(cls)
    checked = [(f.name, value) for f in dataclasses.fields(cls) if f.init
               for value in _wrong_typed_values(hints[f.name])]
    assert checked
    for key, value in checked:
        _assert_refused_alike(cls, base, built, key, value)


def test_a_literal_field_built_directly_names_its_choices():
    from broker.store.config import StoreConfig

    with pytest.raises(ConfigError, match=r"^flush_disk_type must be one of 'ASYNC_FLUSH', 'SYNC_FLUSH', got 'SYNC'$"):
        StoreConfig(flush_disk_type="SYNC")
    assert StoreConfig(flush_disk_type="SYNC_FLUSH").flush_disk_type == "SYNC_FLUSH"
