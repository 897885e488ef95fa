"""Frames under the size limit whose CBOR decodes to far more than their size, against servers in-process.

A 16 MiB header of ``[{}, {}, ...]`` decoded to 1.2 GB in 1.5 s before anything knew who sent it, and a body of
empty arrays to as much in 6 s: three such frames deposed a broker group's leader. Now the header is refused as a
bad frame from its length (that connection only), the body as INVALID_REQUEST naming ``body`` (the connection
lives on), and the server then serves a normal request.
"""

from __future__ import annotations

import struct

import cbor2
import trio

from remoting.codec import MAX_HEADER_SIZE, make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_connection, open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, start_namesrv, wait_leader

# Refused after its first 64 KiB; the bytes after them are never decoded.
DENSE_BODY = b"\x9f" + b"\x80" * (4 << 20) + b"\xff"
REGISTRATION = {"cluster_name": "DefaultCluster", "broker_name": "broker-a", "broker_id": 1,
                "broker_addr": "127.0.0.1:10911", "role": "LEADER", "term": 1, "data_version": 1}


async def _closed_by_peer(stream: trio.SocketStream) -> bytes:
    """What the peer sent before it closed the connection (a reset counts as closed)."""
    received = b""
    with trio.fail_after(10):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return received
            if not data:
                return received
            received += data


async def test_a_header_over_the_limit_closes_its_connection_and_the_name_server_serves_on(nursery):
    addr = await start_namesrv(nursery)
    host, port = addr.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    header_length = 16 * 1024 * 1024 - 64  # the frame fits in max_frame_size: only its header is too large
    assert header_length > MAX_HEADER_SIZE
    await stream.send_all(struct.pack(">II", 4 + header_length, header_length) + b"\xa5" + b"\xa0" * 65536)
    # Closed at once, answered nothing: without the limit the server waits for the other 16 MiB.
    assert await _closed_by_peer(stream) == b""
    await stream.aclose()
    async with open_connection(addr) as conn:
        assert (await conn.invoke(make_request(RequestCode.GET_BROKER_CLUSTER_INFO))).code == ResponseCode.SUCCESS


async def test_a_dense_registration_body_is_refused_and_the_connection_serves_on(nursery):
    addr = await start_namesrv(nursery)
    async with open_connection(addr) as conn:
        # A topic table of 65535 topics whose configs are empty maps: one map per 5 bytes.
        topics = b"\xb9\xff\xff" + b"".join(cbor2.dumps(f"t{i}") + b"\xa0" for i in range(65535))
        for body in (topics, DENSE_BODY):
            response = await conn.invoke(make_request(RequestCode.REGISTER_BROKER, ext=REGISTRATION, body=body))
            assert response.code == ResponseCode.INVALID_REQUEST and response.ext == {"field": "body"}
            assert "maps and arrays, more than the" in response.remark, response.remark
        good = {"TopicA": {"read_queue_nums": 4, "write_queue_nums": 4, "perm": 6}}
        response = await conn.invoke(make_request(RequestCode.REGISTER_BROKER, ext=REGISTRATION,
                                                  body=cbor2.dumps(good)))
        assert response.code == ResponseCode.SUCCESS, response.remark


async def test_a_dense_heartbeat_body_is_refused_and_the_broker_serves_on(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        heartbeat = {"client_id": "c1", "consumers": [{"consumer_group": "cg", "subscriptions": [{}] * 200_000}]}
        for body in (cbor2.dumps(heartbeat), DENSE_BODY[:3 << 20] + b"\xff"):
            r = await call(client, addr, RequestCode.HEART_BEAT, body=body)
            assert r.code == ResponseCode.INVALID_REQUEST and r.ext == {"field": "body"}, r.remark
            assert "maps and arrays, more than the" in r.remark, r.remark
        # Plain values within that bound still decode at ~20-50 ms a MiB on the thread that ticks Raft: a broker
        # decodes no data body past 4 MiB (16 MiB of them stalled a leader 0.8 s, and three deposed it).
        plain = cbor2.dumps({"client_id": "c1", "consumers": [], "padding": [0] * (5 << 20)})
        r = await call(client, addr, RequestCode.HEART_BEAT, body=plain, timeout_s=30)
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext == {"field": "body"}, r.remark
        assert f"is {len(plain)} bytes, more than the 4194304 a broker decodes" in r.remark, r.remark
        heartbeat["consumers"][0]["subscriptions"] = [{"topic": "TopicTest", "expression": "*"}]
        r = await call(client, addr, RequestCode.HEART_BEAT, body=cbor2.dumps(heartbeat))
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await call(client, addr, RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumer_group": "cg"})
        assert cbor2.loads(r.body)["consumer_id_list"] == ["c1"]


async def test_a_client_reads_an_answer_whose_header_is_past_the_request_bound(nursery):
    # A batch send's answer lists every message id in its header (33 bytes each): past 256 KiB for ~7,900 messages.
    # Refused by the client as a bad frame, the connection closed, the producer retried the stored batch till its
    # deadline: 17 copies stored, and the send failed.
    import functools

    from remoting.codec import make_response
    from remoting.transport import serve_remoting

    ids = ",".join(f"{i:032X}" for i in range(9_000))  # 9,000 message ids, 297 KB

    class Handler:
        async def handle(self, request, conn):
            return make_response(request, ResponseCode.SUCCESS, ext={"msg_id": ids})

    host, port = await nursery.start(functools.partial(serve_remoting, Handler(), "127.0.0.1", 0))
    async with open_remoting_client() as client:
        r = await client.invoke(f"{host}:{port}", make_request(RequestCode.SEND_BATCH_MESSAGE), timeout_s=10)
    assert len(ids) > MAX_HEADER_SIZE and r.code == ResponseCode.SUCCESS and r.ext["msg_id"] == ids
