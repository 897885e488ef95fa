"""An in-memory stand-in for name servers and broker groups, answering the client's requests by opaque-free
direct calls. It checks the client's *logic* (redirects, retries, rebalancing, offsets) without sockets; the
real wire is covered by tests/cluster/test_e2e_*.py."""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict

import cbor2
import trio

from client import Message, MessageQueue, open_producer
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import ConnectError, ConnectionClosedError, RequestTimeoutError
from remoting.message import MessageInput, decode_batch, encode_record, record_size

NAMESRV = "ns:9876"


class FakeGroup:
    def __init__(self, name: str, addrs: list[str], queues: int = 4) -> None:
        self.name = name
        self.addrs = addrs
        self.leader = addrs[0]
        self.queues = queues
        self.logs: dict[tuple[str, int], list[bytes]] = defaultdict(list)
        self.offsets: dict[tuple[str, str, int], int] = {}
        self.members: dict[str, set[str]] = defaultdict(set)
        self.dead: set[str] = set()
        self.phy = 0
        self.term = 1  # raise it with the leader when a test elects another node

    def append(self, topic: str, queue_id: int, m: MessageInput) -> int:
        log = self.logs[(topic, queue_id)]
        buf = bytearray(record_size(len(m.body), len(topic), 200 + sum(len(k) + len(v) + 2
                                                                       for k, v in m.properties.items())))
        size = encode_record(buf, 0, m, queue_offset=len(log), phy_offset=self.phy, store_timestamp=1,
                             store_host=("127.0.0.1", 1))
        self.phy += size
        log.append(bytes(buf[:size]))
        return len(log) - 1


class FakeConnection:
    """What the client's leader watch reads of a pooled connection to a broker node."""

    def __init__(self) -> None:
        self.last_received_at = trio.current_time()
        self.waiting: dict[int, tuple[float, int, trio.Event]] = {}  # request -> (sent at, code, wake-up)
        self.close_reason: str | None = None

    def oldest_request_sent_at(self, skip_codes: frozenset[int] = frozenset()) -> float | None:
        for sent_at, code, _ in self.waiting.values():
            if code not in skip_codes:
                return sent_at
        return None


class FakeRemoting:
    def __init__(self, groups: list[FakeGroup]) -> None:
        self.groups = groups
        self.by_addr = {a: g for g in groups for a in g.addrs}
        self.calls: list[tuple[str, int]] = []
        self.unknown_topics: set[str] = set()
        self.wake = trio.Event()
        self.conns: dict[str, FakeConnection] = {}
        # nodes (NAMESRV too) that take requests and answer nothing: a stopped process, a cut link
        self.hung: set[str] = set()
        # name servers that know no broker yet (restarted, no registration received): every topic is unknown
        self.empty_namesrvs: set[str] = set()
        self.namesrv_route_delay_s = 0.0  # NAMESRV's answer to a route query comes this late (a far or busy one)
        self._request_ids = itertools.count()

    def connections(self) -> dict[str, FakeConnection]:
        return dict(self.conns)

    def close_connection(self, addr: str, reason: str = "closed locally") -> None:
        conn = self.conns.pop(addr, None)
        if conn is not None:
            conn.close_reason = reason
            for _, _, wake in conn.waiting.values():
                wake.set()

    def resume(self, addr: str) -> None:
        """A hung node answers again, its waiting requests first."""
        self.hung.discard(addr)
        conn = self.conns.get(addr)
        for _, _, wake in (conn.waiting.values() if conn is not None else ()):
            wake.set()

    def route(self, topic: str) -> dict:
        return {"queue_datas": [{"broker_name": g.name, "read_queue_nums": g.queues, "write_queue_nums": g.queues,
                                 "perm": 6} for g in self.groups],
                "broker_datas": [{"cluster": "c", "broker_name": g.name,
                                  "broker_addrs": {str(i + 1): a for i, a in enumerate(g.addrs)} | {"0": g.leader}}
                                 for g in self.groups]}

    async def invoke_oneway(self, addr, request):
        await self.invoke(addr, request)

    async def invoke(self, addr, request, timeout_s=3.0):
        await trio.lowlevel.checkpoint()
        self.calls.append((addr, request.code))
        code, ext = request.code, request.ext
        if addr in self.empty_namesrvs:
            if code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
                return make_response(request, ResponseCode.TOPIC_NOT_EXIST, remark="no route")
            if code == RequestCode.GET_BROKER_CLUSTER_INFO:
                return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps({"broker_addr_table": {}}))
            raise AssertionError(code)
        if addr == NAMESRV:
            if addr in self.hung:
                await trio.sleep(timeout_s)
                raise RequestTimeoutError(addr, timeout_s, code)
            if code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
                await trio.sleep(self.namesrv_route_delay_s)
                # A group's retry topic exists only once a member sent a message back, as on a real cluster.
                if ext["topic"] in self.unknown_topics or ext["topic"].startswith("%RETRY%"):
                    return make_response(request, ResponseCode.TOPIC_NOT_EXIST, remark="no route")
                return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(self.route(ext["topic"])))
            if code == RequestCode.GET_BROKER_CLUSTER_INFO:
                table = {g.name: {"broker_addrs": {"0": g.leader}} for g in self.groups}
                return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps({"broker_addr_table": table}))
            raise AssertionError(code)
        g = self.by_addr[addr]
        if addr in g.dead:
            raise ConnectError(addr, "connection refused")
        conn = self.conns.get(addr)
        if conn is None:
            conn = self.conns[addr] = FakeConnection()
        if addr in self.hung:
            request_id, wake = next(self._request_ids), trio.Event()
            conn.waiting[request_id] = (trio.current_time(), code, wake)
            try:
                with trio.move_on_after(timeout_s) as waited:
                    await wake.wait()
            finally:
                del conn.waiting[request_id]
            if conn.close_reason is not None:
                raise ConnectionClosedError(addr, conn.close_reason)
            if waited.cancelled_caught:
                raise RequestTimeoutError(addr, timeout_s, code)
        conn.last_received_at = trio.current_time()
        if code == RequestCode.GET_BROKER_RUNTIME_INFO:
            return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps({
                "broker_addr": addr, "role": "LEADER" if addr == g.leader else "FOLLOWER", "term": g.term,
                "leader_addr": g.leader}))
        if code == RequestCode.HEART_BEAT:
            body = cbor2.loads(request.body)
            for c in body["consumers"]:
                g.members[c["consumer_group"]].add(body["client_id"])
            return make_response(request, ResponseCode.SUCCESS)
        if code == RequestCode.UNREGISTER_CLIENT:
            g.members[ext["consumer_group"]].discard(ext["client_id"]) if ext.get("consumer_group") else None
            return make_response(request, ResponseCode.SUCCESS)
        if code == RequestCode.GET_CONSUMER_LIST_BY_GROUP:
            return make_response(request, ResponseCode.SUCCESS,
                                 body=cbor2.dumps({"consumer_id_list": sorted(g.members[ext["consumer_group"]])}))
        key = (ext.get("topic"), ext.get("queue_id"))
        if code in (RequestCode.SEND_MESSAGE, RequestCode.SEND_BATCH_MESSAGE, RequestCode.UPDATE_CONSUMER_OFFSET):
            if addr != g.leader:
                return make_response(request, ResponseCode.NOT_LEADER, remark="not leader",
                                     ext={"leader_addr": g.leader})
        if code == RequestCode.SEND_MESSAGE:
            if ext["properties"].get("reject"):
                return make_response(request, ResponseCode.MESSAGE_ILLEGAL, remark="body rejected")
            m = MessageInput(ext["topic"], ext["queue_id"], request.body, ext["properties"],
                             born_timestamp=ext["born_timestamp"])
            off = g.append(ext["topic"], ext["queue_id"], m)
            self.wake.set()
            self.wake = trio.Event()
            return make_response(request, ResponseCode.SUCCESS,
                                 ext={"msg_id": f"{g.name}-{off}", "queue_id": ext["queue_id"], "queue_offset": off})
        if code == RequestCode.SEND_BATCH_MESSAGE:
            _, msgs = decode_batch(request.body)
            offs = [g.append(ext["topic"], ext["queue_id"], m) for m in msgs]
            return make_response(request, ResponseCode.SUCCESS,
                                 ext={"msg_id": ",".join(map(str, offs)), "queue_id": ext["queue_id"],
                                      "queue_offset": offs[0]})
        if code == RequestCode.PULL_MESSAGE:
            log = g.logs[key]
            start = ext["queue_offset"]
            if start >= len(log) and ext["suspend_timeout_millis"]:
                with trio.move_on_after(min(ext["suspend_timeout_millis"] / 1000, 0.05)):
                    await self.wake.wait()
            if start > len(log):  # beyond the end: the real broker's correction (back to min_offset 0)
                return make_response(request, ResponseCode.PULL_OFFSET_MOVED,
                                     ext={"next_begin_offset": 0, "min_offset": 0, "max_offset": len(log)})
            recs = log[start:start + ext["max_msg_nums"]]
            fx = {"next_begin_offset": start + len(recs), "min_offset": 0, "max_offset": len(log)}
            if not recs:
                return make_response(request, ResponseCode.PULL_NOT_FOUND, ext=fx)
            return make_response(request, ResponseCode.SUCCESS, ext=fx, body=b"".join(recs))
        if code == RequestCode.QUERY_CONSUMER_OFFSET:
            off = g.offsets.get((ext["consumer_group"], *key))
            if off is None:
                return make_response(request, ResponseCode.QUERY_NOT_FOUND, ext={"offset": -1})
            return make_response(request, ResponseCode.SUCCESS, ext={"offset": off})
        if code == RequestCode.UPDATE_CONSUMER_OFFSET:
            g.offsets[(ext["consumer_group"], *key)] = ext["commit_offset"]
            return make_response(request, ResponseCode.SUCCESS)
        if code in (RequestCode.GET_MAX_OFFSET, RequestCode.GET_MIN_OFFSET):
            return make_response(request, ResponseCode.SUCCESS,
                                 ext={"offset": len(g.logs[key]) if code == RequestCode.GET_MAX_OFFSET else 0})
        raise AssertionError(f"fake broker got unexpected code {code}")


@contextlib.asynccontextmanager
async def fake_remoting_ctx(remoting: FakeRemoting):
    yield remoting


def recording_fake(monkeypatch, queues: int, *, hold_pulls: bool = False) -> FakeRemoting:
    """The push consumer's fake cluster (``client.producer`` and ``client.push_consumer`` patched to it): one group of
    ``queues`` queues. Recorded: every pull of topic T as (queue_id, mock time), every commit of T's
    offsets as (queue_id, offset), and the other requests' codes. ``hold_pulls``: a pull at the end of its queue is
    held as a broker holds it (up to the pull's suspend time, until a message arrives), not the fake's 50 ms."""
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"], queues=queues)])
    fake.pulls, fake.commits, fake.codes = [], [], []
    fake.holding = 0  # pulls held now
    answer = fake.invoke

    async def invoke(addr, request, timeout_s=3.0):
        ext = request.ext
        fake.codes.append(request.code)
        if request.code == RequestCode.UPDATE_CONSUMER_OFFSET and ext["topic"] == "T":
            fake.commits.append((ext["queue_id"], ext["commit_offset"]))
        if request.code == RequestCode.PULL_MESSAGE and ext["topic"] == "T":
            fake.pulls.append((ext["queue_id"], trio.current_time()))
            log = fake.by_addr[addr].logs[("T", ext["queue_id"])]
            if hold_pulls and ext["queue_offset"] >= len(log):
                fake.holding += 1
                try:
                    with trio.move_on_after(ext["suspend_timeout_millis"] / 1000):
                        while ext["queue_offset"] >= len(log):
                            await fake.wake.wait()
                finally:
                    fake.holding -= 1
        return await answer(addr, request, timeout_s)

    fake.invoke = invoke
    import client.producer
    import client.push_consumer

    for mod in (client.producer, client.push_consumer):
        monkeypatch.setattr(mod, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


async def wait_until(condition, timeout_s: float = 60) -> None:
    """Until ``condition()`` holds, looked at every 10 ms."""
    with trio.fail_after(timeout_s):  # virtual seconds (MockClock): a condition never met fails, it does not hang
        while not condition():
            await trio.sleep(0.01)


async def send_numbered(n: int, queue_id: int = 0, prefix: bytes = b"") -> None:
    """Messages ``prefix`` + 0 .. n-1 of topic T to queue ``queue_id`` of broker-a, one at a time."""
    async with open_producer(NAMESRV) as producer:
        for i in range(n):
            await producer.send(Message("T", prefix + b"%d" % i), queue=MessageQueue("T", "broker-a", queue_id))
