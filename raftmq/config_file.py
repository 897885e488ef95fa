"""``check_config_file``: a server command's ``--config FILE`` is readable TOML text before it is parsed.

``remoting.config.load_config`` names a missing file and bad TOML, but a directory, an unreadable file or one
that is not UTF-8 raised from ``open``/``tomllib`` as a traceback (exit 1). Every server command (``namesrv``,
``broker``, ``dledger-node``) checks its file here first, so each such mistake is one ConfigError naming the
file: the CLI turns it into ``raftmq: error: ...`` and exit 2.
"""

from __future__ import annotations

from pathlib import Path

from remoting.config import ConfigError

__all__ = ["check_config_file"]


def check_config_file(path: str | Path | None) -> None:
    """Raise ConfigError naming ``path`` unless it is a readable file of UTF-8 text (None: no file, fine)."""
    if path is None:
        return
    name = str(path)
    try:
        with open(path, "rb") as f:
            f.read().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {name!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {name!r} is a directory, not a file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {name!r} is not valid TOML: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {name!r} cannot be read: {e.strerror or e}") from None
