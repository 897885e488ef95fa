"""The ``raftmq`` command: one argparse tree, one module per sub-command.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its parser and sets
``func=run`` where ``run(args) -> int`` is the exit status. Only this module configures logging handlers.
Whatever the command: a bad argument is exit 2 (with ``--json``, for a command that takes it, also one JSON line:
``Parser``), Ctrl-C 130, and a reader of stdout that went away 141, without a traceback, even from inside trio.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from typing import NoReturn

from raftmq.runner import leaf_exceptions
from remoting.config import ConfigError, check_text

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C stopped
# What a shell reports for a process that SIGPIPE killed; Python ignores SIGPIPE and gets BrokenPipeError instead.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

# Each command's module, by the command it registers. Only the module of the command asked for is imported: a
# server started by `raftmq broker` would otherwise import every other command's dependencies too (the bench, the
# admin tables, rich, psutil), ~0.3 s of CPU at every start of every process, CLI calls included. The full list is
# imported only where it is needed: `raftmq --help`, or a command this table does not know (argparse's error
# names the valid ones).
COMMAND_MODULES = {
    "namesrv": "raftmq.commands.namesrv",
    "bench": "raftmq.commands.bench",
    "broker": "raftmq.commands.broker",
    "dev": "raftmq.commands.dev",
    "dledger-node": "raftmq.commands.dledger_node",
    "verify": "raftmq.commands.verify",
    "admin": "raftmq.commands.admin",
    "chaos": "raftmq.commands.chaos",
}


def command_in(argv: list[str]) -> str | None:
    """The command ``argv`` asks for, if it is one of ``COMMAND_MODULES``, found as argparse would: the first
    argument that is neither an option nor the value of ``--log-level``."""
    args = iter(argv)
    for arg in args:
        if arg == "--log-level":
            next(args, None)
        elif not arg.startswith("-"):
            return arg if arg in COMMAND_MODULES else None
    return None


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors keep ``--json``'s promise too: with ``json_errors`` set (``main`` sets
    it on every parser of a command run with ``--json``), a bad argument argparse itself refuses (``--read-queues
    abc``, a missing one) is also the one JSON line ``print_json_error`` prints, exit status 2, where a script
    reading stdout got nothing to parse. The usage and the message still go to stderr. The sub-commands' parsers
    are of this class too: ``add_subparsers`` makes them of its parser's class."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        if self.json_errors:
            from raftmq.bench.common import print_json_error

            print_json_error([message], 2)
        super().error(message)


def build_parser(command: str | None = None) -> Parser:
    """The parser of every command, or of ``command`` only."""
    parser = Parser(prog="raftmq", description="RocketMQ's architecture on Raft groups, in Python.")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level (default INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMAND_MODULES.items():
        if command is None or name == command:
            importlib.import_module(module).register(subparsers)
    return parser


# Arguments whose text is taken as bytes, whatever the shell passed: send-message's --body (admin_messages encodes
# it back with surrogateescape). Every other text argument must be UTF-8 (check_text_args).
BYTES_ARGS = frozenset({"body"})


def _flag(action: argparse.Action) -> str:
    """How the usage names an argument: its long option, else its metavar or dest (``--value``, ``TOPIC``)."""
    if action.option_strings:
        return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
    return action.metavar if isinstance(action.metavar, str) else action.dest.upper()


def check_text_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, naming it, a text argument of the command ``args`` holds that is not UTF-8 (``check_text``): every
    command's and sub-command's, names, keys, values and paths alike, so none reaches a codec, a signature or a
    file written for a child process as surrogate escapes. Done once here, for every command there is or will be,
    rather than by each command for the arguments it remembered."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is not None:
                check_text_args(chosen, args)
            continue
        if action.dest in BYTES_ARGS:
            continue
        value = getattr(args, action.dest, None)
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, (str, os.PathLike)):
                check_text(_flag(action), os.fspath(item))


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and the parsers of its sub-commands, however deep."""
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for chosen in action.choices.values():
                out += _parsers(chosen)
    return out


def _json_requested(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    """Whether ``argv``, which ``parser`` may yet refuse, runs a command that takes ``--json`` with ``--json``: an
    argument before any ``--`` that argparse reads as it (``--json``, or an abbreviation such as ``--js``), and a
    command whose parsers define it (a command without ``--json`` promises no JSON line)."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen = commands.choices.get(command_in(argv))
    if chosen is None or not any("--json" in a.option_strings for p in _parsers(chosen) for a in p._actions):
        return False
    options = argv[:argv.index("--")] if "--" in argv else argv
    return any(len(arg) > 2 and "--json".startswith(arg) for arg in options)


def _broken_pipe() -> int:
    """Whoever read our output went away (``raftmq admin topics | head -1``): nothing more to say, and no traceback
    for it. Points stdout at /dev/null so the interpreter's final flush does not fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(command_in(argv))
    if _json_requested(parser, argv):
        for each in _parsers(parser):
            each.json_errors = True
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_text_args(parser, args)
        return int(args.func(args) or 0)
    except ConfigError as e:
        if getattr(args, "json", False):  # the one JSON line --json promises, for a bad argument too
            from raftmq.bench.common import print_json_error
            print_json_error([str(e)], 2)
        parser.exit(2, f"raftmq: error: {e}\n")
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BaseExceptionGroup as group:
        # Ctrl-C inside trio.run comes out wrapped in the groups of the nurseries it went through, possibly beside
        # errors it caused (a connection closed under a task it cancelled): the user asked to stop, so 130 all
        # the same, not the traceback of a group that was neither all interrupts nor all errors.
        leaves = leaf_exceptions(group)
        if any(isinstance(e, KeyboardInterrupt) for e in leaves):
            return EXIT_INTERRUPTED
        # A print inside trio.run (a server's ready line, `raftmq dev`'s banner) to a reader that went away comes
        # out in the groups of the nurseries it went through. Only a group of nothing else is the quiet 141: the
        # tasks a closed pipe ends are cancelled, and Cancelled never leaves a nursery, so an error beside it is one
        # of its own (a child that failed to stop), which 141 without a word would hide; its traceback shows both.
        if all(isinstance(e, BrokenPipeError) for e in leaves):
            return _broken_pipe()
        raise
    except BrokenPipeError:
        return _broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
