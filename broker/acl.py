"""The broker's access control (RocketMQ's plain ACL, "ACL 1.0": PlainAccessValidator and PlainPermissionManager).

With ``acl_enable``, every request a client sends is judged here before any processor sees it
(``BrokerDispatcher``), in this order:

1. From an address in ``global_white_remote_addresses``: allowed, nothing else is asked.
2. Its ``AccessKey`` must name an account of the file, and its ``Signature`` be that account's signature of the
   request (``remoting/acl.py`` says what is signed).
3. An account with a ``white_remote_address`` is usable from matching addresses only. (RocketMQ lets a request from
   there through without the checks below, the global list's job; raftmq makes the account's address a restriction.)
4. The admin requests (``ADMIN_CODES``: topic create/update/delete, broker config read and change, subscription
   group create/update/delete, offset resets and clones, the looks into other clients: a consumer's running
   info, a producer group's connections, and a leadership transfer or a log checksum not signed by a member) need
   ``admin = true``.
5. Each resource the request names needs its permission: sends PUB on the topic; pulls, offset and consumer-list
   requests, heartbeats, queue locks and POP SUB on the consumer group (and on the topic, where they name one; a
   BATCH_ACK_MESSAGE on the topic each of its receipt handles names, as its processor reads them). A retry
   topic (``%RETRY%group``) is the group's resource, as in RocketMQ; a POP retry topic (RocketMQ 5's
   ``%RETRY%group+topic``) is both the group's and the topic's. A request that reads a stored message by its
   commit-log offset is judged by what is stored there, never by what it says: END_TRANSACTION needs PUB on the topic
   its half message is bound for, CONSUMER_SEND_MSG_BACK (which copies the message into the sender's retry topic,
   where the sender pulls it) and VIEW_MESSAGE_BY_ID SUB on the topic the record is stored in and on the one it
   came from (a retry copy's first topic, a delayed or half message's real topic); with no record there, nothing
   can be judged and the request is refused. A resource listed in the account's ``topic_perms`` / ``group_perms``
   has that permission, any other ``default_topic_perm`` / ``default_group_perm``; DENY refuses whatever else the
   entry says. An admin account with neither list may use every topic and group.

Everything else a broker serves (route and status lookups, GET_MAX_OFFSET and its kin, the topic and subscription
group tables) needs a valid signature only: it tells offsets, counts and names, never a message or a client's
insides, and clients ask some of it for every account.

The resources are worked out only once the signature holds (steps 3 to 5): nothing of a request nobody vouches for
is read beyond its ext, neither its body (a 16 MiB batch ack of made-up receipt handles) nor the record stored at an
offset it names (whose topic its refusal would tell). A batch ack's body is read only when it is a list of at most
``MAX_BATCH_ACK`` strings (``broker.pop.batch_ack_texts``); any other is judged on its group alone, and its
processor refuses it whole.

A refusal is NO_PERMISSION whose remark names the request, its resources (the first ``DESCRIBED_RESOURCES``, and how
many more; before the signature holds, the topic and group its ext names) and the account (never a secret); it is
logged at INFO (WARNING for a oneway request, whose sender learns nothing), at most once per ``REFUSAL_LOG_INTERVAL_S``
for an (account, request code), saying how many were not logged meanwhile. DLedger's requests between members are
not judged here: FETCH_COMMIT_LOG is served to members only, ACL or not (it must carry their MemberSignature,
keyed by the group's ``dledger.secret``: ``dledger.member_auth``); TRANSFER_LEADERSHIP, and GET_RAFT_STATUS asking
checksums of the log (``checksum_up_to``: the crc32c of each prefix a caller names gives the log's bytes away, one
query a byte), signed by a member go through, and ones that are not are admin requests (``needs_admin``); a plain
GET_RAFT_STATUS (role, term, offsets) is served to anyone. Nor are the name servers, which hold no ACL.

The file (TOML, RocketMQ's ``plain_acl.yml`` in snake_case) is checked whole when loaded, every error naming the
entry at fault. It is read again when it changes on disk, looked at no more than every ``WATCH_INTERVAL_S`` by the
requests themselves (no task, no thread); a changed content is applied only once a later look, at least
``SETTLE_S`` after, reads it unchanged (bytes and mtime), so an editor caught between truncating the file and
writing its last line (a still-valid file without an account's trailing restriction) is not applied unless it
stalls there that long; editing by writing a new file and renaming it over the old one leaves no such moment. A
settled file that does not load is logged and the last good rules stay.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from broker.pop import BatchAckBodyError, ReceiptHandle, ReceiptHandleError, batch_ack_texts
from broker.processor.base import MAX_DATA_BODY_BYTES
from broker.topic_config import TopicConfigError, group_problem, validate_topic_name
from remoting.acl import ACCESS_KEY, SIGNATURE, request_signature
from remoting.codec import BodyFormatError, Frame, decode_body
from remoting.codes import RequestCode
from remoting.config import ConfigError, read_named_file
from remoting.message import (PROPERTY_REAL_TOPIC, RETRY_GROUP_TOPIC_PREFIX, TRANS_HALF_TOPIC, MessageFormatError,
                              first_topic, parse_msg_id, split_pop_retry_topic)

__all__ = ["ACL_FILE_NAME", "AclChecker", "AclRules", "Account", "AddressPattern", "ADMIN_CODES", "DENY",
           "DESCRIBED_RESOURCES", "PUB", "REFUSAL_LOG_INTERVAL_S", "SETTLE_S", "SUB", "StoredMessage",
           "WATCH_INTERVAL_S", "acl_file_path", "load_acl_file", "needs_admin", "parse_acl_rules", "parse_perm",
           "permits", "request_resources"]

log = logging.getLogger(__name__)

ACL_FILE_NAME: Final = "plain_acl.toml"
WATCH_INTERVAL_S: Final = 0.5  # RocketMQ's FileWatchService looks every 500 ms too
# A changed file is applied once two looks this far apart read the same bytes: an editor that truncates and rewrites
# in place leaves a valid prefix for a moment, and a prefix can be an account without its white_remote_address.
SETTLE_S: Final = 0.2
# A client retrying a refused request (or a flood of them) costs one log line per (account, code) this often.
REFUSAL_LOG_INTERVAL_S: Final = 10.0
# A refusal's remark (also logged) names this many of the request's resources, and how many more: a batch ack's
# handles can name a thousand topics.
DESCRIBED_RESOURCES: Final = 5
_NAME_CHARS = 255  # of a name quoted in a remark; a receipt handle's topic is whatever its sender wrote

# Permission bits of a resource entry.
DENY: Final = 1
PUB: Final = 2
SUB: Final = 4
_PERMS: Final = {"DENY": DENY, "PUB": PUB, "SUB": SUB, "PUB|SUB": PUB | SUB, "SUB|PUB": PUB | SUB}
_PERM_NAMES: Final = {DENY: "DENY", PUB: "PUB", SUB: "SUB", PUB | SUB: "PUB|SUB"}

# RocketMQ's ADMIN_CODE; the offset reset and clone (raftmq's admin tool changes any group's offsets through the
# broker); and the operator's looks that no application needs: a consumer's running info (its whole config, stats
# and task dump), a producer group's client connections, the broker's config (store paths, peers, the ACL file).
ADMIN_CODES: Final = frozenset({
    RequestCode.UPDATE_AND_CREATE_TOPIC, RequestCode.DELETE_TOPIC_IN_BROKER, RequestCode.UPDATE_BROKER_CONFIG,
    RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, RequestCode.DELETE_SUBSCRIPTIONGROUP,
    RequestCode.INVOKE_BROKER_TO_RESET_OFFSET, RequestCode.CLONE_GROUP_OFFSET, RequestCode.GET_CONSUMER_RUNNING_INFO,
    RequestCode.GET_PRODUCER_CONNECTION_LIST, RequestCode.GET_BROKER_CONFIG,
    # DLedger's, when a member did not sign it (the dispatcher lets a member's through unjudged): moving the master.
    RequestCode.TRANSFER_LEADERSHIP,
})


# DLedger's requests, whose ext "group" is the Raft group (the broker), not a consumer group.
_RAFT_CODES: Final = frozenset({RequestCode.FETCH_COMMIT_LOG, RequestCode.GET_RAFT_STATUS,
                                RequestCode.TRANSFER_LEADERSHIP})


def needs_admin(request: Frame) -> bool:
    """Whether ``request`` needs an admin account: an admin code, or a GET_RAFT_STATUS asking checksums of the log
    (``checksum_up_to``): the crc32c of every prefix a caller names reads the log back a byte a query."""
    code = request.code
    return code in ADMIN_CODES or code == RequestCode.GET_RAFT_STATUS and "checksum_up_to" in request.ext

# RocketMQ's rule for both keys (AclConstants.ACCESS_KEY_MIN_LENGTH): longer than 6 characters.
_KEY_MIN_LENGTH = 7


def parse_perm(text: Any, where: str) -> int:
    """The bits of "DENY", "PUB", "SUB" or "PUB|SUB" (spaces around them allowed); else a ConfigError at ``where``."""
    if isinstance(text, str):
        bits = _PERMS.get(text.strip().upper().replace(" ", ""))
        if bits is not None:
            return bits
    raise ConfigError(f"{where} must be one of DENY, PUB, SUB, PUB|SUB, got {text!r}")


def permits(owned: int, needed: int) -> bool:
    """Whether an entry with ``owned`` bits allows ``needed`` (PUB or SUB): DENY refuses, whatever else is set."""
    return not owned & DENY and owned & needed == needed


# --- addresses --------------------------------------------------------------------------------------------------

_ANY_OCTET = frozenset(range(256))


def _octet_set(part: str, where: str, text: str) -> frozenset[int]:
    def number(s: str) -> int:
        if not s.isdecimal() or not 0 <= int(s) <= 255:
            raise ConfigError(f"{where} {text!r}: {s!r} is not a number within 0..255")
        return int(s)

    if part == "*":
        return _ANY_OCTET
    if part.startswith("{") and part.endswith("}"):
        values = [p.strip() for p in part[1:-1].split(",")]
        return frozenset(number(v) for v in values)
    lo, sep, hi = part.partition("-")
    if sep:
        a, b = number(lo.strip()), number(hi.strip())
        if a > b:
            raise ConfigError(f"{where} {text!r}: range {part!r} is empty (its start is above its end)")
        return frozenset(range(a, b + 1))
    return frozenset((number(part),))


def _split_items(text: str) -> list[str]:
    """``text`` split at the commas outside braces ("10.0.0.{1,2},10.0.1.1")."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items]


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class AddressPattern:
    """Remote addresses, as RocketMQ writes them: ``*`` (any), ``192.168.1.1``, ``192.168.1.1,192.168.1.2``,
    ``192.168.1.{1,2,3}``, ``192.168.*.*``, ``192.168.100-200.10-20``; and, raftmq's own, CIDR networks
    (``10.0.0.0/8``) and IPv6 addresses or networks. Commas join alternatives."""

    text: str
    any_address: bool = False
    v4_octets: tuple[tuple[frozenset[int], ...], ...] = ()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, text: Any, where: str) -> AddressPattern:
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where} must be an address pattern (e.g. '192.168.0.*' or '*'), got {text!r}")
        octets: list[tuple[frozenset[int], ...]] = []
        networks: list[Any] = []
        for item in _split_items(text.strip()):
            if item in ("*", "*.*.*.*"):
                return cls(text, any_address=True)
            if not item:
                raise ConfigError(f"{where} {text!r}: an empty alternative (two commas, or one at an end)")
            if ":" in item or "/" in item:
                try:
                    networks.append(ipaddress.ip_network(item, strict=False))
                except ValueError as e:
                    raise ConfigError(f"{where} {text!r}: {item!r} is no IP address or network ({e})") from None
                continue
            parts = item.split(".")
            if len(parts) != 4:
                raise ConfigError(f"{where} {text!r}: {item!r} is not four dot-separated parts (an IPv4 address "
                                  f"whose parts may be '*', 'N-M' or '{{a,b}}')")
            octets.append(tuple(_octet_set(p.strip(), where, text) for p in parts))
        return cls(text, v4_octets=tuple(octets), networks=tuple(networks))

    def __repr__(self) -> str:
        return f"AddressPattern({self.text!r})"

    def matches(self, ip: IPAddress | None) -> bool:
        if self.any_address:
            return True
        if ip is None:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if isinstance(ip, ipaddress.IPv4Address) and self.v4_octets:
            packed = ip.packed
            for octets in self.v4_octets:
                if all(b in allowed for b, allowed in zip(packed, octets)):
                    return True
        return any(ip in net for net in self.networks if net.version == ip.version)


def remote_ip(remote_address: str) -> IPAddress | None:
    """The IP of a connection's ``remote_address`` ("1.2.3.4:5678", "::1:5678", "[::1]:5678"), None if none."""
    host = remote_address.rpartition(":")[0] if ":" in remote_address else remote_address
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# --- the file ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Account:
    access_key: str
    secret_key: str = field(repr=False)
    white_remote_address: AddressPattern | None = None
    admin: bool = False
    default_topic_perm: int = DENY
    default_group_perm: int = DENY
    topic_perms: Mapping[str, int] = field(default_factory=dict)
    group_perms: Mapping[str, int] = field(default_factory=dict)

    def perm(self, kind: str, name: str) -> tuple[int, str]:
        """The bits this account holds on the ``kind`` ("topic" or "group") ``name``, and where they come from."""
        listed = self.topic_perms if kind == "topic" else self.group_perms
        bits = listed.get(name)
        if bits is not None:
            return bits, f"{kind}_perms entry {name}={_PERM_NAMES.get(bits, bits)}"
        bits = self.default_topic_perm if kind == "topic" else self.default_group_perm
        return bits, f"default_{kind}_perm {_PERM_NAMES.get(bits, bits)}"


@dataclass(frozen=True)
class AclRules:
    global_white: tuple[AddressPattern, ...] = ()
    accounts: Mapping[str, Account] = field(default_factory=dict)


_TOP_KEYS = ("global_white_remote_addresses", "accounts")
_ACCOUNT_KEYS = ("access_key", "secret_key", "white_remote_address", "admin", "default_topic_perm",
                 "default_group_perm", "topic_perms", "group_perms")


def _key_problem(value: Any) -> str | None:
    if not isinstance(value, str):
        return "must be a string"
    if len(value) < _KEY_MIN_LENGTH:
        return f"must be at least {_KEY_MIN_LENGTH} characters long (RocketMQ's rule)"
    if value != value.strip() or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "must not contain control characters or begin or end with whitespace"
    return None


def _resource_perms(value: Any, kind: str, where: str) -> dict[str, int]:
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list of \"NAME=PERM\" strings, got {value!r}")
    out: dict[str, int] = {}
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(entry, str) or "=" not in entry:
            raise ConfigError(f"{at} must be \"NAME=PERM\" (e.g. \"{kind}A=PUB|SUB\"), got {entry!r}")
        name, _, perm = (s.strip() for s in entry.partition("="))
        if kind == "topic":
            pop = split_pop_retry_topic(name)
            if pop is not None:
                raise ConfigError(f"{at} {entry!r}: a POP retry topic is its group's and its topic's resource; list "
                                  f"{pop[0]!r} in group_perms and {pop[1]!r} in topic_perms instead")
            if name.startswith(RETRY_GROUP_TOPIC_PREFIX):
                raise ConfigError(f"{at} {entry!r}: a retry topic is its group's resource; list "
                                  f"{name[len(RETRY_GROUP_TOPIC_PREFIX):]!r} in group_perms instead")
            try:
                validate_topic_name(name)
            except TopicConfigError as e:
                raise ConfigError(f"{at} {entry!r}: {e}") from None
        else:
            problem = group_problem(name) if name else "must not be empty"
            if problem:
                raise ConfigError(f"{at} {entry!r}: group {name!r} {problem}")
        if name in out:
            raise ConfigError(f"{at} {entry!r}: {kind} {name!r} is listed twice")
        out[name] = parse_perm(perm, f"{at} {entry!r}: its permission")
    return out


def _account(data: Any, where: str) -> Account:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a table, got {data!r}")
    key = data.get("access_key")
    if isinstance(key, str) and key:
        where = f"{where} (access_key {key!r})"
    unknown = sorted(set(data) - set(_ACCOUNT_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known keys: {', '.join(_ACCOUNT_KEYS)})")
    for name in ("access_key", "secret_key"):
        if name not in data:
            raise ConfigError(f"{where}: {name} is required")
        problem = _key_problem(data[name])
        if problem:
            # The secret is never repeated: error messages get logged.
            shown = "" if name == "secret_key" else f", got {data[name]!r}"
            raise ConfigError(f"{where}: {name} {problem}{shown}")
    admin = data.get("admin", False)
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}: admin must be true or false, got {admin!r}")
    white = data.get("white_remote_address", "")
    if not isinstance(white, str):
        raise ConfigError(f"{where}: white_remote_address must be a string, got {white!r}")
    return Account(
        access_key=key, secret_key=data["secret_key"],
        white_remote_address=AddressPattern.parse(white, f"{where}: white_remote_address") if white.strip() else None,
        admin=admin,
        default_topic_perm=parse_perm(data.get("default_topic_perm", "DENY"), f"{where}: default_topic_perm"),
        default_group_perm=parse_perm(data.get("default_group_perm", "DENY"), f"{where}: default_group_perm"),
        topic_perms=_resource_perms(data.get("topic_perms", []), "topic", f"{where}: topic_perms"),
        group_perms=_resource_perms(data.get("group_perms", []), "group", f"{where}: group_perms"))


def parse_acl_rules(data: Mapping[str, Any]) -> AclRules:
    """The rules of a decoded ACL file; a ConfigError naming the first entry at fault."""
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} (known keys: {', '.join(_TOP_KEYS)}; an account's keys go in "
                          f"an [[accounts]] table)")
    white = data.get("global_white_remote_addresses", [])
    if not isinstance(white, list):
        raise ConfigError(f"global_white_remote_addresses must be a list of address patterns, got {white!r}")
    patterns = tuple(AddressPattern.parse(p, f"global_white_remote_addresses[{i}]") for i, p in enumerate(white))
    accounts_data = data.get("accounts", [])
    if not isinstance(accounts_data, list):
        raise ConfigError(f"accounts must be a list of tables ([[accounts]]), got {accounts_data!r}")
    accounts: dict[str, Account] = {}
    for i, entry in enumerate(accounts_data):
        account = _account(entry, f"accounts[{i}]")
        if account.access_key in accounts:
            raise ConfigError(f"accounts[{i}]: access_key {account.access_key!r} is given to an earlier account too")
        accounts[account.access_key] = account
    return AclRules(patterns, accounts)


def _read(path: Path) -> bytes:
    return read_named_file("ACL file", path, missing=" (acl_enable is on: create it, or set acl_file)")


def _parse_bytes(path: Path, raw: bytes) -> AclRules:
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"ACL file {str(path)!r} is not valid TOML: not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"ACL file {str(path)!r} is not valid TOML: {e}") from None
    try:
        return parse_acl_rules(data)
    except ConfigError as e:
        raise ConfigError(f"ACL file {str(path)!r}: {e}") from None


def load_acl_file(path: str | Path) -> AclRules:
    """The rules of the ACL file at ``path``; a ConfigError naming the file and the entry at fault."""
    path = Path(path)
    return _parse_bytes(path, _read(path))


def acl_file_path(config: Any) -> Path:
    """Where a broker node reads its ACL file: ``acl_file`` if set, else ``plain_acl.toml`` in its store directory
    (RocketMQ keeps plain_acl.yml under its store's config directory in the same spirit: one per node)."""
    return Path(config.acl_file) if config.acl_file else Path(config.store.store_dir) / ACL_FILE_NAME


# --- requests ---------------------------------------------------------------------------------------------------

_SENDS = frozenset({RequestCode.SEND_MESSAGE, RequestCode.SEND_MESSAGE_V2, RequestCode.SEND_BATCH_MESSAGE,
                    RequestCode.SEND_REPLY_MESSAGE, RequestCode.SEND_REPLY_MESSAGE_V2})
_GROUP_IN_EXT = frozenset({RequestCode.GET_CONSUMER_LIST_BY_GROUP, RequestCode.GET_CONSUMER_CONNECTION_LIST,
                           RequestCode.GET_CONSUME_STATS})
# POP consumption (RocketMQ 5) reads as a pull does.
_GROUP_AND_TOPIC_IN_EXT = frozenset({RequestCode.QUERY_CONSUMER_OFFSET, RequestCode.UPDATE_CONSUMER_OFFSET,
                                     RequestCode.POP_MESSAGE, RequestCode.ACK_MESSAGE,
                                     RequestCode.CHANGE_MESSAGE_INVISIBLETIME})
_GROUP_IN_DATA = frozenset({RequestCode.CHECK_CLIENT_CONFIG, RequestCode.LOCK_BATCH_MQ, RequestCode.UNLOCK_BATCH_MQ})

Resource = tuple[str, str, int]  # ("topic" or "group", name, PUB or SUB)
# The topic and properties of the record stored at a commit-log offset (None when no record starts there).
StoredMessage = tuple[str, Mapping[str, str]]


def _no_message(_offset: int) -> StoredMessage | None:
    return None


def _topic(name: Any, perm: int) -> list[Resource]:
    # A field of the wrong type or empty names no resource: the processor refuses the request for it anyway.
    if not isinstance(name, str) or not name:
        return []
    if name.startswith(RETRY_GROUP_TOPIC_PREFIX):
        # A group's retry topic is the group's: its consumers pull it and send back to it. A POP retry topic holds
        # one topic's messages for one group: whoever reaches it must be able to read both.
        pop = split_pop_retry_topic(name)
        if pop is not None:
            return [("group", pop[0], SUB), ("topic", pop[1], SUB)]
        return [("group", name[len(RETRY_GROUP_TOPIC_PREFIX):], SUB)]
    return [("topic", name, perm)]


def _offset(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _stored_topics(stored_message: Callable[[int], StoredMessage | None], offset: int | None) -> list[Resource]:
    """SUB on what the record at ``offset`` holds: the topic it is stored in and the one it came from
    (``remoting.message.first_topic``): a retry copy's RETRY_TOPIC (its first topic, which send-back itself keeps),
    else REAL_TOPIC of a record the broker parked (a delayed or half message's destination). Those properties are
    read from those records only: on any other, a producer wrote them, and judged by them a send-back needed SUB
    on whatever topic the producer named, and was refused for ever. A reader of a retry copy of topic T in its own
    group's retry topic holds both already. No record there: the ("topic", "", SUB) marker, which no account is
    granted."""
    found = stored_message(offset) if offset is not None else None
    if found is None:
        return [("topic", "", SUB)]
    topic, properties = found
    needs = _topic(topic, SUB)
    return list(dict.fromkeys(needs + _topic(first_topic(topic, properties), SUB)))


def _group(name: Any) -> list[Resource]:
    return [("group", name, SUB)] if isinstance(name, str) and name else []


def _data(request: Frame) -> Any:
    # As processor.base.request_data: the body's CBOR, or the ext when there is no body.
    if not request.body:
        return request.ext
    if len(request.body) > MAX_DATA_BODY_BYTES:
        return None  # the processor refuses it, naming the body, without decoding it
    try:
        return decode_body(request.body)
    except BodyFormatError:  # garbage, a tag, too deep: the processor refuses it, naming the body
        return None


def request_resources(request: Frame,
                      stored_message: Callable[[int], StoredMessage | None] = _no_message) -> list[Resource]:
    """What ``request`` needs, as (kind, name, permission) triples. ``stored_message(phy_offset)`` is the topic and
    properties of the record at a commit-log offset, for the requests that name a stored message by it."""
    code, ext = request.code, request.ext
    if code in _SENDS:
        return _topic(ext.get("topic"), PUB)
    if code == RequestCode.PULL_MESSAGE:
        return _topic(ext.get("topic"), SUB) + _group(ext.get("consumer_group"))
    if code == RequestCode.HEART_BEAT:
        needs: list[Resource] = []
        data = _data(request)
        consumers = data.get("consumers") if isinstance(data, Mapping) else None
        for consumer in consumers if isinstance(consumers, list) else ():
            if isinstance(consumer, Mapping):
                needs += _group(consumer.get("consumer_group"))
                subs = consumer.get("subscriptions")
                for sub in subs if isinstance(subs, list) else ():
                    if isinstance(sub, Mapping):
                        needs += _topic(sub.get("topic"), SUB)
        return needs
    if code in _GROUP_AND_TOPIC_IN_EXT:
        return _group(ext.get("consumer_group")) + _topic(ext.get("topic"), SUB)
    if code == RequestCode.BATCH_ACK_MESSAGE:
        needs = _group(ext.get("consumer_group"))
        try:
            texts = batch_ack_texts(request.body)
        except BatchAckBodyError:
            return needs  # not read further: its processor refuses such a body whole
        for text in texts:
            try:
                needs += _topic(ReceiptHandle.decode(text).topic, SUB)
            except ReceiptHandleError:
                pass  # names nothing: the processor refuses this handle
        return list(dict.fromkeys(needs))
    if code in _GROUP_IN_EXT or code == RequestCode.UNREGISTER_CLIENT:
        return _group(ext.get("consumer_group"))
    if code in _GROUP_IN_DATA:
        data = _data(request)
        return _group(data.get("consumer_group")) if isinstance(data, Mapping) else []
    if code == RequestCode.CONSUMER_SEND_MSG_BACK:
        # Not origin_topic, which is optional and the sender's word: the processor copies whatever is at offset.
        needs = _group(ext.get("group")) + _stored_topics(stored_message, _offset(ext.get("offset")))
        return list(dict.fromkeys(needs))
    if code == RequestCode.VIEW_MESSAGE_BY_ID:
        msg_id = ext.get("msg_id")
        if msg_id is None:
            return _stored_topics(stored_message, _offset(ext.get("offset")))
        try:
            offset = parse_msg_id(msg_id)[1]
        except MessageFormatError:
            offset = None
        return _stored_topics(stored_message, offset)
    if code == RequestCode.QUERY_MESSAGE:
        return _topic(ext.get("topic"), SUB)
    if code == RequestCode.END_TRANSACTION:
        offset = _offset(ext.get("commit_log_offset"))
        found = stored_message(offset) if offset is not None else None
        topic = found[1].get(PROPERTY_REAL_TOPIC) if found is not None and found[0] == TRANS_HALF_TOPIC else None
        # No half there: nothing to settle, but also no topic to judge; "" stands for it and is never permitted.
        return [("topic", topic or "", PUB)]
    return []


def _describe(request: Frame, resources: list[Resource]) -> str:
    code, ext = request.code, request.ext
    try:
        name = f"{RequestCode(code).name} (code {code})"
    except ValueError:
        name = f"request code {code}"
    unknown = "the topic of an unknown half message" if code == RequestCode.END_TRANSACTION else \
        "the topic of an unknown message"
    parts = [(f"topic {res[:_NAME_CHARS]!r}" if kind == "topic" else f"consumer group {res[:_NAME_CHARS]!r}")
             if res else unknown for kind, res, _perm in resources[:DESCRIBED_RESOURCES]]
    if not parts:
        # An admin request's resource needs no permission of its own, and a request whose signature does not hold
        # is not looked into; the refusal still says what its ext says it is about.
        topic = ext.get("topic")
        group = ext.get("consumer_group") or ext.get("group_name") or \
            (ext.get("group") if code not in _RAFT_CODES else None)  # there, the Raft group
        parts = ([f"topic {topic[:_NAME_CHARS]!r}"] if isinstance(topic, str) and topic else []) + \
            ([f"consumer group {group[:_NAME_CHARS]!r}"] if isinstance(group, str) and group else [])
    more = f" and {len(resources) - DESCRIBED_RESOURCES} more" if len(resources) > DESCRIBED_RESOURCES else ""
    return name + (" on " + ", ".join(parts) + more if parts else "")


# --- the checker ------------------------------------------------------------------------------------------------

class AclChecker:
    """The rules of one node, from its ACL file, kept current (see the module rules)."""

    def __init__(self, path: str | Path, *, broker_name: str, clock: Callable[[], float] = time.monotonic,
                 stored_message: Callable[[int], StoredMessage | None] = _no_message) -> None:
        self.path = Path(path)
        self.broker_name = broker_name
        self._clock = clock
        self._stored_message = stored_message
        raw = _read(self.path)
        self.rules = _parse_bytes(self.path, raw)  # a bad file at start stops the node: ConfigError
        self._digest = hashlib.sha256(raw).digest()
        # A changed content, as (its digest, the file's mtime_ns), and when a look first read it so.
        self._pending: tuple[tuple[bytes, int], float] | None = None
        self._next_look = clock() + WATCH_INTERVAL_S
        self._missing_logged = False
        # (account, code) -> (when its refusals may be logged again, how many were not logged since the last line);
        # the account is None for every AccessKey the file does not know, so a flood of made-up keys is one entry.
        self._refusals_logged: dict[tuple[str | None, int], tuple[float, int]] = {}

    def reload_if_changed(self) -> None:
        """Apply the file's content if it changed and a look at least ``SETTLE_S`` earlier read the same bytes with
        the same mtime; keep the last good rules if it does not load."""
        try:
            # The mtime too: a half-written file read, completed, then half-written again by the next edit would
            # read alike twice by its bytes alone.
            mtime_ns = self.path.stat().st_mtime_ns
            raw = self.path.read_bytes()
        except (OSError, ValueError) as e:
            if not self._missing_logged:
                log.warning("ACL file unreadable, keeping the last rules path=%s error=%s", self.path, e)
                self._missing_logged = True
            return
        self._missing_logged = False
        digest = hashlib.sha256(raw).digest()
        if digest == self._digest:
            self._pending = None  # changed and changed back before it settled
            return
        now = self._clock()
        if self._pending is None or self._pending[0] != (digest, mtime_ns):
            self._pending = ((digest, mtime_ns), now)
            return
        if now - self._pending[1] < SETTLE_S:
            return
        self._pending = None
        self._digest = digest  # a bad version is reported once, not at every look
        try:
            self.rules = _parse_bytes(self.path, raw)
        except ConfigError as e:
            log.warning("ACL file changed but does not load, keeping the last good rules: %s", e)
            return
        log.info("ACL file reloaded path=%s accounts=%d global_white=%d", self.path, len(self.rules.accounts),
                 len(self.rules.global_white))

    def check(self, request: Frame, remote_address: str) -> str | None:
        """None if ``request`` from ``remote_address`` may go on; else the NO_PERMISSION remark saying why, which is
        also logged (rate-limited, see the module rules)."""
        refusal = self._judge(request, remote_address)
        if refusal is not None:
            self._log_refusal(request, remote_address, refusal)
        return refusal

    def _judge(self, request: Frame, remote_address: str) -> str | None:
        now = self._clock()
        if now >= self._next_look:
            self._next_look = now + WATCH_INTERVAL_S
            self.reload_if_changed()
        rules = self.rules
        ip = remote_ip(remote_address)
        for pattern in rules.global_white:
            if pattern.matches(ip):
                return None
        ext = request.ext
        access_key = ext.get(ACCESS_KEY)
        if not access_key:
            return self._refusal(request, [], "it carries no AccessKey (this broker has acl_enable on: give the "
                                              "client access_key and secret_key)")
        account = rules.accounts.get(access_key) if isinstance(access_key, str) else None
        if account is None:
            return self._refusal(request, [], f"no account has AccessKey {str(access_key)[:64]!r}")
        sent = ext.get(SIGNATURE)
        if not isinstance(sent, str) or not hmac.compare_digest(
                sent.encode("ascii", "replace"), request_signature(account.secret_key, request).encode("ascii")):
            return self._refusal(request, [], f"its Signature does not match account {account.access_key!r} "
                                              f"(a wrong secret_key, or the request was changed on the way)")
        resources = request_resources(request, self._stored_message)
        white = account.white_remote_address
        if white is not None and not white.matches(ip):
            return self._refusal(request, resources, f"account {account.access_key!r} may not be used from "
                                                     f"{ip or remote_address} (white_remote_address {white.text!r})")
        if needs_admin(request) and not account.admin:
            return self._refusal(request, resources, f"account {account.access_key!r} is not an admin account "
                                                     f"(admin = true is needed)")
        if account.admin and not account.topic_perms and not account.group_perms:
            return None
        for kind, name, needed in resources:
            if not name:
                what = "half message is stored at its commit_log_offset" \
                    if request.code == RequestCode.END_TRANSACTION else "message is stored at the offset it names"
                return self._refusal(request, resources, f"no {what} here, so no topic permission can be checked")
            owned, source = account.perm(kind, name)
            if not permits(owned, needed):
                what = "topic" if kind == "topic" else "consumer group"
                return self._refusal(request, resources, f"account {account.access_key!r} has no "
                                                         f"{_PERM_NAMES[needed]} permission on {what} "
                                                         f"{name[:_NAME_CHARS]!r} "
                                                         f"({source})")
        return None

    def _refusal(self, request: Frame, resources: list[Resource], why: str) -> str:
        return f"ACL of broker {self.broker_name} refused {_describe(request, resources)}: {why}"

    def _log_refusal(self, request: Frame, remote_address: str, refusal: str) -> None:
        access_key = request.ext.get(ACCESS_KEY)
        account = access_key if isinstance(access_key, str) and access_key in self.rules.accounts else None
        key = (account, request.code)
        now = self._clock()
        quiet_until, unlogged = self._refusals_logged.get(key, (now, 0))
        if now < quiet_until:
            self._refusals_logged[key] = (quiet_until, unlogged + 1)
            return
        self._refusals_logged[key] = (now + REFUSAL_LOG_INTERVAL_S, 0)
        # A oneway request's sender is told nothing (a producer's END_TRANSACTION commit, lost): only the log shows it.
        oneway = request.is_oneway
        log.log(logging.WARNING if oneway else logging.INFO,
                "request refused by ACL code=%d oneway=%s remote=%s not_logged_since_last=%d: %s", request.code,
                oneway, remote_address or "?", unlogged, refusal)
