"""``raftmq COMMAND`` imports only that command's module: every server process and CLI call starts that much
sooner, and a command whose dependencies are broken or missing cannot break the others."""

from __future__ import annotations

import subprocess
import sys

import pytest

from raftmq.cli import COMMAND_MODULES, build_parser, command_in, main
from tests.procs import REPO_ROOT


@pytest.mark.parametrize(("argv", "command"), [
    (["broker", "--config", "b.toml"], "broker"),
    (["--log-level", "WARNING", "admin", "cluster"], "admin"),
    (["--log-level=DEBUG", "dledger-node", "--config", "x"], "dledger-node"),
    (["--log-level", "admin"], None),     # "admin" is the level's value here (a bad one): argparse says so
    (["-h"], None), ([], None),
    (["nope", "broker"], None),           # an unknown command: the full parser names the valid ones
])
def test_the_command_is_found_where_argparse_finds_it(argv, command):
    assert command_in(argv) == command


def _commands_imported(expr: str) -> list[str]:
    code = ("import sys; from raftmq.cli import build_parser; " + expr + "; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('raftmq.commands.'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_a_server_command_imports_its_own_module_only():
    assert _commands_imported("build_parser('broker')") == ["raftmq.commands.broker"]
    assert _commands_imported("build_parser('namesrv')") == ["raftmq.commands.namesrv"]
    # the admin command's own parts are its, and nothing of the servers or the bench
    assert "raftmq.commands.bench" not in _commands_imported("build_parser('admin')")
    assert len(_commands_imported("build_parser()")) >= len(COMMAND_MODULES)


def test_every_command_is_registered_under_the_name_the_table_gives_it():
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them here
    assert set(commands) == set(COMMAND_MODULES)
    for name in COMMAND_MODULES:
        only = build_parser(name)._subparsers._group_actions[0].choices  # noqa: SLF001
        assert set(only) == {name}


def test_an_unknown_command_is_refused_naming_every_valid_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "WARNING", "nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err
    assert all(f"'{name}'" in err for name in COMMAND_MODULES)
