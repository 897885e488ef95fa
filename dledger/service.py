"""A member's remoting surface: commit-log byte ranges for catching-up peers, Raft status and checksums.

Requests (ext keys are short text, bodies raw bytes; see ``docs/architecture.md``, "Replication (dledger)"):

- ``FETCH_COMMIT_LOG`` ext ``{group, phy_offset, max_bytes}`` -> SUCCESS, body = stored bytes from
  ``phy_offset`` (whole records, never past this member's applied end), ext ``{crc32c, end_offset}``.
  The fetching side checks the crc32c of the body before handing it to ``write_raw`` (which validates each
  record again). Below this member's min offset (retention deleted it) -> PULL_OFFSET_MOVED, ext
  ``{min_offset, end_offset, crc32c}``, body = the state machine's ``start_state(min_offset)`` (what an empty
  member starting its log there needs besides the bytes, opaque here) and ``crc32c`` its checksum; a member of an
  older version sends no body and no ``crc32c``. Served to the group's members only: the request must carry their
  ``MemberSignature`` (``dledger.member_auth``, keyed by ``dledger.secret``), else NO_PERMISSION, whatever else it
  says.
- ``GET_RAFT_STATUS`` ext ``{group}`` and optionally ``checksum_up_to`` -> SUCCESS, ext ``{role, term,
  leader_id, committed_index, last_applied_index, end_offset, serving_reads, snapshots_loaded, catch_up_bytes,
  connected_peers, in_flight_batches, pending_records, busy_records, rejoining}`` (``connected_peers``: ids of
  the members this one has a Raft connection with; ``rejoining``: started with ``--rejoin`` (or without its Raft
  data) and no leader heard from yet); with ``checksum_up_to`` the body is CBOR
  ``[[segment_start, length, crc32c], ...]`` up to that offset (``raftmq verify``), computed in a worker thread,
  one request at a time per member, and stopped when the request is cancelled (the node keeps serving and
  ticking Raft meanwhile: a few hundred MB from disk took 0.15-0.45 s on the trio thread).
- ``TRANSFER_LEADERSHIP`` ext ``{group, to}`` (sent to the leader) -> SUCCESS once ``to`` leads, ext ``{term,
  leader_id}``; NOT_LEADER (ext ``leader_id``, ``leader_addr``) on a follower, and from a leader that stepped
  down during the transfer with another member (or none yet) leading; INVALID_REQUEST when ``to`` is already the leader
  or names no member; SYSTEM_ERROR naming the reason when the target refuses, or the entries in flight do not
  commit or no new leader appears within ``timeout_ms`` (default 3000; the answer never comes later).

Anything malformed is answered INVALID_REQUEST with a remark naming the field and ext ``field`` holding its name.
"""

from __future__ import annotations

import logging
from typing import Any

import cbor2
import crc32c
import trio

from dledger.config import DLedgerConfig, MemberAddress
from dledger.errors import CommitLogMovedError, NotLeaderError, TransferLeadershipError
from dledger.group import DLedgerGroup, FetchRange
from dledger.member_auth import MemberSigner
from remoting.codec import Frame, make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError, for_code

log = logging.getLogger(__name__)

__all__ = ["DLedgerService", "remote_fetch_range", "get_raft_status", "peer_with_history", "transfer_leadership",
           "CatchUpDataError"]

MAX_FETCH_BYTES = 8 << 20


class CatchUpDataError(ValueError):
    pass


class _BadField(ValueError):
    """A malformed request field; answered INVALID_REQUEST with ext ``field`` naming it (remoting/codes.py)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _int_field(request: Frame, name: str, *, minimum: int = 0) -> int:
    value = request.ext.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _BadField(name, f"ext.{name} must be an integer >= {minimum}, got {value!r}")
    return value


class DLedgerService:
    """Handles the dledger request codes; ``handle`` returns None for codes it does not own so a process can
    chain it after its own handler (``handles(code)`` tells which)."""

    CODES = frozenset({RequestCode.FETCH_COMMIT_LOG, RequestCode.GET_RAFT_STATUS, RequestCode.TRANSFER_LEADERSHIP})

    def __init__(self, group: DLedgerGroup) -> None:
        self.group = group
        self.members = MemberSigner(group.config.secret)
        # One checksum computation at a time: a second verify waits instead of taking another core's worth of I/O.
        self._checksum_limiter = trio.CapacityLimiter(1)

    def handles(self, code: int) -> bool:
        return code in self.CODES

    async def handle(self, request: Frame, conn: Any) -> Frame | None:
        if request.code == RequestCode.FETCH_COMMIT_LOG and not self.members.verify(request):
            # Judged before anything else of it is read: its fields' errors would tell a stranger about the log.
            group = self.group.config.group
            return make_response(request, ResponseCode.NO_PERMISSION,
                                 remark=f"FETCH_COMMIT_LOG is served to the members of group {group!r} only: the "
                                        f"request carries no valid MemberSignature (signed with the group's "
                                        f"dledger.secret)")
        try:
            group_name = request.ext.get("group")
            if group_name != self.group.config.group:
                raise _BadField("group", f"ext.group must be {self.group.config.group!r}, got {group_name!r}")
            if request.code == RequestCode.FETCH_COMMIT_LOG:
                return self._fetch(request)
            if request.code == RequestCode.GET_RAFT_STATUS:
                return await self._status(request)
            if request.code == RequestCode.TRANSFER_LEADERSHIP:
                return await self._transfer(request)
        except _BadField as e:
            return make_response(request, ResponseCode.INVALID_REQUEST, remark=str(e), ext={"field": e.field})
        return make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                             remark=f"request code {request.code} is not served here")

    def _fetch(self, request: Frame) -> Frame:
        offset = _int_field(request, "phy_offset")
        max_bytes = min(_int_field(request, "max_bytes", minimum=1), MAX_FETCH_BYTES)
        sm = self.group._sm
        low = sm.min_offset
        if offset < low:
            # In the same step as min_offset, on the trio thread where retention runs too: the state is the one at
            # this min offset, which no deletion can move in between.
            state = sm.start_state(low)
            ext = {"min_offset": low, "end_offset": sm.end_offset, "crc32c": crc32c.crc32c(state)}
            if len(state) > MAX_FETCH_BYTES:
                # Past what a fetch answer may hold (~8 MiB: ~180k queues, or as many deleted ones): sent, it would
                # pass the fetching client's frame size and fail every fetch, the member never starting. Left out,
                # the member starts as one of a previous version's peers would start it, without them.
                log.warning("start state not sent to a member starting empty: %d bytes, more than a fetch answer's "
                            "%d; its idle queues' offsets will be unknown to it min_offset=%d", len(state),
                            MAX_FETCH_BYTES, low)
                state = b""
                del ext["crc32c"]
            return make_response(request, ResponseCode.PULL_OFFSET_MOVED, body=state, ext=ext,
                                 remark=f"phy_offset {offset} is below this member's min offset {low} "
                                        f"(retention deleted the segments before it)")
        try:
            data = sm.read_raw(offset, max_bytes)
        except ValueError as e:  # the state machine's refusal: past the end, or not where a record starts
            raise _BadField("phy_offset", str(e)) from None
        return make_response(request, ResponseCode.SUCCESS, body=data,
                             ext={"crc32c": crc32c.crc32c(data), "end_offset": sm.end_offset})

    async def _status(self, request: Frame) -> Frame:
        stats = self.group.statistics()
        ext = {"role": stats.role.value, "term": stats.term, "leader_id": stats.leader_id or "",
               "committed_index": stats.committed_index, "last_applied_index": stats.last_applied_index,
               "end_offset": stats.end_offset, "serving_reads": stats.serving_reads, "self_id": stats.self_id,
               "snapshots_loaded": stats.snapshots_loaded, "catch_up_bytes": stats.catch_up_bytes,
               "connected_peers": list(stats.connected_peers), "in_flight_batches": stats.in_flight_batches,
               "pending_records": stats.pending_records, "busy_records": stats.busy_records,
               "rejoining": stats.rejoining}
        body = b""
        if "checksum_up_to" in request.ext:
            up_to = _int_field(request, "checksum_up_to")
            body = cbor2.dumps([list(c) for c in await self._checksums(up_to)])
        return make_response(request, ResponseCode.SUCCESS, ext=ext, body=body)

    async def _checksums(self, up_to: int) -> list[tuple[int, int, int]]:
        work = self.group._sm.prepare_checksums(up_to)
        given_up = False
        try:
            # Abandoned on cancel, so the caller is free at once; the flag then stops the thread within a chunk,
            # and the limiter stays held until it has.
            return await trio.to_thread.run_sync(work, lambda: given_up, limiter=self._checksum_limiter,
                                                 abandon_on_cancel=True)
        finally:
            given_up = True

    async def _transfer(self, request: Frame) -> Frame:
        to = request.ext.get("to")
        if not isinstance(to, str) or not to:
            raise _BadField("to", f"ext.to must be a member id, got {to!r}")
        timeout_ms = request.ext.get("timeout_ms", 3000)
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or not 1 <= timeout_ms <= 60_000:
            raise _BadField("timeout_ms", f"ext.timeout_ms must be an integer within 1..60000, got {timeout_ms!r}")
        try:
            view = await self.group.transfer_leadership(to, timeout_s=timeout_ms / 1000)
        except NotLeaderError as e:
            # Also a leader that stepped down during the transfer: the remark says so, and leader_id/leader_addr
            # name who leads now ("" / null while no one is known), as a follower's answer does.
            return make_response(request, ResponseCode.NOT_LEADER, remark=str(e),
                                 ext={"leader_id": e.leader_id or "", "leader_addr": e.leader_addr})
        except TransferLeadershipError as e:
            # A target that already leads or is no member is the request's fault; a refusal or a slow election
            # is not.
            if e.retriable:
                return make_response(request, ResponseCode.SYSTEM_ERROR, remark=str(e))
            return make_response(request, ResponseCode.INVALID_REQUEST, remark=str(e), ext={"field": "to"})
        return make_response(request, ResponseCode.SUCCESS, ext={"term": view.term, "leader_id": view.leader_id})


def _error_for(response: Frame) -> RaftMQError:
    """The error for a failed answer, with its ext values as fields: a NOT_LEADER's ``leader_addr`` is what lets
    the caller follow it to the leader, and INVALID_REQUEST's ``field`` names what was wrong."""
    fields = {str(k): v for k, v in response.ext.items() if v is not None}
    return for_code(response.code, response.remark, **fields)


def remote_fetch_range(client: Any, group: str, secret: str) -> FetchRange:
    """A ``fetch_range`` for ``open_dledger_group`` that asks peers' ``DLedgerService`` over remoting, signing each
    request with the group's ``secret`` (``dledger.member_auth``)."""
    members = MemberSigner(secret)

    async def fetch(peer: MemberAddress, offset: int, max_bytes: int) -> bytes:
        request = members.sign(make_request(RequestCode.FETCH_COMMIT_LOG,
                                            ext={"group": group, "phy_offset": offset, "max_bytes": max_bytes}))
        response = await client.invoke(peer.service_address, request, timeout_s=5.0)
        if response.code == ResponseCode.PULL_OFFSET_MOVED:
            low, end = response.ext.get("min_offset"), response.ext.get("end_offset")
            # Only what a peer that deleted the log before `offset` says (its min above the offset asked, its end
            # not below its min): an empty member starts its log at that min and copies up to that end. Anything
            # else is that peer's failed fetch: a negative min ended the member as "fell behind", a huge one
            # started its log where no member's is and it never served again.
            if type(low) is int and type(end) is int and offset < low <= end:
                state = None  # a peer of an older version sends no start state
                if "crc32c" in response.ext:
                    if crc32c.crc32c(response.body) != response.ext["crc32c"]:
                        raise CatchUpDataError(f"the start state from {peer.id} at offset {low} fails its crc32c "
                                               f"check")
                    state = response.body
                raise CommitLogMovedError(peer.id, offset, low, end, state=state)
        if response.code != ResponseCode.SUCCESS:
            raise _error_for(response)
        if crc32c.crc32c(response.body) != response.ext.get("crc32c"):
            raise CatchUpDataError(f"commit-log bytes from {peer.id} at offset {offset} fail their crc32c check")
        return response.body

    return fetch


async def get_raft_status(client: Any, address: str, group: str, *, checksum_up_to: int | None = None,
                          timeout_s: float = 3.0) -> tuple[dict[str, Any], list[tuple[int, int, int]]]:
    ext: dict[str, Any] = {"group": group}
    if checksum_up_to is not None:
        ext["checksum_up_to"] = checksum_up_to
    response = await client.invoke(address, make_request(RequestCode.GET_RAFT_STATUS, ext=ext),
                                   timeout_s=timeout_s)
    if response.code != ResponseCode.SUCCESS:
        raise _error_for(response)
    try:
        checksums = [tuple(c) for c in cbor2.loads(response.body)] if response.body else []
    except (cbor2.CBORError, ValueError, TypeError) as e:  # TypeError: no list of lists
        raise for_code(ResponseCode.SYSTEM_ERROR,
                       f"malformed GET_RAFT_STATUS answer from {address}: checksums cannot be read: {e}") from None
    if not all(len(c) == 3 and all(type(v) is int for v in c) for c in checksums):
        raise for_code(ResponseCode.SYSTEM_ERROR, f"malformed GET_RAFT_STATUS answer from {address}: checksums "
                                                  f"are not (offset, size, crc32c) rows of integers")
    status = dict(response.ext)
    # What callers read without looking (the rejoin probe, `raftmq verify`, `raftmq chaos`): one of another type
    # raised TypeError/ValueError/KeyError out of them (a broker's start failed, the CLI ended in a traceback).
    for key, kind in _STATUS_FIELDS.items():
        value = status.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            raise for_code(ResponseCode.SYSTEM_ERROR, f"malformed GET_RAFT_STATUS answer from {address}: {key} "
                                                      f"{value!r} is not a {'count' if kind is int else 'text'}")
    if "self_id" in status and not isinstance(status["self_id"], str):  # absent from members older than it
        raise for_code(ResponseCode.SYSTEM_ERROR, f"malformed GET_RAFT_STATUS answer from {address}: self_id "
                                                  f"{status['self_id']!r} is not a text")
    return status, checksums  # type: ignore[return-value]


_STATUS_FIELDS = {"role": str, "term": int, "committed_index": int, "end_offset": int}


async def peer_with_history(client: Any, config: DLedgerConfig) -> tuple[str, dict[str, Any]] | None:
    """A peer whose state machine holds a log (``end_offset`` > 0), with its status; None when none answers so
    within ``rejoin_probe_timeout_ms``. A member that starts with nothing asks this to tell a rebuild from a new
    group's first start. An election's no-op or metadata alone do not count: a new group's member that starts
    a moment after the others, and would then wait for a leader before it votes, could otherwise leave the
    group without a majority should that leader fail before it is heard from."""
    timeout_s = config.rejoin_probe_timeout_ms / 1000
    found: list[tuple[str, dict[str, Any]]] = []

    async def ask(address: str, done: trio.CancelScope) -> None:
        try:
            status, _ = await get_raft_status(client, address, config.group, timeout_s=timeout_s)
        except (RaftMQError, OSError) as e:
            log.info("rejoin probe: no answer from peer %s error=%s", address, e)
            return
        if status["end_offset"] > 0:
            found.append((address, status))
            done.cancel()

    with trio.move_on_after(timeout_s) as scope:
        async with trio.open_nursery() as nursery:
            for peer in config.peers:
                if peer.service_address:
                    nursery.start_soon(ask, peer.service_address, scope)
    return found[0] if found else None


async def transfer_leadership(client: Any, leader_address: str, group: str, to: str, *,
                              timeout_s: float = 3.0) -> dict[str, Any]:
    """Ask the member at ``leader_address`` (the current leader) to hand leadership to member ``to``."""
    request = make_request(RequestCode.TRANSFER_LEADERSHIP,
                           ext={"group": group, "to": to, "timeout_ms": int(timeout_s * 1000)})
    response = await client.invoke(leader_address, request, timeout_s=timeout_s + 1.0)
    if response.code != ResponseCode.SUCCESS:
        raise _error_for(response)
    return dict(response.ext)
