"""NamesrvConfig from TOML: defaults, overrides, and every mistake named with key and value."""

from __future__ import annotations

import dataclasses

import pytest

from namesrv.config import NamesrvConfig, load_namesrv_config
from remoting.config import ConfigError


def test_defaults_are_rocketmqs():
    cfg = load_namesrv_config()
    assert cfg == NamesrvConfig()
    assert cfg.listen_address == ("127.0.0.1", 9876)
    assert (cfg.broker_expired_ms, cfg.scan_interval_ms) == (120_000, 5_000)
    assert cfg.max_frame_size_bytes == 16 * 1024 * 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.listen = "x"  # type: ignore[misc]


def test_file_and_listen_override(tmp_path):
    path = tmp_path / "namesrv.toml"
    path.write_text('listen = "127.0.0.1:9000"\nbroker_expired_ms = 300\nscan_interval_ms = 50\n')
    cfg = load_namesrv_config(path)
    assert (cfg.listen, cfg.broker_expired_ms, cfg.scan_interval_ms) == ("127.0.0.1:9000", 300, 50)
    assert load_namesrv_config(path, listen="127.0.0.1:0").listen_address == ("127.0.0.1", 0)
    assert load_namesrv_config(path).metrics_listen == ""  # off unless asked for
    path.write_text('metrics_listen = "0.0.0.0:5557"\n')
    assert load_namesrv_config(path).metrics_listen == "0.0.0.0:5557"
    assert load_namesrv_config(path, metrics_listen="127.0.0.1:0").metrics_listen == "127.0.0.1:0"


@pytest.mark.parametrize("text, message", [
    ("broker_expire_ms = 5\n", "unknown config key 'broker_expire_ms'"),
    ("broker_expired_ms = 0\n", "broker_expired_ms must be >= 1, got 0"),
    ("scan_interval_ms = -5\n", "scan_interval_ms must be >= 1, got -5"),
    ('scan_interval_ms = "fast"\n', "scan_interval_ms must be an integer, got 'fast'"),
    ("max_frame_size_bytes = 10\n", "max_frame_size_bytes must be >= 1024, got 10"),
    ('listen = "localhost"\n', "listen must look like HOST:PORT"),
    ('listen = "127.0.0.1:70000"\n', "got '127.0.0.1:70000'"),
    ("listen = [\n", "is not valid TOML"),
    ('metrics_listen = "5557"\n', "metrics_listen must look like HOST:PORT, got '5557'"),
    ('metrics_listen = "127.0.0.1:65536"\n', "metrics_listen port must be within 0..65535, got 65536"),
    ("metrics_listen = 5557\n", "metrics_listen must be a string, got 5557"),
])
def test_bad_files_name_key_and_value(tmp_path, text, message):
    path = tmp_path / "namesrv.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_namesrv_config(path)


def test_missing_file_and_bad_listen_flag(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_namesrv_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="listen must look like HOST:PORT.*got 'nowhere'"):
        load_namesrv_config(listen="nowhere")
