"""Frozen-dataclass configuration loaded from TOML, shared by every process kind.

Each process kind (name server, broker, ...) declares one frozen dataclass whose fields carry their defaults and,
through ``field(metadata=...)``, their bounds. ``load_config`` builds it from a TOML file or a mapping and rejects
what a user could get wrong with a sentence that names the key and the value: unknown keys (a misspelt option
must never be silently ignored), wrong types, values out of bounds. Nested dataclasses are TOML tables.

Metadata keys understood on a field: ``min`` / ``max`` (inclusive numeric bounds), ``choices`` (allowed values),
``check`` (a callable returning an error sentence or None) and ``doc`` (one line shown in errors and docs).

A config dataclass calls ``check_fields(self)`` first in its ``__post_init__``, so one built directly in Python
(``PushConsumerConfig(instance_name="a/b")``, ``StoreConfig(flush_disk_type="SYNC")``) is refused with the
sentence a TOML file with that value gets, for its type as for its bounds. The loader checks each value too,
before building, so that a nested table's error names the full key (``store.segment_size_bytes``). Configs are
built once per process or client, never per message.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["ConfigError", "replace_file", "load_config", "read_config_data", "config_from_mapping", "apply_overrides", "bounded",
           "check_fields", "check_field", "read_named_file", "check_text", "parse_host_port", "name_problem",
           "metrics_listen_problem", "blank_dir_problem"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or option is wrong; the message names the key and the value."""


def bounded(default: Any, *, min: Any = None, max: Any = None, choices: Any = None, check: Any = None,
            doc: str = "") -> Any:
    """A dataclass field with validation metadata (see the module docstring)."""
    meta = {"min": min, "max": max, "choices": tuple(choices) if choices is not None else None,
            "check": check, "doc": doc}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_fields(config: Any) -> None:
    """Check every field of a config dataclass against its type, as the loader does (``Literal`` choices, bool
    not int, str not number, NaN), and its ``bounded`` metadata (see the module docstring)."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        _convert(hints[field.name], value, field.name)  # only for its refusal: the value is kept as given
        _check(field, value, field.name)


def check_field(cls: type, name: str, value: Any) -> None:
    """Judge ``value`` as ``check_fields`` judges field ``name`` of config class ``cls``, its type and its
    ``bounded`` metadata, without building a whole config: for a tool that checks one value before it sends it to
    a server that builds the config (``raftmq admin update-broker-config``). Checks across fields are not made."""
    field = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if field is None:
        raise ConfigError(f"unknown config key {name!r}")
    _convert(typing.get_type_hints(cls)[name], value, name)
    _check(field, value, name)


def check_text(name: str, value: str) -> str:
    """``value`` if it is text that can be encoded as UTF-8, else the ConfigError naming ``name`` (an option, an
    argument, a variable) and the bytes. A shell passes bytes that are not UTF-8 as surrogate escapes, which went
    on until something encoded them (CBOR, the ACL signature, a TOML file) and raised a UnicodeEncodeError there."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        try:
            shown = repr(value.encode("utf-8", errors="surrogateescape"))
        except UnicodeEncodeError:  # a surrogate no shell produces (from Python, or an escape in a file)
            shown = repr(value)
        raise ConfigError(f"{name} must be UTF-8 text, got the bytes {shown}") from None
    return value


NAME_MAX_LENGTH = 127


def blank_dir_problem(value: str) -> str | None:
    """What is wrong with a directory named by an empty or blank text, for a ``str`` option or key (``Path`` keys
    are checked where they are converted): ``Path("")`` is the current directory, where the files then landed."""
    return "must name a directory (an empty one means the current directory)" if not value.strip() else None


def name_problem(value: str) -> str | None:
    """What is wrong with a cluster, group (broker) or member name, None if nothing. ASCII only: the name servers
    refuse every registration of a node whose names stray outside ``[a-zA-Z0-9_-]{1,127}``, and
    ``str.isalnum`` alone took "é" and "٣"."""
    if value and len(value) <= NAME_MAX_LENGTH and value.isascii() and all(c.isalnum() or c in "-_" for c in value):
        return None
    return f"must be letters, digits, - or _ (ASCII, 1 to {NAME_MAX_LENGTH} characters)"


def parse_host_port(value: str, *, key: str = "address", dial: bool = False) -> tuple[str, int]:
    """``"127.0.0.1:9876"`` → ``("127.0.0.1", 9876)``; port 0 means "any free port" to a listener. ``dial``: the
    address is connected to (a name server, a peer, a node), or names the port others connect to, so port 0 is
    refused: it was dialled and came back as a refused connection."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{key} must look like HOST:PORT, got {value!r}")
    host, _, port_text = value.rpartition(":")
    host = host.strip("[]")
    if not host:
        raise ConfigError(f"{key} must name a host, got {value!r}")
    # What getaddrinfo is given: a host name with an empty or 64+-character label, or a character that is not text
    # (a surrogate escape from a non-UTF-8 command line), raised a UnicodeError traceback at bind or dial.
    try:
        if "\x00" in host:
            raise UnicodeError("a NUL character")
        host.encode("idna")
    except UnicodeError as e:
        raise ConfigError(f"{key} must name a host that can be looked up ({e.__cause__ or e}), got {value!r}") from None
    # Plain decimal digits only: int() also takes "+5", " 5", "1_0", "05" and other scripts' digits, and the name
    # servers refuse a broker address that is not written as HOST:PORT exactly (every registration refused).
    if not (port_text.isascii() and port_text.isdigit()) or (len(port_text) > 1 and port_text[0] == "0"):
        raise ConfigError(f"{key} must end in a numeric port (decimal digits, no sign or leading zero), got {value!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key} port must be within 0..65535, got {port}")
    if dial and port == 0:
        raise ConfigError(f"{key} needs a fixed port (it is dialed; port 0 only tells a listening server to pick "
                          f"any free one), got {value!r}")
    return host, port


def metrics_listen_problem(value: str) -> str | None:
    """The ``metrics_listen`` key of a server's config: empty (no metrics endpoint, the default) or HOST:PORT to
    serve ``/metrics`` on (port 0: any free port, printed in the ready line). Raises the ConfigError naming it."""
    if value:
        parse_host_port(value, key="metrics_listen")
    return None


def replace_file(path: Path, data: bytes) -> None:
    """Replace the file at ``path`` whole with ``data``: written beside it, fsynced, renamed over it, then its
    directory fsynced, so a crash at any point leaves the old file or the new one, never a part of one (a failed
    write removes its partial copy and raises)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_named_file(label: str, path: str | Path, *, missing: str = "") -> bytes:
    """The bytes of ``path``, or the ConfigError a CLI prints as one line, naming the file by ``label`` (``config
    file``, ``ACL file``, ``tls_cert_file``...): missing (``missing`` adds what to do), a directory, or unreadable
    (a NUL in the name too). ``open`` and ``read_bytes`` raised these as tracebacks."""
    name = str(path)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"{label} {name!r} does not exist{missing}") from None
    except IsADirectoryError:
        raise ConfigError(f"{label} {name!r} is a directory, not a file") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise ConfigError(f"{label} {name!r} cannot be read: {getattr(e, 'strerror', None) or e}") from None


def load_config(cls: type[T], path: str | Path | None = None, *, overrides: Mapping[str, Any] | None = None) -> T:
    """Read ``path`` (TOML) into ``cls``; ``overrides`` (dotted keys, e.g. ``{"store.segment_size_bytes": 1}``)
    win over the file. With no path the defaults apply."""
    return config_from_mapping(cls, read_config_data(path, overrides=overrides))


def read_config_data(path: str | Path | None = None, *, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tables ``load_config`` builds a config from: ``path`` read as TOML, ``overrides`` applied."""
    data: dict[str, Any] = {}
    if path is not None:
        name = str(path)
        if not name.strip():  # the CLI passes --config as given: as a Path, '' had become '.', "a directory"
            raise ConfigError(f"config file must be named, got {name!r}")
        # Every way a file cannot be read as TOML text is one ConfigError naming it (the CLI's one line and exit
        # 2): a directory, an unreadable file or bytes that are not UTF-8 raised from open/tomllib as tracebacks.
        raw = read_named_file("config file", path)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {name!r} is not valid TOML: not UTF-8 text (byte {e.start})") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {name!r} is not valid TOML: {e}") from None
    apply_overrides(data, overrides or {})
    return data


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """Set each dotted key of ``overrides`` in ``data`` (tables made as needed); a key that goes through a value
    that is not a table is a ConfigError naming both."""
    for dotted, value in overrides.items():
        target = data
        *parents, leaf = dotted.split(".")
        for i, part in enumerate(parents):
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"config key {dotted!r}: {'.'.join(parents[:i + 1])!r} is a value, not a table")
        target[leaf] = value


def config_from_mapping(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a table, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix + unknown[0]!r} (known keys: {', '.join(sorted(fields))})")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = prefix + name
        kwargs[name] = _convert(hints[name], value, key)
        _check(fields[name], kwargs[name], key)
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from None
    return obj


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):  # built directly: its own __post_init__ checked it
            return value
        return config_from_mapping(hint, value, prefix=key + ".")  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(args) != len(typing.get_args(hint)):
            return None
        errors = []
        for arg in args:
            try:
                return _convert(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        (item_hint, *_) = typing.get_args(hint) or (Any,)
        items = [_convert(item_hint, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a table, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        # TOML has `nan`, and NaN passes every min/max and cross-field comparison (all False): a NaN
        # tick_interval_ms crashed the tick loop, a NaN gil_switch_interval_ms set a 292,000-year switch interval
        # and a NaN file_reserved_hours kept every segment forever. Infinity stays for the bounds to judge.
        if math.isnan(value):
            raise ConfigError(f"{key} must be a number, got nan")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    if isinstance(hint, type) and issubclass(hint, Path):
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"{key} must be a path string, got {value!r}")
        # TOML's "\u0000" is a valid string but no valid path: mkdir raised "embedded null byte" as a traceback.
        if "\x00" in str(value):
            raise ConfigError(f"{key} must be a path without a NUL character, got {value!r}")
        # Checked here, before Path() turns "" into "." and no check can tell the two apart: an empty store_dir or
        # data_dir (`--set 'store.store_dir=""'`) put the commit log or raft.journal in the current directory.
        # Blank too: "  " made a directory named by spaces there. "." still names the current directory.
        if isinstance(value, str) and not value.strip():
            raise ConfigError(f"{key} must be a non-empty path (an empty one means the current directory), "
                              f"got {value!r}")
        return Path(value)
    return value


def _check(field: dataclasses.Field, value: Any, key: str) -> None:
    meta = field.metadata
    if not meta or value is None:
        return
    lo, hi, choices, check = meta.get("min"), meta.get("max"), meta.get("choices"), meta.get("check")
    if lo is not None and value < lo:
        raise ConfigError(f"{key} must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} must be <= {hi}, got {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    if check is not None:
        problem = check(value)
        if problem:
            raise ConfigError(f"{key} {problem}, got {value!r}")
