"""A server command's ``--config FILE`` that cannot be read as TOML text: one line naming the file and exit 2,
as for a missing file or bad TOML, never a traceback (a directory, bytes that are not UTF-8, an unreadable
file raised from open/tomllib, exit 1)."""

from __future__ import annotations

import builtins

import pytest

from raftmq.cli import main

COMMANDS = ["namesrv", "broker", "dledger-node"]


def _run(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    return err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_directory_is_named(command, tmp_path, capsys):
    err = _run([command, "--config", str(tmp_path)], capsys)
    assert f"config file {str(tmp_path)!r} is a directory, not a file" in err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", ["", " "])
def test_an_empty_name_is_refused_as_itself(command, name, capsys):
    # Parsed as a Path, '' was '.': "config file '.' is a directory", naming a value nobody gave.
    assert f"config file must be named, got {name!r}" in _run([command, "--config", name], capsys)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_file_that_is_not_utf8_is_named(command, tmp_path, capsys):
    path = tmp_path / "binary.toml"
    path.write_bytes(b'listen = "\xff\xfe"\n')
    err = _run([command, "--config", str(path)], capsys)
    assert f"config file {str(path)!r} is not valid TOML: not UTF-8 text (byte 10)" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unreadable_file_is_named(command, tmp_path, capsys, monkeypatch):
    path = tmp_path / "secret.toml"
    path.write_text('listen = "127.0.0.1:0"\n')
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):  # chmod 000 does not stop root, who runs CI
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    err = _run([command, "--config", str(path)], capsys)
    assert f"config file {str(path)!r} cannot be read: Permission denied" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_file_is_still_named(command, tmp_path, capsys):
    err = _run([command, "--config", str(tmp_path / "nope.toml")], capsys)
    assert "does not exist" in err
