"""``DLedgerService``'s answers to malformed requests: INVALID_REQUEST, the remark and ext ``field`` naming it."""

from __future__ import annotations

from types import SimpleNamespace

import cbor2
import pytest

from dledger import ByteLog
from dledger.member_auth import MEMBER_SIGNATURE, MemberSigner
from dledger.service import DLedgerService, get_raft_status, peer_with_history
from dledger.state_machine import CHECKSUM_CHUNK_BYTES
from remoting.codec import make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import BrokerSystemError


@pytest.fixture
def service(tmp_path):
    log = ByteLog(tmp_path / "byte.log")
    log.apply_batch(log.prepare_batch([b"a" * 100, b"b" * 100], 0, 1, fresh=True).payload, 1, 0)
    yield DLedgerService(SimpleNamespace(config=SimpleNamespace(group="g", secret=SECRET), _sm=log))
    log.close()


SECRET = "a group secret of twenty-four"


@pytest.mark.parametrize("code, ext, field", [
    (RequestCode.GET_RAFT_STATUS, {}, "group"),
    (RequestCode.FETCH_COMMIT_LOG, {"group": "other", "phy_offset": 0, "max_bytes": 1}, "group"),
    (RequestCode.FETCH_COMMIT_LOG, {"group": "g", "phy_offset": -1, "max_bytes": 1}, "phy_offset"),
    (RequestCode.FETCH_COMMIT_LOG, {"group": "g", "phy_offset": 0, "max_bytes": 0}, "max_bytes"),
    (RequestCode.FETCH_COMMIT_LOG, {"group": "g", "phy_offset": 3, "max_bytes": 1}, "phy_offset"),  # in a record
    (RequestCode.FETCH_COMMIT_LOG, {"group": "g", "phy_offset": 10 ** 9, "max_bytes": 1}, "phy_offset"),
    (RequestCode.TRANSFER_LEADERSHIP, {"group": "g", "to": 7}, "to"),
    (RequestCode.TRANSFER_LEADERSHIP, {"group": "g", "to": "n1", "timeout_ms": 0}, "timeout_ms"),
])
async def test_a_malformed_field_is_named_in_remark_and_ext(service, code, ext, field):
    # ext.field, which remoting/codes.py promises for INVALID_REQUEST (and InvalidRequestError carries), was
    # never set: a client could only parse the remark.
    response = await service.handle(MemberSigner(SECRET).sign(make_request(code, ext=ext)), None)
    assert response.code == ResponseCode.INVALID_REQUEST, response
    assert response.ext.get("field") == field and field in response.remark, response


async def test_commit_log_bytes_are_served_to_requests_signed_with_the_group_secret_only(service):
    # FETCH_COMMIT_LOG shares the service port every client reaches, and no ACL judges it: unsigned, it handed
    # anyone there every stored message. Now only a member, who holds the group's dledger.secret, is served.
    ask = make_request(RequestCode.FETCH_COMMIT_LOG, ext={"group": "g", "phy_offset": 0, "max_bytes": 4096})
    signed = MemberSigner(SECRET).sign(ask)
    response = await service.handle(signed, None)
    assert response.code == ResponseCode.SUCCESS and response.body.count(b"a" * 100) == 1, response
    assert signed.ext[MEMBER_SIGNATURE] and MEMBER_SIGNATURE not in ask.ext  # a new frame, the asked one unchanged
    changed = dict(signed.ext, phy_offset=0, max_bytes=8192)  # what the signature covers, changed on the way
    forged = [ask, MemberSigner("another group's secret").sign(ask),
              make_request(RequestCode.FETCH_COMMIT_LOG, ext=changed),
              make_request(RequestCode.FETCH_COMMIT_LOG, ext=dict(signed.ext, **{MEMBER_SIGNATURE: 7})),
              make_request(RequestCode.FETCH_COMMIT_LOG, ext={**signed.ext, "group": "other"})]
    for request in forged:
        response = await service.handle(request, None)
        assert response.code == ResponseCode.NO_PERMISSION and not response.body, (request.ext, response)
        assert "members of group 'g' only" in response.remark and "dledger.secret" in response.remark, response


@pytest.fixture
def slow_disk_service(tmp_path, monkeypatch):
    """A service over a 64 MB ByteLog whose checksum reads take 25 ms per 8 MiB chunk, as from a slow disk."""
    import crc32c
    import time

    log = ByteLog(tmp_path / "big.log", segment_size_bytes=32 << 20)
    for _ in range(8):
        log.apply_batch(log.prepare_batch([bytes(1 << 20)] * 8, log.end_offset, 1, fresh=True).payload, 1,
                        log.end_offset)
    fast = crc32c.crc32c
    chunks = []

    def slow(data, value=0, *args):
        time.sleep(0.025)  # sleeps without the GIL, as a read from disk does
        chunks.append(len(data))
        return fast(data, value, *args)

    monkeypatch.setattr(crc32c, "crc32c", slow)
    yield DLedgerService(SimpleNamespace(config=SimpleNamespace(group="g", secret=SECRET), _sm=log,
                                         statistics=lambda: _statistics(log))), log, chunks, fast
    log.close()


def _statistics(log):
    from dledger import Role
    return SimpleNamespace(role=Role.LEADER, term=1, leader_id="n1", committed_index=1, last_applied_index=1,
                           end_offset=log.end_offset, serving_reads=True, self_id="n1", snapshots_loaded=0,
                           catch_up_bytes=0, connected_peers=(), in_flight_batches=0, pending_records=0,
                           busy_records=0, rejoining=False)


async def test_checksums_are_computed_off_the_event_loop_and_the_member_keeps_answering(slow_disk_service):
    # GET_RAFT_STATUS with checksum_up_to hashed the whole log on the trio thread: on a broker that stalled every
    # request of the node and its Raft tick (measured: 0.15-0.45 s for 420 MB of commit log not in the page cache).
    import cbor2
    import trio

    service, log, chunks, fast = slow_disk_service
    answered: list[str] = []
    longest_gap = 0.0

    async def ask(name, ext):
        response = await service.handle(make_request(RequestCode.GET_RAFT_STATUS, ext={"group": "g", **ext}), None)
        assert response.code == ResponseCode.SUCCESS, response.remark
        answered.append(name)
        return response

    async def ticker(done):
        nonlocal longest_gap
        last = trio.current_time()
        while not done.is_set():
            await trio.sleep(0.005)
            longest_gap = max(longest_gap, trio.current_time() - last)
            last = trio.current_time()

    done = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker, done)
            results = {}

            async def checksums():
                results["sums"] = await ask("checksums", {"checksum_up_to": log.end_offset})
                done.set()

            nursery.start_soon(checksums)
            await trio.sleep(0.05)
            await ask("status", {})
    assert answered == ["status", "checksums"]
    assert longest_gap < 0.1, longest_gap  # the 9 chunks took >= 0.225 s
    data = log.path.read_bytes()
    expected = [[start, len(data[start:start + (32 << 20)]), fast(data[start:start + (32 << 20)])]
                for start in range(0, len(data), 32 << 20)]
    assert cbor2.loads(results["sums"].body) == expected


async def test_a_cancelled_checksum_request_stops_its_thread_and_frees_the_next(slow_disk_service):
    import trio

    service, log, chunks, _fast = slow_disk_service
    request = make_request(RequestCode.GET_RAFT_STATUS, ext={"group": "g", "checksum_up_to": log.end_offset})
    with trio.move_on_after(0.06):
        await service.handle(request, None)
    await trio.sleep(0.1)  # the thread notices within one chunk
    stopped_after = len(chunks)
    segments = [min(32 << 20, log.end_offset - start) for start in range(0, log.end_offset, 32 << 20)]
    whole = sum(-(-n // CHECKSUM_CHUNK_BYTES) for n in segments)
    assert stopped_after < whole, stopped_after
    await trio.sleep(0.1)
    assert len(chunks) == stopped_after
    with trio.fail_after(5):  # the one-at-a-time limiter was released
        response = await service.handle(request, None)
    assert response.code == ResponseCode.SUCCESS and len(chunks) == stopped_after + whole


class _Peers:
    """Each address answers GET_RAFT_STATUS with its own (ext, body)."""

    def __init__(self, answers):
        self.answers = answers

    async def invoke(self, address, request, timeout_s):
        ext, body = self.answers[address]
        return make_response(request, ResponseCode.SUCCESS, ext=ext, body=body)


def _status(**fields):
    return {"role": "FOLLOWER", "term": 2, "committed_index": 7, "end_offset": 5, **fields}


async def test_a_peer_answering_a_status_that_cannot_be_read_is_a_peer_that_did_not_answer():
    # A non-CBOR body (CBORDecodeError), checksums that are no rows (TypeError) or an end_offset that is no offset
    # (int("x")) escaped the rejoin probe and failed the start of a broker whose log was empty; now such a peer
    # counts as one that did not answer, and a peer with a log is still found.
    answers = {"127.0.0.1:1": (_status(), b"\xff"),
               "127.0.0.1:2": (_status(), cbor2.dumps([1, 2])),
               "127.0.0.1:3": (_status(end_offset="x"), b""),
               "127.0.0.1:4": (_status(end_offset=100), b"")}
    config = SimpleNamespace(group="g", rejoin_probe_timeout_ms=2000,
                             peers=[SimpleNamespace(service_address=a) for a in answers])
    found = await peer_with_history(_Peers(answers), config)
    assert found == ("127.0.0.1:4", _status(end_offset=100))
    del answers["127.0.0.1:4"]
    config.peers.pop()
    assert await peer_with_history(_Peers(answers), config) is None


@pytest.mark.parametrize("body", [b"\xff", cbor2.dumps(7), cbor2.dumps([[0, 10]]), cbor2.dumps([[0, 10, "x"]])])
async def test_checksums_that_cannot_be_read_are_the_members_system_error(body):
    with pytest.raises(BrokerSystemError, match="malformed GET_RAFT_STATUS answer from 127.0.0.1:1: checksums"):
        await get_raft_status(_Peers({"127.0.0.1:1": (_status(), body)}), "127.0.0.1:1", "g", checksum_up_to=0)


@pytest.mark.parametrize("fields, named", [
    ({"end_offset": None}, "end_offset None is not a count"), ({"end_offset": -1}, "end_offset -1 is not a count"),
    ({"term": "3x"}, "term '3x' is not a count"), ({"role": None}, "role None is not a text"),
    ({"committed_index": True}, "committed_index True is not a count"),
    ({"self_id": ["n1"]}, r"self_id \['n1'\] is not a text"),
])
async def test_status_fields_its_callers_read_are_checked_where_it_is_read(fields, named):
    # `raftmq verify` (int(end_offset), self_id in a set) and `raftmq chaos` (int(term)) ended in tracebacks.
    with pytest.raises(BrokerSystemError, match=f"malformed GET_RAFT_STATUS answer from 127.0.0.1:1: {named}"):
        await get_raft_status(_Peers({"127.0.0.1:1": (_status(**fields), b"")}), "127.0.0.1:1", "g")
    missing = _status()
    del missing[next(iter(fields)) if "self_id" not in fields else "role"]
    with pytest.raises(BrokerSystemError, match="malformed GET_RAFT_STATUS answer"):
        await get_raft_status(_Peers({"127.0.0.1:1": (missing, b"")}), "127.0.0.1:1", "g")


class _Moved:
    def __init__(self, ext):
        self.ext = ext

    async def invoke(self, address, request, timeout_s):
        return make_response(request, ResponseCode.PULL_OFFSET_MOVED, remark="moved", ext=self.ext)


@pytest.mark.parametrize("low, end, moved", [
    (4096, 8192, True), (4096, 4096, True),
    (-4096, 0, False), (0, 8192, False), (8192, 4096, False), ("4096", 8192, False), (4096, None, False),
])
async def test_only_a_moved_answer_a_peer_that_deleted_the_log_could_give_starts_a_log_elsewhere(low, end, moved):
    # An empty member starts its log at the min offset a moved answer gives: a negative one ended it as "fell
    # behind", and any such answer was taken. Now only a min above the offset asked and an end not below the min.
    from dledger.config import MemberAddress
    from dledger.errors import CommitLogMovedError
    from dledger.service import remote_fetch_range
    from remoting.errors import PullOffsetMovedError

    fetch = remote_fetch_range(_Moved({"min_offset": low, "end_offset": end}), "g", SECRET)
    peer = MemberAddress(id="n1", raft_address="127.0.0.1:10001", service_address="127.0.0.1:10002")
    with pytest.raises(CommitLogMovedError if moved else PullOffsetMovedError):
        await fetch(peer, 0, 100)
