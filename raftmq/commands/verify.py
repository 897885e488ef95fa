"""``raftmq verify --group NAME --members HOST:PORT,...``: are the members' commit logs byte-identical?

Asks every member (its remoting address) for its Raft status, takes the smallest applied end offset among
them as the common prefix, then asks each for crc32c checksums per segment up to that offset and compares
them segment by segment. A prefix proves nothing about what a member lacks, so a member is also a failure when its
applied end is behind the furthest member's by more than ``--max-lag-bytes`` (default 16 MiB: entries committed
and in flight to a follower under load stay well within it, the largest entry is ~8 MiB and a leader queues at
most 4 MiB for a follower before it skips it a round), and always when it is empty while another member holds
data (compared up to offset 0, it passed with nothing compared). Prints one line per member, one per diverging
segment and one per member behind; exit status 0 when identical, 1 on divergence or a member behind, 2 when a
member cannot be asked. Members serving TLS (``tls_mode = "enforcing"``)
take ``--tls`` / ``--tls-ca-file PEM`` (or $RAFTMQ_TLS_ENABLE / $RAFTMQ_TLS_CA_FILE), and brokers with ACL on
``--access-key`` / ``--secret-key`` of an admin account (or $RAFTMQ_ACCESS_KEY / $RAFTMQ_SECRET_KEY), as
``raftmq admin``: checksums of a broker's log are an admin request there (they would give its bytes away).
"""

from __future__ import annotations

import argparse
import logging
import ssl
import sys
from typing import Any

from dledger.service import get_raft_status
from raftmq.bench.common import add_credential_args, check_credentials, check_range, tls_context_from_args
from raftmq.runner import run_interruptible
from remoting.acl import RequestSigner
from remoting.config import ConfigError, parse_host_port
from remoting.errors import RaftMQError
from remoting.transport import open_remoting_client

log = logging.getLogger(__name__)

# How far a member's applied end may trail the furthest member's before verify fails it: see the module docstring.
DEFAULT_MAX_LAG_BYTES = 16 * 1024 * 1024


def register(subparsers) -> None:
    parser = subparsers.add_parser("verify", help="compare the commit logs of a DLedger group's members",
                                   description="Compare members' commit logs (crc32c per segment up to the "
                                               "offset every member has applied) and report any divergence.")
    parser.add_argument("--group", required=True, help="DLedger group (broker) name")
    parser.add_argument("--members", required=True, metavar="HOST:PORT,...",
                        help="remoting addresses of the members, comma-separated")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    parser.add_argument("--max-lag-bytes", type=int, default=DEFAULT_MAX_LAG_BYTES, metavar="BYTES",
                        help="fail when a member's applied end is further behind the furthest member's (default "
                             "16 MiB, what may be in flight under load; 0 for a group at rest: every end equal). An "
                             "empty member while another holds data always fails")
    add_credential_args(parser)  # with --tls / --tls-ca-file
    parser.set_defaults(func=run)


async def verify_group(group: str, addresses: list[str], *, timeout_s: float = 10.0,
                       tls_context: ssl.SSLContext | None = None, max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES,
                       signer: RequestSigner | None = None) -> dict[str, Any]:
    """The comparison as data: ``{"up_to", "furthest", "members": {addr: status}, "segments", "divergent":
    [(start, {addr: crc})], "lagging": {addr: end_offset}, "identical": bool}``; ``identical`` only when no segment
    differs and no member is behind (``lagging_members``); ``tls_context`` (``remoting.tls.client_context``) for
    members that serve TLS; ``signer`` (an admin account's) for brokers with ACL on."""
    async with open_remoting_client(tls_context=tls_context, signer=signer.sign if signer else None) as client:
        statuses = {}
        for addr in addresses:
            statuses[addr], _ = await get_raft_status(client, addr, group, timeout_s=timeout_s)
        # The same member reached by two spellings of its address (localhost and 127.0.0.1) would be compared
        # with itself and always found identical; its self_id tells.
        seen: dict[str, str] = {}
        for addr, status in statuses.items():
            member_id = status.get("self_id")  # absent from a member older than self_id in the status
            if member_id is None:
                continue
            if member_id in seen:
                raise ConfigError(f"--members names member {member_id} twice ({seen[member_id]} and {addr}); "
                                  f"name each member once")
            seen[member_id] = addr
        ends = {addr: int(s["end_offset"]) for addr, s in statuses.items()}
        up_to = min(ends.values())
        sums = {}
        for addr in addresses:
            _, sums[addr] = await get_raft_status(client, addr, group, checksum_up_to=up_to, timeout_s=timeout_s)
    segments, divergent = compare_checksums(sums)
    lagging = lagging_members(ends, max_lag_bytes)
    return {"up_to": up_to, "furthest": max(ends.values()), "members": statuses, "segments": segments,
            "divergent": divergent, "lagging": lagging, "identical": not divergent and not lagging}


def lagging_members(ends: dict[str, int], max_lag_bytes: int) -> dict[str, int]:
    """``{member: end_offset}`` of the members whose applied end is behind the furthest member's by more than
    ``max_lag_bytes``, and of every empty member while another holds data: the comparison stops at the smallest
    end, so what such a member lacks (all of it, for an empty one) was never compared."""
    if max_lag_bytes < 0:
        raise ValueError(f"max_lag_bytes must be >= 0, got {max_lag_bytes!r}")
    furthest = max(ends.values(), default=0)
    return {addr: end for addr, end in ends.items()
            if furthest - end > max_lag_bytes or (end == 0 and furthest > 0)}


def compare_checksums(sums: dict[str, list[tuple[int, int, int]]]) -> tuple[int, list[tuple[int, dict[str, int]]]]:
    """``(segment count, [(segment_start, {member: crc})...])`` for every segment whose crc differs between
    members or that some member lacks (a different segment layout is a divergence too)."""
    by_segment: dict[tuple[int, int], dict[str, int]] = {}
    for addr, segs in sums.items():
        for start, length, crc in segs:
            by_segment.setdefault((start, length), {})[addr] = crc
    divergent = [(start, crcs) for (start, _length), crcs in sorted(by_segment.items())
                 if len(crcs) != len(sums) or len(set(crcs.values())) != 1]
    return len(by_segment), divergent


def run(args: argparse.Namespace) -> int:
    addresses = [a.strip() for a in args.members.split(",") if a.strip()]
    if len(addresses) < 2:
        raise ConfigError(f"--members needs at least two addresses, got {args.members!r}")
    for a in addresses:
        parse_host_port(a, key="--members", dial=True)
    # A repeated address was asked once and compared with itself: "identical" for a group never compared.
    repeated = sorted({a for a in addresses if addresses.count(a) > 1})
    if repeated:
        raise ConfigError(f"--members names {', '.join(repeated)} more than once; name each member once")
    check_range("--timeout", args.timeout, 0.1, 3600)
    check_range("--max-lag-bytes", args.max_lag_bytes, 0, 2**62)
    check_credentials(args)  # and the TLS flags
    tls_context = tls_context_from_args(args)
    signer = RequestSigner(args.access_key, args.secret_key) if args.access_key else None
    try:
        report = run_interruptible(lambda: verify_group(args.group, addresses, timeout_s=args.timeout,
                                                        tls_context=tls_context, max_lag_bytes=args.max_lag_bytes,
                                                        signer=signer))
    except (RaftMQError, OSError) as e:
        print(f"verify: could not ask every member of group {args.group}: {e}", file=sys.stderr)
        return 2
    for addr, status in report["members"].items():
        print(f"member {status.get('self_id', '?')} at {addr}: role={status['role']} term={status['term']} "
              f"end_offset={status['end_offset']} committed_index={status['committed_index']}")
    for start, crcs in report["divergent"]:
        print(f"DIVERGENT segment at {start}: " + " ".join(f"{a}={c:#010x}" for a, c in crcs.items()))
    for addr, end in report["lagging"].items():
        member = report["members"][addr].get("self_id", "?")
        why = "empty while another member holds data" if end == 0 else \
            f"more than --max-lag-bytes {args.max_lag_bytes} behind"
        print(f"BEHIND: member {member} at {addr} has end_offset {end}, the furthest member {report['furthest']} "
              f"({why}): its log past {end} was not compared")
    verdict = "DIVERGENT" if report["divergent"] else "identical"
    print(f"group {args.group}: {report['segments']} segment(s) up to offset {report['up_to']} are {verdict}"
          + (f"; {len(report['lagging'])} member(s) behind" if report["lagging"] else ""))
    return 0 if report["identical"] else 1
