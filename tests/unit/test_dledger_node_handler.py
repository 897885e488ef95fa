"""``raftmq dledger-node``'s request handler answers NOT_LEADER as a broker does."""

from __future__ import annotations

import pytest

from dledger import NotLeaderError
from raftmq.commands.dledger_node import NodeHandler
from remoting.codec import FrameDecoder, encode, make_request
from remoting.codes import RequestCode, ResponseCode


class _Group:
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def append(self, record: bytes) -> None:
        raise self.error


class _Service:
    def handles(self, code: int) -> bool:
        return False


@pytest.mark.parametrize("leader_addr", [None, "127.0.0.1:30911"])
async def test_not_leader_names_the_leader_or_null_while_none_is_known(leader_addr: str | None) -> None:
    leader_id = "n1" if leader_addr else None
    handler = NodeHandler(_Group(NotLeaderError("g", leader_id, leader_addr)), _Service(), message_store=False)
    response = await handler.handle(make_request(RequestCode.SEND_MESSAGE, body=b"x"), conn=None)
    assert response.code == ResponseCode.NOT_LEADER
    # Through the wire: "" would read as an address to dial; null is "no leader known", as brokers send it.
    decoder = FrameDecoder()
    decoder.feed(encode(response))
    assert decoder.next_frame().ext["leader_addr"] == leader_addr
    assert ("no member yet" in response.remark) is (leader_addr is None)
