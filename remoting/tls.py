"""TLS below the frame codec: the ``ssl.SSLContext``s servers and clients are configured with, and how a server in
``permissive`` mode tells a TLS connection from a plain one.

Rules (RocketMQ's ``tls.server.mode`` and ``tls.enable``, docs/operations.md "TLS"):

* A server runs in one of three modes. ``disabled``: plain TCP, as before TLS existed, at the same cost.
  ``enforcing``: every connection must complete a TLS handshake; a plain one is closed. ``permissive``: both on
  one port, told apart by the connection's first byte: 0x16 is the record type of a TLS handshake (the
  ClientHello), and a plain connection's first byte is the top byte of its first frame's length, 0x16 only for a
  frame of 352 MiB or more. A plain peer that sends a frame that large is taken for TLS and fails its handshake.
* Files are read and checked when the context is built, at start, so a missing file, a key that does not match its
  certificate or an unknown mode is a ``ConfigError`` naming the key and the file rather than a failed handshake
  on the first connection.
* A context is built once per settings and file versions (device, inode, size, modification time of each file it
  reads; the system's CA paths for a client without a CA file) and shared: a config checked at load and served at
  start reads its files once, and one that fails is refused again without reading them until a file changes.
  Shared contexts are never changed after they are built.
* A server's files are looked at again for each TLS connection it accepts, and a client's (a broker's, dialing its
  peers and the name servers; an application's) for each connection it makes (``ContextReloader``, a few ``stat``
  calls): a certificate or CA file replaced on disk, as RocketMQ's FileWatchService notices, is used by every
  connection from then on, and the connections open keep theirs. Replacements that do not load (a key written
  before its certificate) keep the last good context, with a WARNING once per change, until the files agree.
* A client verifies the server's certificate and name unless told not to (``verify=False``), which logs a WARNING
  each time a context is built: it gives encryption without authentication. Given a CA file, it trusts only that
  file's CAs, not the system's too.
* Keys are unencrypted: an encrypted one is a ``ConfigError`` at load, never a passphrase prompt on the terminal.
* A handshake is bounded (``HANDSHAKE_TIMEOUT_S``): a peer that connects and sends nothing must not hold a server
  task forever. Failures and timeouts close that connection with a WARNING; the server keeps serving.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path

from remoting.config import ConfigError, read_named_file

__all__ = ["HANDSHAKE_TIMEOUT_S", "TLS_HANDSHAKE_RECORD", "TLS_MODES", "ContextReloader", "client_context",
           "is_tls_start", "server_context", "server_context_for_mode"]

log = logging.getLogger(__name__)

TLS_MODES = ("disabled", "permissive", "enforcing")
# The TLS record content type "handshake": the first byte of every ClientHello.
TLS_HANDSHAKE_RECORD = 0x16
HANDSHAKE_TIMEOUT_S = 10.0


def is_tls_start(first: bytes) -> bool:
    """Whether a connection whose first bytes are ``first`` (at least one) opens with a TLS handshake."""
    if not first:
        raise ValueError("is_tls_start needs at least the connection's first byte")
    return first[0] == TLS_HANDSHAKE_RECORD


def _read_pem(key: str, path: str | Path, marker: str, what: str) -> None:
    """Refuse a file that is missing, unreadable or holds no PEM block of ``marker`` with a sentence naming it:
    OpenSSL's own error for all of these is "[SSL] PEM lib", which names neither the key nor the file."""
    name = str(path)
    if not name.strip():
        raise ConfigError(f"{key} must name a file, got {name!r}")
    text = read_named_file(key, path)
    if marker.encode() not in text:
        raise ConfigError(f"{key} {name!r} holds no PEM {what} (no '{marker}' line)")


def _load_chain(context: ssl.SSLContext, cert_file: str | Path, key_file: str | Path) -> None:
    _read_pem("tls_cert_file", cert_file, "-----BEGIN CERTIFICATE-----", "certificate")
    _read_pem("tls_key_file", key_file, "PRIVATE KEY-----", "private key")

    def refuse_encrypted() -> bytes:
        # Called by OpenSSL only for an encrypted key. Without a callback it asks for the passphrase on the
        # terminal (a broker started by hand, or a client's trio loop in ClientConfig(), blocks at load), or
        # fails with an opaque "PEM lib" when there is none. No key takes a passphrase: say so, and what to do.
        raise ConfigError(f"tls_key_file {str(key_file)!r} is encrypted (it asks for a passphrase): give an "
                          f"unencrypted key, readable only by the user the process runs as (openssl pkey -in "
                          f"ENCRYPTED.key -out PLAIN.key)")

    try:
        context.load_cert_chain(str(cert_file), str(key_file), password=refuse_encrypted)
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise ConfigError(f"tls_key_file {str(key_file)!r} is not the key of the certificate in tls_cert_file "
                              f"{str(cert_file)!r}") from None
        raise ConfigError(f"tls_cert_file {str(cert_file)!r} and tls_key_file {str(key_file)!r} cannot be loaded: "
                          f"{e}") from None


def _load_ca(context: ssl.SSLContext, ca_file: str | Path) -> None:
    _read_pem("tls_ca_file", ca_file, "-----BEGIN CERTIFICATE-----", "certificate")
    try:
        context.load_verify_locations(cafile=str(ca_file))
    except ssl.SSLError as e:
        raise ConfigError(f"tls_ca_file {str(ca_file)!r} cannot be loaded: {e}") from None


def server_context(cert_file: str | Path, key_file: str | Path, *, ca_file: str | Path | None = None,
                   need_client_auth: bool = False) -> ssl.SSLContext:
    """A server's context: its certificate chain and key; with ``need_client_auth``, clients must present a
    certificate signed by a CA in ``ca_file``. Raises ConfigError naming the key and file at fault. Built once per
    settings and file versions: do not change what it returns."""
    if need_client_auth and not ca_file:
        raise ConfigError("tls_need_client_auth needs tls_ca_file: the CA that client certificates are checked "
                          "against")
    settings = ("server", str(cert_file), str(key_file), str(ca_file or ""), need_client_auth)

    def build() -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_chain(context, cert_file, key_file)
        if ca_file:
            _load_ca(context, ca_file)
        context.verify_mode = ssl.CERT_REQUIRED if need_client_auth else ssl.CERT_NONE
        return context

    return _built_once(settings, (cert_file, key_file, ca_file), build)


def client_context(*, ca_file: str | Path | None = None, verify: bool = True, cert_file: str | Path | None = None,
                   key_file: str | Path | None = None) -> ssl.SSLContext:
    """A client's context: servers verified against ``ca_file`` only (the system's CAs without one) and by name, unless
    ``verify`` is False; ``cert_file``/``key_file`` are presented to servers that require client certificates. Built
    once per settings and file versions: do not change what it returns."""
    if bool(cert_file) != bool(key_file):
        given, missing = ("tls_cert_file", "tls_key_file") if cert_file else ("tls_key_file", "tls_cert_file")
        raise ConfigError(f"{given} is set but {missing} is not: a client certificate needs both")
    if not verify:
        # At every call, built or found: each client so configured is told, not only the first.
        log.warning("TLS server certificates are NOT verified (tls_verify = false): the connection is encrypted but "
                    "anyone on the path can pose as the server")
    files: tuple[str | Path | None, ...] = (ca_file, cert_file, key_file)
    settings: tuple[Hashable, ...] = ("client", str(ca_file or ""), verify, str(cert_file or ""), str(key_file or ""))
    if not ca_file:
        # The system's store is wherever $SSL_CERT_FILE / $SSL_CERT_DIR point now, else OpenSSL's default paths.
        system = ssl.get_default_verify_paths()
        settings += (system.cafile, system.capath)
        files += (system.cafile, system.capath)

    def build() -> ssl.SSLContext:
        if ca_file:
            # Only the CA file: create_default_context loads the system's CAs as well, and a server certified by any
            # of them would pass. PROTOCOL_TLS_CLIENT checks the name and requires a certificate, as that one does.
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            _load_ca(context, ca_file)
        else:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if not verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if cert_file and key_file:
            _load_chain(context, cert_file, key_file)
        return context

    return _built_once(settings, files, build)


def server_context_for_mode(mode: str, cert_file: str | Path, key_file: str | Path, ca_file: str | Path = "",
                            need_client_auth: bool = False) -> ssl.SSLContext | None:
    """A server config's ``tls_*`` keys as ``serve_remoting`` takes them: None for mode "disabled", else the
    context, its files read and checked now. Raises ConfigError naming the key at fault."""
    if mode not in TLS_MODES:
        raise ConfigError(f"tls_mode must be one of {', '.join(map(repr, TLS_MODES))}, got {mode!r}")
    if mode == "disabled":
        return None
    if not cert_file or not key_file:
        missing = " and ".join(k for k, v in (("tls_cert_file", cert_file), ("tls_key_file", key_file)) if not v)
        raise ConfigError(f"tls_mode {mode!r} needs {missing}: the server's certificate chain and private key")
    return server_context(cert_file, key_file, ca_file=ca_file or None, need_client_auth=need_client_auth)


# ------------------------------------------------------------------------- contexts built once per file versions

# Room for every distinct context a process asks for (a server's, its own client's; a test run's dozens) without
# holding on to those of files long replaced.
_CACHE_SIZE = 64
# Settings and file versions -> the context, or the ConfigError its build raised (refused again without a read).
_cache: OrderedDict[Hashable, ssl.SSLContext | ConfigError] = OrderedDict()
# Asked for from trio's thread, and from worker threads (a CLI command's trio.to_thread).
_cache_lock = threading.Lock()


def _file_version(path: str | Path | None) -> Hashable:
    """What tells that a file changed without reading it: one renamed over it (certbot, cert-manager, a Kubernetes
    secret's symlink swap) has another inode; one rewritten in place another size or change time (ctime also moves
    on chmod, so a file made readable is tried again). None: no file, or none to look at (the build says why)."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _built_once(settings: Hashable, files: tuple[str | Path | None, ...],
                build: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
    """The context ``build`` makes for ``settings`` and the present versions of ``files``: built on the first ask,
    found on the next ones until a file changes. Two threads asking at once may both build; either result is right."""
    key = (settings, tuple(_file_version(f) for f in files))
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
    if found is None:
        try:
            found = build()
        except ConfigError as e:
            found = e
        with _cache_lock:
            _cache[key] = found
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    if isinstance(found, ConfigError):
        raise ConfigError(str(found))  # a new one: raising the stored one would grow its traceback each time
    return found


class ContextReloader:
    """What ``serve_remoting`` calls for the context of each TLS connection it accepts, and a client pool for each
    it makes: ``build()`` (a config's ``tls_server_context`` or ``tls_client_context``, asked again each time)
    returns the context of the files as they are now, built only when one changed. A build that fails keeps the last
    good context and logs a WARNING once per failure; at construction it raises, so a process never starts on files
    that do not load."""

    def __init__(self, build: Callable[[], ssl.SSLContext | None]) -> None:
        context = build()
        if context is None:
            raise ValueError("ContextReloader needs a TLS context: this config has TLS off")
        self._build = build
        self._current = context
        self._problem: str | None = None

    def __call__(self) -> ssl.SSLContext:
        try:
            context = self._build()
        except ConfigError as e:
            if str(e) != self._problem:
                self._problem = str(e)
                log.warning("TLS files changed but do not load; new connections keep the previous certificate "
                            "reason=%s", e)
            return self._current
        if context is None:  # TLS on or off is fixed at start: a server cannot stop serving it under its clients
            return self._current
        if context is not self._current:
            log.info("TLS files changed: connections made or accepted from now on use the reloaded files")
            self._current = context
        self._problem = None
        return context
