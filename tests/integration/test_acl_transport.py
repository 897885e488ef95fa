"""Where the client hooks ACL signing in (remoting.transport.RemotingClient, client.instance.open_remoting): every
request of a client with credentials is signed, oneway ones too; without, nothing is bound over the pool's methods."""

from __future__ import annotations

import cbor2
import trio

from client.instance import ClientConfig, open_remoting
from remoting.acl import ACCESS_KEY, SIGNATURE, request_signature
from remoting.codec import EncodedExt, make_request, make_response
from remoting.transport import open_remoting_client, serve_remoting


async def test_the_pool_signs_every_request_only_with_credentials():
    seen = []

    class Handler:
        async def handle(self, request, conn):
            seen.append(request)
            return make_response(request, 0)

    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve_remoting, Handler(), "127.0.0.1", 0)
        addr = f"{host}:{port}"
        async with open_remoting_client() as plain:
            # Nothing bound over the methods: the unsigned path is the class's own.
            assert "invoke" not in vars(plain) and "invoke_oneway" not in vars(plain)
            await plain.invoke(addr, make_request(34, {"a": 1}))
        config = ClientConfig(namesrv_addrs=(addr,), access_key="producer1", secret_key="secret-key")
        async with open_remoting(config) as signed:
            await signed.invoke(addr, make_request(34, EncodedExt(cbor2.dumps({"a": 1})), b"x"))
            await signed.invoke_oneway(addr, make_request(34, {"b": 2}, oneway=True))
            with trio.fail_after(5):
                while len(seen) < 3:
                    await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert ACCESS_KEY not in seen[0].ext
    for request in seen[1:]:
        assert request.ext[ACCESS_KEY] == "producer1"
        assert request.ext[SIGNATURE] == request_signature("secret-key", request)
