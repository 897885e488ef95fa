"""The shared TOML → frozen dataclass loader: every mistake a user can make is named with key and value."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from remoting.config import ConfigError, bounded, config_from_mapping, load_config, parse_host_port


@dataclasses.dataclass(frozen=True)
class Inner:
    segment_size_bytes: int = bounded(1 << 30, min=4096)
    flush_disk_type: Literal["ASYNC_FLUSH", "SYNC_FLUSH"] = "ASYNC_FLUSH"


@dataclasses.dataclass(frozen=True)
class Outer:
    listen: str = "127.0.0.1:9876"
    ratio: float = bounded(0.75, min=0.0, max=1.0)
    enabled: bool = True
    peers: tuple[str, ...] = ()
    data_dir: Path = Path("data")
    name: str = bounded("a", check=lambda v: None if v.isidentifier() else "must be an identifier")
    store: Inner = dataclasses.field(default_factory=Inner)


def test_defaults_without_a_file():
    assert load_config(Outer) == Outer()


def test_file_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('ratio = 0.5\npeers = ["a:1", "b:2"]\ndata_dir = "/x"\n[store]\nsegment_size_bytes = 8192\n')
    cfg = load_config(Outer, path, overrides={"store.flush_disk_type": "SYNC_FLUSH"})
    assert cfg.ratio == 0.5 and cfg.peers == ("a:1", "b:2") and cfg.data_dir == Path("/x")
    assert cfg.store == Inner(segment_size_bytes=8192, flush_disk_type="SYNC_FLUSH")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ratio = 1.0  # type: ignore[misc]
    # An override through a value, not a table, was a TypeError traceback from `raftmq broker --set`.
    with pytest.raises(ConfigError, match="config key 'ratio.x': 'ratio' is a value, not a table"):
        load_config(Outer, path, overrides={"ratio.x": 1})


@pytest.mark.parametrize("data, message", [
    ({"ratoi": 0.5}, "unknown config key 'ratoi'"),
    ({"store": {"segment_size": 1}}, "unknown config key 'store.segment_size'"),
    ({"ratio": 1.5}, "ratio must be <= 1.0, got 1.5"),
    ({"ratio": "high"}, "ratio must be a number, got 'high'"),
    ({"ratio": float("nan")}, "ratio must be a number, got nan"),
    # mkdir raised "ValueError: embedded null byte" as a traceback once the node started.
    ({"data_dir": "/x\x00y"}, "data_dir must be a path without a NUL character, got '/x\\x00y'"),
    ({"enabled": 1}, "enabled must be true or false, got 1"),
    ({"store": {"segment_size_bytes": -1}}, "store.segment_size_bytes must be >= 4096, got -1"),
    ({"store": {"segment_size_bytes": True}}, "store.segment_size_bytes must be an integer, got True"),
    ({"store": {"flush_disk_type": "SOMETIMES"}},
     "store.flush_disk_type must be one of 'ASYNC_FLUSH', 'SYNC_FLUSH', got 'SOMETIMES'"),
    ({"peers": "a:1"}, "peers must be a list, got 'a:1'"),
    ({"peers": ["a:1", 2]}, "peers[1] must be a string, got 2"),
    ({"name": "not an id"}, "name must be an identifier, got 'not an id'"),
    ({"store": 3}, "store must be a table, got 3"),
])
def test_bad_values_are_named(data, message):
    with pytest.raises(ConfigError) as info:
        config_from_mapping(Outer, data)
    # Unknown keys also list the known ones; everything else is the whole sentence.
    assert str(info.value) == message or str(info.value).startswith(message + " (known keys: ")


def test_nan_is_refused_from_a_file(tmp_path):
    # TOML's `nan` passed every bound (each comparison with NaN is False) and reached the services.
    path = tmp_path / "c.toml"
    path.write_text("ratio = nan\n")
    with pytest.raises(ConfigError, match="^ratio must be a number, got nan$"):
        load_config(Outer, path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("ratio = = 1")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(Outer, bad)


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:9876", ("127.0.0.1", 9876)), ("localhost:0", ("localhost", 0)), ("[::1]:10911", ("::1", 10911)),
])
def test_parse_host_port(text, expected):
    assert parse_host_port(text) == expected


# int() took the ones after host:70000 as ports; a broker advertising "h:+5" was then refused by every name server,
# which routes only addresses written as HOST:PORT exactly.
@pytest.mark.parametrize("text", ["9876", ":9876", "host:port", "host:70000", 5, "h:+5", "h: 5", "h:1_0", "h:05",
                                  "h:\u0663", "h:"])
def test_parse_host_port_rejects(text):
    with pytest.raises(ConfigError):
        parse_host_port(text, key="listen")


# One rule and one sentence for every address that is dialed (name servers, peers, a node's advertised port): port
# 0 only tells a listening server to pick a free port, and each of six places refused it in its own words.
def test_parse_host_port_refuses_port_0_only_where_the_address_is_dialed():
    assert parse_host_port("127.0.0.1:0", key="listen") == ("127.0.0.1", 0)
    assert parse_host_port("127.0.0.1:1", key="--addr", dial=True) == ("127.0.0.1", 1)
    with pytest.raises(ConfigError, match=r"^--addr needs a fixed port \(it is dialed; port 0 only tells a listening "
                                          r"server to pick any free one\), got '127.0.0.1:0'$"):
        parse_host_port("127.0.0.1:0", key="--addr", dial=True)


# Host names getaddrinfo cannot be given (idna refuses them): `raftmq broker --set listen=a..b:10911` was a
# UnicodeError traceback at bind, after the store was opened.
@pytest.mark.parametrize("host", ["a..b", ".a", "a" * 64, "h\udcff", "a\x00b"])
def test_parse_host_port_rejects_a_host_that_cannot_be_looked_up(host):
    with pytest.raises(ConfigError, match="^listen must name a host that can be looked up"):
        parse_host_port(f"{host}:10911", key="listen")
    assert parse_host_port("r\u00e9seau.example:10911") == ("r\u00e9seau.example", 10911)
