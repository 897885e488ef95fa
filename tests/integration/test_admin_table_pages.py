"""The admin client's reading of a leader's topic or subscription group table (``AdminBase._leader_tables``) against
stand-in brokers: it pages with ``after`` / ``limit`` until ``next_after`` is null, with a ``limit`` its own frames
take; a broker from before paging (which ignores both and answers its whole table) still serves it; a
``next_after`` that does not move forward is a malformed answer, not a request asked again for ever."""

from __future__ import annotations

import functools

import cbor2
import pytest

from client import open_admin
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import BrokerSystemError
from remoting.transport import serve_remoting

CODE = RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG
TABLE = {f"g{i:03d}": {"group_name": f"g{i:03d}", "retry_max_times": i} for i in range(25)}


class PagingBroker:
    """Answers as this version's broker does, in pages of at most ``page`` entries; keeps every request's ext."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.asked: list[dict] = []

    async def handle(self, request, conn):
        ext = dict(request.ext)
        self.asked.append(ext)
        if "group_name" in ext:
            table = {ext["group_name"]: TABLE[ext["group_name"]]} if ext["group_name"] in TABLE else {}
            return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(
                {"data_version": 1, "subscription_groups": table, "next_after": None}))
        names = [n for n in sorted(TABLE) if n > ext["after"]][:min(self.page, ext["limit"])]
        more = names and names[-1] < max(TABLE)
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(
            {"data_version": 1, "subscription_groups": {n: TABLE[n] for n in names},
             "next_after": names[-1] if more else None}))


class OldBroker:
    """A broker from before paging: every ext field ignored, the whole table, no ``next_after``."""

    async def handle(self, request, conn):
        return make_response(request, ResponseCode.SUCCESS,
                             body=cbor2.dumps({"data_version": 1, "subscription_groups": TABLE}))


class StuckBroker:
    """Names the same ``next_after`` whatever it is asked."""

    async def handle(self, request, conn):
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(
            {"data_version": 1, "subscription_groups": {"g000": TABLE["g000"]}, "next_after": "g000"}))


async def _serve(nursery, handler) -> str:
    host, port = await nursery.start(functools.partial(serve_remoting, handler, "127.0.0.1", 0))
    return f"{host}:{port}"


async def test_pages_are_followed_to_the_end_with_a_limit_the_client_frames_take(nursery):
    broker = PagingBroker(page=10)
    addr = await _serve(nursery, broker)
    async with open_admin("127.0.0.1:1", max_frame_size_bytes=36 * 1024) as admin:
        tables = await admin._leader_tables({"broker-a": addr}, CODE, "subscription_groups")
        assert tables == {"broker-a": TABLE}
        limit = (36 * 1024 - 4096) // 1024
        assert broker.asked == [{"after": "", "limit": limit}, {"after": "g009", "limit": limit},
                                {"after": "g019", "limit": limit}]
        broker.asked.clear()
        tables = await admin._leader_tables({"broker-a": addr}, CODE, "subscription_groups", {"group_name": "g007"})
        assert tables == {"broker-a": {"g007": TABLE["g007"]}} and broker.asked == [{"group_name": "g007"}]


async def test_a_broker_from_before_paging_answers_its_whole_table(nursery):
    addr = await _serve(nursery, OldBroker())
    async with open_admin("127.0.0.1:1") as admin:
        tables = await admin._leader_tables({"broker-a": addr}, CODE, "subscription_groups")
        assert tables == {"broker-a": TABLE}
        # Named, the entry is still picked from the whole table it answers.
        tables = await admin._leader_tables({"broker-a": addr}, CODE, "subscription_groups", {"group_name": "g001"})
        assert tables["broker-a"]["g001"] == TABLE["g001"]


async def test_a_next_after_that_does_not_move_forward_is_a_malformed_answer(nursery):
    addr = await _serve(nursery, StuckBroker())
    async with open_admin("127.0.0.1:1") as admin:
        with pytest.raises(BrokerSystemError, match="malformed GET_ALL_SUBSCRIPTIONGROUP_CONFIG answer from broker "
                                                    "group 'broker-a': ValueError: next_after 'g000' is not a name "
                                                    "after 'g000'"):
            await admin._leader_tables({"broker-a": addr}, CODE, "subscription_groups")
