"""TCP keepalive on every remoting connection (``remoting.connection.KEEPALIVE_*``).

A client host that lost power or was cut off sends no FIN or RST, and a server connection waiting for its next
request sends nothing that could fail: it stayed ESTABLISHED forever, with its descriptor and tasks. Accepted and
dialled sockets, plain and TLS, now carry keepalive; on a lab network a vanished client's connection is closed
by the server once the (shortened) probes go unanswered.
"""

from __future__ import annotations

import functools
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from remoting import connection
from remoting.codec import make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.tls import client_context, server_context
from remoting.transport import open_connection, serve_remoting
from tests.netns import NetLab, require
from tests.tls_certs import make_tls_files

EXPECTED = {(socket.SOL_SOCKET, socket.SO_KEEPALIVE): 1, (socket.IPPROTO_TCP, socket.TCP_NODELAY): 1,
            (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE): 60, (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL): 10,
            (socket.IPPROTO_TCP, socket.TCP_KEEPCNT): 6}


class Recorder:
    """Answers ECHO and keeps the server's side of each connection it was asked on."""

    def __init__(self) -> None:
        self.connections: list[connection.RemotingConnection] = []

    async def handle(self, request, conn):
        self.connections.append(conn)
        return make_response(request, ResponseCode.SUCCESS, body=request.body)


def _options(conn: connection.RemotingConnection) -> dict[tuple[int, int], int]:
    stream = conn._stream
    sock = (stream.transport_stream if isinstance(stream, trio.SSLStream) else stream).socket
    return {key: sock.getsockopt(*key) for key in EXPECTED}


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_accepted_and_dialled_sockets_carry_keepalive(nursery, tmp_path, tls):
    handler = Recorder()
    files = make_tls_files(tmp_path) if tls else None
    server_tls = {"tls_mode": "enforcing", "tls_context": server_context(files.cert_file, files.key_file)} \
        if files else {}
    host, port = await nursery.start(functools.partial(serve_remoting, handler, "127.0.0.1", 0, **server_tls))
    client_tls = client_context(ca_file=files.ca_file) if files else None
    async with open_connection(f"{host}:{port}", tls_context=client_tls) as conn:
        assert (await conn.invoke(make_request(RequestCode.ECHO, body=b"x"))).body == b"x"
        (accepted,) = handler.connections
        assert isinstance(accepted._stream, trio.SSLStream) is tls and isinstance(conn._stream, trio.SSLStream) is tls
        assert _options(accepted) == EXPECTED
        assert _options(conn) == EXPECTED


# A remoting server in its own process (keepalive shortened to 1 s idle, 1 s apart, 2 probes) that prints a line when
# a connection is made and when one is closed.
SERVER = r'''
import sys, trio
sys.path.insert(0, sys.argv[2])
from remoting import connection
from remoting.codec import make_response
from remoting.codes import ResponseCode
from remoting.transport import serve_remoting
connection.KEEPALIVE_IDLE_S, connection.KEEPALIVE_INTERVAL_S, connection.KEEPALIVE_COUNT = 1, 1, 2

class Handler:
    async def handle(self, request, conn):
        print("answered", conn.remote_address, flush=True)
        return make_response(request, ResponseCode.SUCCESS)

    def connection_closed(self, conn):
        print("closed", conn.remote_address, flush=True)

async def main():
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_remoting, Handler(), sys.argv[1], 9876)
        print("ready", flush=True)

trio.run(main)
'''

# A client that asks once, then sits idle on its connection (as a name server's client does between requests).
CLIENT = r'''
import socket, sys, time
sys.path.insert(0, sys.argv[2])
from remoting.codec import FrameDecoder, NEED_DATA, encode, make_request
from remoting.codes import RequestCode
s = socket.create_connection((sys.argv[1], 9876))
s.sendall(encode(make_request(RequestCode.GET_BROKER_CLUSTER_INFO), opaque=1))
decoder = FrameDecoder()
while decoder.next_frame() is NEED_DATA:
    decoder.feed(s.recv(65536))
print("answered", flush=True)
time.sleep(600)
'''


def _lines(proc: subprocess.Popen, readers: list[threading.Thread]) -> queue.Queue[str]:
    """``proc``'s output lines as they come, to wait for one with a deadline (the reader ends with the process)."""
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line.strip()) for line in proc.stdout], daemon=True)
    reader.start()
    readers.append(reader)
    return lines


@pytest.mark.slow
def test_a_vanished_client_is_closed_by_the_server_once_its_probes_go_unanswered():
    require()
    lab = NetLab(["a", "b"])
    root = str(Path(__file__).resolve().parents[2])
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    try:
        server = subprocess.Popen(lab.argv("b", [sys.executable, "-c", SERVER, lab.ip["b"], root]),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(server)
        server_lines = _lines(server, readers)
        assert server_lines.get(timeout=30) == "ready"
        client = subprocess.Popen(lab.argv("a", [sys.executable, "-c", CLIENT, lab.ip["b"], root]),
                                  stdout=subprocess.PIPE, text=True)
        procs.append(client)
        assert client.stdout.readline().strip() == "answered"
        answered = server_lines.get(timeout=10).split()
        assert answered[0] == "answered", answered
        # The client's host drops off the network, then the client dies: its RST never arrives.
        lab.cut("a", "b")
        client.kill()
        client.wait(10)
        # Probes from 1 s on, the connection broken after ~3 s; without keepalive it waits for a request forever.
        try:
            while not (line := server_lines.get(timeout=60)).startswith("closed "):
                pass  # a log line
        except queue.Empty:
            pytest.fail("the server still holds the vanished client's connection after 60 s")
        assert line.split() == ["closed", answered[1]], line
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for reader in readers:
            reader.join(10)
        for proc in procs:
            proc.stdout.close()
        lab.close()
