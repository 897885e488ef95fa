"""AdminClient's message lookups against a fake instance: which nodes are asked in which order, and how the
answers of several groups are merged. The real requests are exercised in tests/cluster/test_admin_cli.py."""

from __future__ import annotations

import cbor2
import pytest

from client.admin import AdminClient
from client.errors import ClientError, NoRouteError
from remoting.codec import make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import BrokerSystemError, ConnectError
from remoting.message import MessageInput, create_msg_id, encode_record, record_size

GROUPS = {"broker-a": {0: "127.0.0.1:10", 1: "127.0.0.1:11", 2: "127.0.0.1:12"},
          "broker-b": {0: "127.0.0.1:20", 1: "127.0.0.1:21"}}


def _record(body: bytes, store_ts: int, phy_offset: int, store_host=("127.0.0.1", 10), keys="k") -> bytes:
    message = MessageInput("T", 1, body, {"KEYS": keys, "UNIQ_KEY": "AB" * 12 if body == b"uniq" else "CD" * 12})
    buf = bytearray(record_size(len(body), 1, 64))
    size = encode_record(buf, 0, message, queue_offset=7, phy_offset=phy_offset, store_timestamp=store_ts,
                         store_host=store_host)
    return bytes(buf[:size])


class FakeInstance:
    def __init__(self, answers, namesrv_bodies=None):
        self.answers = answers  # addr -> frame body (bytes), a response code, or an exception to raise
        self.namesrv_bodies = namesrv_bodies or {}  # request code -> the name servers' answer body
        self.asked: list[tuple[str, int, dict]] = []

    async def invoke_namesrv(self, code, ext=None, body=b"", **_):
        request = make_request(code, ext=dict(ext or {}))
        if code in self.namesrv_bodies:
            return make_response(request, ResponseCode.SUCCESS, body=self.namesrv_bodies[code])
        if code == RequestCode.GET_BROKER_CLUSTER_INFO:
            data = {"broker_addr_table": {n: {"broker_addrs": {str(i): a for i, a in addrs.items()}}
                                          for n, addrs in GROUPS.items()},
                    "cluster_addr_table": {"DefaultCluster": sorted(GROUPS)}}
        else:
            data = {"queue_datas": [{"broker_name": n, "read_queue_nums": 4, "write_queue_nums": 4, "perm": 6}
                                    for n in GROUPS],
                    "broker_datas": [{"cluster": "DefaultCluster", "broker_name": n,
                                      "broker_addrs": {str(i): a for i, a in addrs.items()}}
                                     for n, addrs in GROUPS.items()]}
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(data))

    async def invoke(self, addr, code, ext=None, body=b"", *, timeout_s=None):
        self.asked.append((addr, code, dict(ext or {})))
        answer = self.answers.get(addr, ResponseCode.QUERY_NOT_FOUND)
        if isinstance(answer, Exception):
            raise answer
        request = make_request(code, ext=dict(ext or {}))
        if isinstance(answer, bytes):
            return make_response(request, ResponseCode.SUCCESS, body=answer)
        return make_response(request, answer, remark="no message here")


async def test_view_by_offset_id_asks_the_storing_group_and_falls_back_to_a_follower():
    record = _record(b"hello", 1000, 4096)
    instance = FakeInstance({"127.0.0.1:10": ConnectError("127.0.0.1:10", "refused"), "127.0.0.1:11": record})
    admin = AdminClient(instance)
    message = await admin.view_message(create_msg_id(("127.0.0.1", 10), 4096))
    assert (message.body, message.broker_name, message.phy_offset) == (b"hello", "broker-a", 4096)
    assert [(a, c) for a, c, _ in instance.asked] == [("127.0.0.1:10", RequestCode.VIEW_MESSAGE_BY_ID),
                                                      ("127.0.0.1:11", RequestCode.VIEW_MESSAGE_BY_ID)]
    assert instance.asked[1][2] == {"offset": 4096}
    # A follower's own id (a message stored while it led) finds the same group.
    instance.asked.clear()
    instance.answers["127.0.0.1:10"] = record
    assert (await admin.view_message(create_msg_id(("127.0.0.1", 12), 4096))).body == b"hello"
    assert [a for a, _c, _e in instance.asked] == ["127.0.0.1:10"]
    with pytest.raises(ClientError, match="not 'U'"):
        await admin.view_message(create_msg_id(("127.0.0.1", 10), 4096), topic="U")


async def test_view_asks_the_next_node_when_one_has_not_applied_the_message_yet():
    # Seen in the suite: right after a leader kill, the first survivor asked had the last acknowledged messages
    # only in its Raft log (not yet told they were committed) and its "not found" was reported as the group's.
    record = _record(b"late", 1000, 4096)
    instance = FakeInstance({"127.0.0.1:10": ResponseCode.QUERY_NOT_FOUND, "127.0.0.1:11": ResponseCode.SYSTEM_ERROR,
                             "127.0.0.1:12": record})
    message = await AdminClient(instance).view_message(create_msg_id(("127.0.0.1", 10), 4096))
    assert (message.body, message.broker_name) == (b"late", "broker-a")
    assert [a for a, _c, _e in instance.asked] == ["127.0.0.1:10", "127.0.0.1:11", "127.0.0.1:12"]


async def test_view_refuses_ids_of_unknown_hosts_and_reports_a_missing_message():
    admin = AdminClient(FakeInstance({"127.0.0.1:10": ResponseCode.SYSTEM_ERROR}))
    with pytest.raises(ClientError, match="10.9.9.9:10911, which is no node"):
        await admin.view_message(create_msg_id(("10.9.9.9", 10911), 0))
    with pytest.raises(ClientError, match="no message .*'broker-a'.*no message here"):
        await admin.view_message(create_msg_id(("127.0.0.1", 10), 0))
    with pytest.raises(ValueError, match="give its topic"):
        await admin.view_message("AB" * 12)


async def test_an_id_stored_by_a_node_registered_no_more_is_asked_of_every_group_with_the_whole_id():
    # The leader that stored it was killed (unregistered), its followers still hold it: refused before.
    gone = ("127.0.0.1", 29)
    record = _record(b"hello", 1000, 4096, store_host=gone)
    instance = FakeInstance({"127.0.0.1:10": ConnectError("127.0.0.1:10", "refused"), "127.0.0.1:20": record})
    msg_id = create_msg_id(gone, 4096)
    message = await AdminClient(instance).view_message(msg_id)
    assert (message.body, message.broker_name, message.store_host) == (b"hello", "broker-b", gone)
    assert [(a, c, e) for a, c, e in instance.asked] == [
        (addr, RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": msg_id}) for addr in ("127.0.0.1:10", "127.0.0.1:11",
                                                                                  "127.0.0.1:12", "127.0.0.1:20")]
    with pytest.raises(ClientError, match=r"127.0.0.1:29, which is no node .* no group holds it \(broker-a: no "
                                          r"message here; broker-b: no message here\)"):
        await AdminClient(FakeInstance({})).view_message(msg_id)


async def test_query_by_key_merges_every_group_newest_first_and_finds_unique_ids():
    a = _record(b"a-old", 1000, 0) + _record(b"uniq", 3000, 200)
    b = _record(b"b-mid", 2000, 0, store_host=("127.0.0.1", 20))
    instance = FakeInstance({"127.0.0.1:10": a, "127.0.0.1:20": b})
    admin = AdminClient(instance)
    found = await admin.query_message("T", "k")
    assert [(m.body, m.broker_name) for m in found] == [(b"uniq", "broker-a"), (b"b-mid", "broker-b"),
                                                        (b"a-old", "broker-a")]
    assert [m.body for m in await admin.query_message("T", "k", max_num=2)] == [b"uniq", b"b-mid"]
    asked = [e for _a, c, e in instance.asked if c == RequestCode.QUERY_MESSAGE]
    assert asked[-1] == {"topic": "T", "key": "k", "max_num": 2, "begin_timestamp": 0,
                         "end_timestamp": (1 << 63) - 1}
    assert (await admin.view_message("AB" * 12, topic="T")).body == b"uniq"
    with pytest.raises(ClientError, match="no message with unique id"):
        await admin.view_message("EF" * 12, topic="T")
    for bad in ({"max_num": 0}, {"max_num": 65}, {"begin_ms": 5, "end_ms": 4}):
        with pytest.raises(ValueError):
            await admin.query_message("T", "k", **bad)


async def test_topic_changes_check_their_targets_and_wait_before_asking_anyone():
    """Found by probing: broker_names="broker-a" was taken one character per group ("broker group 'b' has no
    leader"), a negative or NaN wait_route_s failed in trio.move_on_after ("`seconds` must be non-negative")
    after every group had already created the topic, and more write than read queues were created."""
    instance = FakeInstance({})
    admin = AdminClient(instance)
    for call, error, text in [
        (admin.create_topic("T", broker_names="broker-a"), TypeError,
         "broker_names must be a list of broker group names, got 'broker-a'"),
        (admin.create_topic("T", broker_names=["broker-a", 5]), TypeError, "broker_names must be a list"),
        (admin.delete_topic("T", broker_names="broker-a"), TypeError, "broker_names must be a list"),
        (admin.create_topic("T", cluster=5), TypeError, "cluster must be a cluster name \\(str\\), got 5"),
        (admin.consumer_connections("g", cluster=5), TypeError, "cluster must be a cluster name"),
        (admin.consume_stats("g", cluster=["c"]), TypeError, "cluster must be a cluster name"),
        (admin.create_topic("T", wait_route_s=-1), ValueError,
         "wait_route_s must be a non-negative number of seconds, got -1"),
        (admin.create_topic("T", wait_route_s=float("nan")), ValueError, "wait_route_s .* got nan"),
        # Was created: consumers are assigned read queues only, so what was sent to queues 2 and 3 was never read.
        (admin.create_topic("T", read_queue_nums=2, write_queue_nums=4), ValueError,
         "write_queue_nums 4 is more than read_queue_nums 2: messages sent to queues 2..3 would be read by no "
         "consumer"),
    ]:
        with pytest.raises(error, match=text):
            await call
    assert instance.asked == []


def _cluster_info(broker_addrs=None, clusters=None) -> bytes:
    return cbor2.dumps({"broker_addr_table": {"broker-a": {"broker_addrs": broker_addrs or {"0": "127.0.0.1:10"}}},
                        "cluster_addr_table": {"DefaultCluster": clusters or ["broker-a"]}})


@pytest.mark.parametrize("call, answers, namesrv, error, text", [
    ("cluster_info", {}, {RequestCode.GET_BROKER_CLUSTER_INFO: b"\xff"}, BrokerSystemError,
     "malformed GET_BROKER_CLUSTER_INFO answer from the name servers: CBORDecodeError"),
    ("cluster_info", {}, {RequestCode.GET_BROKER_CLUSTER_INFO: _cluster_info({"0": "nowhere"})}, BrokerSystemError,
     "malformed GET_BROKER_CLUSTER_INFO answer .*nowhere"),
    ("cluster_info", {}, {RequestCode.GET_BROKER_CLUSTER_INFO: _cluster_info(clusters="broker-a")},
     BrokerSystemError, "cluster_addr_table entry 'broker-a' is not a list of texts"),
    ("list_topics", {}, {RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER: cbor2.dumps({"topic_list": "TopicA"})},
     BrokerSystemError, "malformed GET_ALL_TOPIC_LIST_FROM_NAMESERVER answer .*topic_list 'TopicA'"),
    ("get_route", {}, {RequestCode.GET_ROUTEINFO_BY_TOPIC: b"\xff"}, NoRouteError, "is not valid CBOR"),
    ("topic_status", {"127.0.0.1:10": cbor2.dumps({"offsets": [{"queue_id": 0, "min_offset": "0",
                                                                "max_offset": 5}]}),
                      "127.0.0.1:20": cbor2.dumps({})},
     {}, BrokerSystemError, "malformed GET_TOPIC_STATS_INFO answer from broker group 'broker-a': .*min_offset '0'"),
    ("consume_stats", {"127.0.0.1:10": cbor2.dumps({"consume_tps": "fast"}), "127.0.0.1:20": b""}, {},
     BrokerSystemError,
     "malformed GET_CONSUME_STATS answer from broker group 'broker-a': .*consume_tps 'fast'"),
    ("consumer_connections", {"127.0.0.1:10": cbor2.dumps({"connections": [{"client_id": 5}]}),
                              "127.0.0.1:20": b""}, {}, BrokerSystemError,
     "malformed GET_CONSUMER_CONNECTION_LIST answer from broker group 'broker-a': .*client_id 5"),
    ("reset_offset", {"127.0.0.1:10": cbor2.dumps({"offsets": [{"queue_id": 0}]}), "127.0.0.1:20": b""}, {},
     BrokerSystemError,
     "malformed INVOKE_BROKER_TO_RESET_OFFSET answer from broker group 'broker-a': KeyError: 'offset'"),
    ("query_message", {"127.0.0.1:10": b"\x00" * 40}, {}, BrokerSystemError,
     "malformed QUERY_MESSAGE answer from broker group 'broker-a'"),
    ("broker_status", {"127.0.0.1:10": cbor2.dumps([1, 2])}, {}, BrokerSystemError,
     "malformed GET_BROKER_RUNTIME_INFO answer from 127.0.0.1:10: TypeError: the status is a list"),
    ("delay_offsets", {"127.0.0.1:10": cbor2.dumps({"levels": [{"level": 1}]})}, {}, BrokerSystemError,
     "malformed GET_ALL_DELAY_OFFSET answer from 127.0.0.1:10: KeyError: 'delay_ms'"),
])
async def test_an_answer_that_cannot_be_read_is_that_peers_error_naming_the_request(call, answers, namesrv, error,
                                                                                   text):
    # Each came out of the admin call as a bare CBORDecodeError, KeyError or TypeError (a traceback from the CLI),
    # or was handed on as it was: a topic list "TopicA" sorted into six one-letter topics.
    admin = AdminClient(FakeInstance(answers, namesrv))
    args = {"cluster_info": (), "list_topics": (), "get_route": ("T",), "topic_status": ("T",),
            "consume_stats": ("g",), "consumer_connections": ("g",), "reset_offset": ("g", "T", 0),
            "query_message": ("T", "k"), "broker_status": ("127.0.0.1:10",),
            "delay_offsets": ("127.0.0.1:10",)}[call]
    with pytest.raises(error, match=text):
        await getattr(admin, call)(*args)


async def test_a_follower_whose_consume_tps_cannot_be_read_is_left_out_of_the_total():
    # It raised out of the nursery that asks the followers and failed the whole consume_stats.
    leader = cbor2.dumps({"consume_tps": 5.0, "consumer_ids": ["c1"], "offsets": [
        {"topic": "T", "queue_id": 0, "broker_offset": 9, "consumer_offset": 4, "lag": 5, "last_timestamp": None}]})
    answers = {"127.0.0.1:10": leader, "127.0.0.1:11": cbor2.dumps({"consume_tps": float("nan")}),
               "127.0.0.1:12": cbor2.dumps({"consume_tps": 2}), "127.0.0.1:20": cbor2.dumps({}),
               "127.0.0.1:21": b"\xff"}
    stats = await AdminClient(FakeInstance(answers)).consume_stats("g")
    assert stats.consume_tps == 7.0
    assert stats.total_lag == 5 and stats.consumer_ids == {"broker-a": ("c1",), "broker-b": ()}
