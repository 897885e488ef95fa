"""The name server's configuration: one frozen dataclass, loaded from TOML by ``remoting.config.load_config``.

Defaults are RocketMQ's: a node silent for two minutes is evicted, and the table is scanned every five seconds.
"""

from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path
from typing import Any

from remoting.config import ConfigError, bounded, check_fields, load_config, metrics_listen_problem, parse_host_port
from remoting.tls import TLS_MODES, server_context_for_mode

__all__ = ["NamesrvConfig", "load_namesrv_config"]


def _check_listen(value: str) -> str | None:
    try:
        parse_host_port(value, key="listen")
    except ConfigError:
        return "must look like HOST:PORT with a port within 0..65535"
    return None


@dataclasses.dataclass(frozen=True)
class NamesrvConfig:
    listen: str = bounded("127.0.0.1:9876", check=_check_listen,
                          doc="address to listen on; port 0 picks a free port")
    metrics_listen: str = bounded("", check=metrics_listen_problem,
                                  doc="HOST:PORT to serve Prometheus metrics on (GET /metrics); empty: none")
    broker_expired_ms: int = bounded(120_000, min=1, max=86_400_000,
                                     doc="a node silent this long is evicted from routes, unless its registration "
                                         "carries its own heartbeat_timeout_ms (every raftmq broker's does)")
    scan_interval_ms: int = bounded(5_000, min=1, max=3_600_000, doc="how often silent nodes are looked for")
    max_frame_size_bytes: int = bounded(16 * 1024 * 1024, min=1024, max=1 << 30,
                                        doc="a bigger frame closes its connection")
    # RocketMQ's tls.server.mode and its files (remoting/tls.py; docs/operations.md, "TLS").
    tls_mode: str = bounded("disabled", choices=TLS_MODES,
                            doc="disabled: plain TCP; enforcing: TLS only; permissive: both on one port")
    tls_cert_file: str = bounded("", doc="PEM certificate chain this server presents (tls_mode not disabled)")
    tls_key_file: str = bounded("", doc="PEM private key of tls_cert_file")
    tls_ca_file: str = bounded("", doc="PEM CA certificates client certificates are checked against")
    tls_need_client_auth: bool = bounded(False, doc="clients must present a certificate signed by tls_ca_file")

    def __post_init__(self) -> None:
        check_fields(self)
        self.tls_server_context()  # the files read and checked at start: a ConfigError naming the key at fault

    def tls_server_context(self) -> ssl.SSLContext | None:
        """What ``serve_remoting`` takes as ``tls_context``: None with tls_mode "disabled". The one built when the
        config was checked, until a file it reads changes (remoting/tls.py)."""
        return server_context_for_mode(self.tls_mode, self.tls_cert_file, self.tls_key_file, self.tls_ca_file,
                                       self.tls_need_client_auth)

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_host_port(self.listen, key="listen")


def load_namesrv_config(path: str | Path | None = None, *, listen: str | None = None,
                        metrics_listen: str | None = None) -> NamesrvConfig:
    """The TOML file at ``path`` (defaults without one), with ``--listen`` and ``--metrics-listen`` winning over
    the file."""
    overrides: dict[str, Any] = {}
    if listen is not None:
        overrides["listen"] = listen
    if metrics_listen is not None:
        overrides["metrics_listen"] = metrics_listen
    return load_config(NamesrvConfig, path, overrides=overrides)
