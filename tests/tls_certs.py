"""Certificates made at test time with ``trustme`` (none are committed): a CA, a server certificate for loopback
signed by it, a client certificate, and a second CA that signed neither."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import trustme


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    ca_file: Path
    cert_file: Path  # for 127.0.0.1 and localhost, signed by ca_file
    key_file: Path
    client_cert_file: Path  # signed by ca_file
    client_key_file: Path
    other_ca_file: Path  # signed none of the above


def make_tls_files(directory: Path) -> TLSFiles:
    directory.mkdir(parents=True, exist_ok=True)
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@raftmq.test")
    files = TLSFiles(*(directory / name for name in ("ca.pem", "server.pem", "server.key", "client.pem",
                                                     "client.key", "other-ca.pem")))
    ca.cert_pem.write_to_path(str(files.ca_file))
    server.private_key_pem.write_to_path(str(files.key_file))
    files.cert_file.write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    client.private_key_pem.write_to_path(str(files.client_key_file))
    files.client_cert_file.write_bytes(b"".join(blob.bytes() for blob in client.cert_chain_pems))
    other.cert_pem.write_to_path(str(files.other_ca_file))
    return files
