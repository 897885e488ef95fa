"""What every part of the admin client stands on: the name servers' answers (cluster info, topic list, routes) and the
two ways a request reaches the broker groups: to each group's leader at once, following NOT_LEADER (``_to_leaders``,
for changes: replicated there through Raft), or to any node of a group, the leader first (``_read_from_group``, for
reads: every node's commit log is byte-identical). ``client/admin.py`` assembles ``AdminClient`` from this base and
the group and message parts (``client/admin_groups.py``, ``client/admin_messages.py``). The leaders' topic and
subscription group tables are read one entry or one page at a time (``_leader_tables``): a whole table may be more
than one frame carries."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import cbor2
import trio

from client.admin_types import ClusterInfo
# The answer readers, under the names this module has always used.
from client.admin_types import names_field as _names, parse_cluster_info as _parse_cluster_info, reading as _reading
from client.errors import ClientError
from client.instance import ClientInstance, answer_data, raise_for_response
from client.route import TopicRouteData, decode_route_response, parse_route, peer_addr
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError

log = logging.getLogger(__name__)

# The most an entry of a listed table takes: a subscription group's is ~710 bytes (a 255-character name, as key and
# field, and its fields), a topic's ~360. A page of (max_frame_size_bytes - LISTING_HEADROOM_BYTES) // this entries
# fits in a frame this client takes; the broker also ends a page where its own frame would end.
LISTING_ENTRY_MAX_BYTES = 1024
LISTING_HEADROOM_BYTES = 4096


class AdminBase:
    """The part of ``AdminClient`` the others build on."""

    def __init__(self, instance: ClientInstance) -> None:
        self._instance = instance

    async def cluster_info(self) -> ClusterInfo:
        frame = await self._instance.invoke_namesrv(RequestCode.GET_BROKER_CLUSTER_INFO)
        with _reading("GET_BROKER_CLUSTER_INFO", "the name servers"):
            return _parse_cluster_info(answer_data(frame))

    async def list_topics(self) -> list[str]:
        frame = await self._instance.invoke_namesrv(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)
        with _reading("GET_ALL_TOPIC_LIST_FROM_NAMESERVER", "the name servers"):
            return sorted(_names(answer_data(frame).get("topic_list", []), "topic_list"))

    async def get_route(self, topic: str) -> TopicRouteData:
        frame = await self._instance.invoke_namesrv(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
        return parse_route(topic, decode_route_response(frame.ext, frame.body, topic))

    async def _target_masters(self, cluster: str | None, broker_names: Sequence[str] | None,
                              info: ClusterInfo | None = None) -> dict[str, str]:
        check_targets(cluster, broker_names)
        info = info if info is not None else await self.cluster_info()
        if broker_names:
            names = list(broker_names)
        elif cluster is not None:
            if cluster not in info.clusters:
                raise ClientError(f"cluster {cluster!r} is not known to the name servers "
                                  f"(known: {', '.join(sorted(info.clusters)) or 'none'})", cluster=cluster)
            names = list(info.clusters[cluster])
        else:
            names = sorted(info.broker_addrs)
        out = {}
        for name in names:
            addr = info.master_addr(name)
            if not addr:
                raise ClientError(f"broker group {name!r} has no leader registered with the name servers",
                                  broker_name=name)
            out[name] = addr
        if not out:
            raise ClientError("no broker group is registered with the name servers")
        return out

    async def _to_leaders(self, masters: Mapping[str, str], code: int, ext: dict[str, Any],
                          ok: tuple[int, ...] = (ResponseCode.SUCCESS,),
                          answered_by: dict[str, str] | None = None) -> dict[str, Any]:
        """Send one request to each group's leader at once (following NOT_LEADER); returns each group's answer
        (a code in ``ok``; any other raises). ``answered_by`` gets the address of each group's leader."""
        answers: dict[str, Any] = {}

        async def _one(name: str, addr: str) -> None:
            for _ in range(4):
                frame = await self._instance.invoke(addr, code, ext, timeout_s=10.0)
                if frame.code == ResponseCode.NOT_LEADER and frame.ext.get("leader_addr"):
                    try:
                        addr = peer_addr(frame.ext["leader_addr"])
                    except ValueError:  # no address: this NOT_LEADER is raised below, naming the node asked
                        pass
                    else:
                        continue
                answers[name] = raise_for_response(frame, ok=ok, topic=ext.get("topic") or None, broker_name=name)
                if answered_by is not None:
                    answered_by[name] = addr
                return
            raise ClientError(f"broker group {name!r} kept naming another leader (last {addr})", broker_name=name)

        await each_group(masters.items(), _one)
        return answers

    async def _leader_tables(self, masters: Mapping[str, str], code: RequestCode, key: str,
                             one: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
        """Table ``key`` (name -> config map) of each group of ``masters`` (name -> leader), from its leader by
        ``code`` (GET_ALL_TOPIC_CONFIG, GET_ALL_SUBSCRIPTIONGROUP_CONFIG). With ``one`` (the ext naming one entry,
        ``{"topic": name}`` or ``{"group_name": name}``), that entry alone; else the whole table, a page at a time
        (ext ``after``, ``limit``) until the broker's ``next_after`` is null. An older broker ignores both and
        answers its whole table at once, so the caller still picks ``one``'s entry from what comes. The pages are
        not one snapshot: an entry created or deleted while they are read may be missed or listed."""
        limit = max(1, (self._instance.config.max_frame_size_bytes - LISTING_HEADROOM_BYTES)
                    // LISTING_ENTRY_MAX_BYTES)
        tables: dict[str, dict[str, Any]] = {}

        async def _one(name: str, addr: str) -> None:
            table: dict[str, Any] = {}
            ext: dict[str, Any] = dict(one) if one else {"after": "", "limit": limit}
            while True:
                frame = (await self._to_leaders({name: addr}, code, ext))[name]
                with _reading(code.name, f"broker group {name!r}"):
                    data = cbor2.loads(frame.body)
                    page = data[key]
                    if not isinstance(page, Mapping):
                        raise TypeError(f"{key} {page!r} is not a map")
                    next_after = None if one else data.get("next_after")
                    # A name not after the last one would ask the same page again, for ever.
                    if next_after is not None and (not isinstance(next_after, str) or next_after <= ext["after"]):
                        raise ValueError(f"next_after {next_after!r} is not a name after {ext['after']!r}")
                table.update(page)
                if next_after is None:
                    tables[name] = table
                    return
                ext = {"after": next_after, "limit": limit}

        await each_group(masters.items(), _one)
        return tables

    async def _route_masters(self, topic: str, info: ClusterInfo | None = None) -> dict[str, str]:
        """The registered leader of every group that routes ``topic``."""
        route = await self.get_route(topic)
        info = info if info is not None else await self.cluster_info()
        masters = {}
        for name in sorted({q.broker_name for q in route.queue_datas}):
            addr = info.master_addr(name)
            if not addr:
                raise ClientError(f"broker group {name!r} has no leader registered with the name servers",
                                  broker_name=name)
            masters[name] = addr
        return masters

    async def _read_from_group(self, info: ClusterInfo, name: str, code: int, ext: dict[str, Any],
                               ok: tuple[int, ...] = (ResponseCode.SUCCESS,), *, until_found: bool = False) -> Any:
        """A read any node of group ``name`` serves (their commit logs are byte-identical): the leader first,
        then the others when a node cannot be reached. With ``until_found``, also when a node answers other than
        SUCCESS (the last answer when none does): a follower learns that an entry is committed a moment after the
        leader, and only from a leader, so right after a leader dies the last messages it acknowledged are in the
        survivors' Raft logs but not yet in their commit logs, and one node's "not found" is not the group's."""
        nodes = info.broker_addrs.get(name, {})
        addrs = list(dict.fromkeys(addr for _id, addr in sorted(nodes.items())))
        if not addrs:
            raise ClientError(f"broker group {name!r} has no node registered with the name servers",
                              broker_name=name)
        answer: Any = None
        error: RaftMQError | None = None
        for addr in addrs:
            try:
                frame = await self._instance.invoke(addr, code, ext, timeout_s=10.0)
            except RaftMQError as e:
                if not e.retriable:
                    raise
                error = e
                continue
            answer = raise_for_response(frame, ok=ok, topic=ext.get("topic"), broker_name=name)
            if not until_found or answer.code == ResponseCode.SUCCESS:
                return answer
        if answer is not None:
            return answer
        assert error is not None
        raise error

    async def _read_from_route(self, topic: str, code: int, ext: dict[str, Any],
                               ok: tuple[int, ...] = (ResponseCode.SUCCESS,)) -> dict[str, Any]:
        """The same read of every group that routes ``topic``, at once (``_read_from_group``); each group's
        answer."""
        route = await self.get_route(topic)
        info = await self.cluster_info()
        answers: dict[str, Any] = {}

        async def _one(name: str) -> None:
            answers[name] = await self._read_from_group(info, name, code, ext, ok)

        await each_group([(name,) for name in sorted({q.broker_name for q in route.queue_datas})], _one)
        return answers


def check_targets(cluster: Any, broker_names: Any) -> None:
    """``cluster`` and ``broker_names`` of a topic change: a str as ``broker_names`` was taken one character per
    group ("broker group 'b' has no leader"), a cluster that was no str reported as unknown to the name servers."""
    if cluster is not None and not isinstance(cluster, str):
        raise TypeError(f"cluster must be a cluster name (str), got {cluster!r}")
    if broker_names is None:
        return
    if isinstance(broker_names, (str, bytes)) or not isinstance(broker_names, Collection) or not all(
            isinstance(n, str) and n for n in broker_names):
        raise TypeError(f"broker_names must be a list of broker group names, got {broker_names!r}")


async def each_group(calls: Iterable[tuple[Any, ...]], one: Callable[..., Awaitable[None]]) -> None:
    """``one(*args)`` for every group at once. A refusal or failure (``RaftMQError``) is raised as itself, not in
    an ExceptionGroup: the first group's, by name, with the others' noted (several groups usually refuse the
    same bad topic name alike)."""
    errors: dict[str, RaftMQError] = {}

    async def _run(args: tuple[Any, ...]) -> None:
        try:
            await one(*args)
        except RaftMQError as e:
            errors[str(args[0])] = e

    async with trio.open_nursery() as nursery:
        for args in calls:
            nursery.start_soon(_run, args)
    if errors:
        first, *others = sorted(errors)
        error = errors[first]
        if others:
            error.add_note("also from broker group(s) " + "; ".join(f"{name}: {errors[name]}" for name in others))
        raise error
