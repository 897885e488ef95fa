"""A certificate replaced on disk while a name server runs (in-process, port 0): connections accepted afterwards get
the new one, the connection open keeps the old, and files that do not load yet keep the old one for new connections
too, until they agree."""

from __future__ import annotations

import os
import shutil

import pytest

from namesrv import NamesrvConfig, serve_namesrv
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import ConnectError
from remoting.tls import client_context
from remoting.transport import open_remoting_client
from tests.tls_certs import make_tls_files


def _replace(path, source):
    shutil.copy(source, path.with_suffix(".new"))
    os.replace(path.with_suffix(".new"), path)


async def _ask(client, addr):
    response = await client.invoke(addr, make_request(RequestCode.GET_BROKER_CLUSTER_INFO), timeout_s=10)
    assert response.code == ResponseCode.SUCCESS


async def _ask_once(addr, ca_file):
    async with open_remoting_client(tls_context=client_context(ca_file=ca_file)) as client:
        await _ask(client, addr)


async def test_a_name_server_serves_a_replaced_certificate_to_the_connections_after_it(nursery, tmp_path):
    one, two = make_tls_files(tmp_path / "one"), make_tls_files(tmp_path / "two")  # each signed by its own CA
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    shutil.copy(one.cert_file, cert)
    shutil.copy(one.key_file, key)
    config = NamesrvConfig(listen="127.0.0.1:0", tls_mode="enforcing", tls_cert_file=str(cert),
                           tls_key_file=str(key))
    host, port = await nursery.start(serve_namesrv, config)
    addr = f"{host}:{port}"
    async with open_remoting_client(tls_context=client_context(ca_file=one.ca_file)) as before:
        await _ask(before, addr)
        with pytest.raises(ConnectError, match="certificate verify failed"):
            await _ask_once(addr, two.ca_file)

        _replace(cert, two.cert_file)  # its key not yet: the first certificate still serves new connections
        await _ask_once(addr, one.ca_file)
        _replace(key, two.key_file)
        await _ask_once(addr, two.ca_file)
        with pytest.raises(ConnectError, match="certificate verify failed"):
            await _ask_once(addr, one.ca_file)
        await _ask(before, addr)  # the connection made before keeps its certificate
