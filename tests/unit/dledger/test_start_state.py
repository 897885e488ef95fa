"""The start state travels from a peer that deleted the start of its log to an empty member's ``start_at``: the
peer's ``DLedgerService`` answers FETCH_COMMIT_LOG's PULL_OFFSET_MOVED with its state machine's
``start_state(min_offset)``, ``remote_fetch_range`` raises it in ``CommitLogMovedError``, and ``CatchUp`` hands it
to the empty state machine's ``start_at``. dledger never looks inside it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import trio

from dledger.catch_up import CatchUp
from dledger.config import MemberAddress
from dledger.errors import CommitLogMovedError
from dledger.service import CatchUpDataError, DLedgerService, remote_fetch_range
from remoting.codes import ResponseCode

SECRET = "a group secret of twenty-four"
SEGMENT = 1000
PEER = MemberAddress(id="n1", raft_address="127.0.0.1:10001", service_address="127.0.0.1:10002")


class _Trimmed:
    """A peer's state machine whose retention deleted everything before ``min_offset``."""

    def __init__(self, min_offset: int, end_offset: int) -> None:
        self.min_offset = min_offset
        self.end_offset = end_offset
        self.asked: list[int] = []

    def start_state(self, offset: int) -> bytes:
        self.asked.append(offset)
        return b"queue offsets at %d" % offset

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        assert self.min_offset <= offset <= self.end_offset
        return b"r" * min(max_bytes, self.end_offset - offset)


class _Empty:
    """An empty member's state machine: it records what ``start_at`` was given."""

    def __init__(self) -> None:
        self.end_offset = 0
        self.started: list[tuple[int, bytes | None]] = []

    def start_at(self, offset: int, state: bytes | None) -> None:
        if offset % SEGMENT:
            raise ValueError(f"phy_offset {offset} is not a segment start")
        self.started.append((offset, state))
        self.end_offset = offset

    def write_raw(self, offset: int, data: bytes) -> None:
        assert offset == self.end_offset
        self.end_offset += len(data)


class _Wire:
    """A remoting client whose every request is answered by ``service`` (``edit`` may change the answer)."""

    def __init__(self, service: DLedgerService, edit=None) -> None:
        self.service = service
        self.edit = edit

    async def invoke(self, address, request, timeout_s):
        response = await self.service.handle(request, None)
        return self.edit(response) if self.edit is not None else response


def _older(response):
    """The answer of a member of the previous version: a moved answer without the state."""
    if response.code != ResponseCode.PULL_OFFSET_MOVED:
        return response
    return dataclasses.replace(response, body=b"", ext={k: v for k, v in response.ext.items() if k != "crc32c"})


def _service(sm) -> DLedgerService:
    return DLedgerService(SimpleNamespace(config=SimpleNamespace(group="g", secret=SECRET), _sm=sm))


async def test_the_moved_answer_carries_the_peers_start_state_at_its_min_offset():
    peer = _Trimmed(3 * SEGMENT, 5 * SEGMENT)
    fetch = remote_fetch_range(_Wire(_service(peer)), "g", SECRET)
    with pytest.raises(CommitLogMovedError) as caught:
        await fetch(PEER, 0, 100)
    assert (caught.value.min_offset, caught.value.end_offset) == (3 * SEGMENT, 5 * SEGMENT)
    assert caught.value.state == b"queue offsets at 3000" and peer.asked == [3 * SEGMENT]
    assert await fetch(PEER, 3 * SEGMENT, 100) == b"r" * 100 and peer.asked == [3 * SEGMENT]  # only when moved


async def test_a_moved_answer_without_a_state_is_an_older_peers_and_one_failing_its_crc_is_a_failed_fetch():
    peer = _Trimmed(3 * SEGMENT, 5 * SEGMENT)

    with pytest.raises(CommitLogMovedError) as caught:
        await remote_fetch_range(_Wire(_service(peer), _older), "g", SECRET)(PEER, 0, 100)
    assert caught.value.state is None and caught.value.min_offset == 3 * SEGMENT

    def damaged(response):
        assert response.code == ResponseCode.PULL_OFFSET_MOVED
        return dataclasses.replace(response, body=response.body[:-1] + b"X")

    with pytest.raises(CatchUpDataError, match="the start state from n1 at offset 3000 fails its crc32c check"):
        await remote_fetch_range(_Wire(_service(peer), damaged), "g", SECRET)(PEER, 0, 100)


@pytest.mark.parametrize("older", [False, True])
async def test_an_empty_member_starts_its_log_with_the_state_the_peer_sent(older):
    peer = _Trimmed(3 * SEGMENT, 5 * SEGMENT)

    fetch = remote_fetch_range(_Wire(_service(peer), _older if older else None), "g", SECRET)
    config = SimpleNamespace(peers=[PEER], catch_up_chunk_bytes=500, group="g", self_id="n0")
    empty = _Empty()
    member = SimpleNamespace(catch_up_target=4 * SEGMENT, finished=trio.Event())
    member.finish_catch_up = lambda: (setattr(member, "catch_up_target", None), member.finished.set())
    member.extend_catch_up = lambda end: setattr(member, "catch_up_target", end)
    catch_up = CatchUp(config, empty, fetch, leader_id=lambda: "n1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(catch_up.run, member)
        catch_up.want()
        with trio.fail_after(10):
            await member.finished.wait()
        nursery.cancel_scope.cancel()
    assert empty.started == [(3 * SEGMENT, None if older else b"queue offsets at 3000")]
    assert empty.end_offset == 4 * SEGMENT


async def test_a_start_state_past_a_fetch_answer_is_left_out_rather_than_fail_every_fetch(caplog):
    # Sent whole past the fetching client's frame size (16 MiB by default: ~400k queues, or a broker's deleted
    # topics' queues over its life), every fetch failed on the length alone and the member never started.
    from dledger.service import MAX_FETCH_BYTES

    peer = _Trimmed(3 * SEGMENT, 5 * SEGMENT)
    peer.start_state = lambda offset: b"q" * (MAX_FETCH_BYTES + 1)
    with pytest.raises(CommitLogMovedError) as caught:
        await remote_fetch_range(_Wire(_service(peer)), "g", SECRET)(PEER, 0, 100)
    assert caught.value.state is None and caught.value.min_offset == 3 * SEGMENT
    assert any("start state not sent" in r.getMessage() and f"{MAX_FETCH_BYTES + 1} bytes" in r.getMessage()
               for r in caplog.records)
