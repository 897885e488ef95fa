"""Pure client parts: tag filters, tags codes, allocation, routes and queue selection, offsets, messages."""

from __future__ import annotations

import json

import pytest

import client
from client.filter import parse_subscription, tags_code
from client.message import Message, MessageQueue, new_uniq_key
from client.offset_store import LocalFileOffsetStore, OffsetStore
from client.rebalance import allocate_average, diff_assignment
from client.route import (PERM_READ, PERM_WRITE, FaultTracker, RouteCache, TopicPublishInfo, parse_route)
from client.errors import NoRouteError


# -- filters ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tag,code", [("TagA", 2598919), ("", 0), ("hello", 99162322),
                                      ("polygenelubricants", -2147483648), ("中文", 646394)])
def test_tags_code_is_java_string_hashcode(tag, code):
    # Java's "x".hashCode(); "polygenelubricants" is the well-known Integer.MIN_VALUE case.
    assert tags_code(tag) == code


def test_parse_subscription_all_and_tags():
    assert parse_subscription("T", "*").matches_all
    assert parse_subscription("T", None).matches_all
    assert parse_subscription("T", "  ").matches("anything")
    sub = parse_subscription("T", "TagB || TagA")
    assert sub.tags == {"TagA", "TagB"}
    assert sub.expression == "TagA || TagB"
    assert sub.codes == {tags_code("TagA"), tags_code("TagB")}
    assert sub.matches("TagA") and not sub.matches("TagC") and not sub.matches(None)


@pytest.mark.parametrize("expr", ["TagA ||", "TagA || *", "TagA | TagB", "||"])
def test_parse_subscription_rejects_malformed(expr):
    with pytest.raises(ValueError, match="tag expression"):
        parse_subscription("T", expr)


def test_a_subscription_longer_than_a_broker_takes_is_refused_when_made():
    # The broker refuses a pull or heartbeat whose expression exceeds 4,096 characters: a consumer subscribed
    # with one would start and then never consume. What counts is the expression as sent, " || " between tags.
    tags = [f"Tag{i:05d}" for i in range(342)]  # 8 characters each: 342 * 8 + 341 * 4 = 4,100 as sent
    with pytest.raises(ValueError, match="is 4100 characters long as sent .342 tags.*at most 4096"):
        parse_subscription("T", "||".join(tags))
    assert len(parse_subscription("T", "||".join(tags[:341])).expression) == 4088


# -- allocation ------------------------------------------------------------------------------------------------------
def _queues(n, broker="broker-a"):
    return [MessageQueue("T", broker, i) for i in range(n)]


@pytest.mark.parametrize("n_mq,n_cid", [(8, 2), (8, 3), (3, 5), (16, 3), (1, 1), (7, 7)])
def test_allocate_average_partitions_every_queue_once(n_mq, n_cid):
    mqs = _queues(n_mq)
    cids = [f"c{i}" for i in range(n_cid)]
    got = [allocate_average("g", c, reversed(mqs), cids) for c in cids]
    flat = [mq for part in got for mq in part]
    assert sorted(flat) == sorted(mqs)
    sizes = [len(p) for p in got]
    assert max(sizes) - min(sizes) <= 1


def test_allocate_average_matches_rocketmq_blocks():
    mqs = _queues(8)
    cids = ["a", "b", "c"]
    assert [q.queue_id for q in allocate_average("g", "a", mqs, cids)] == [0, 1, 2]
    assert [q.queue_id for q in allocate_average("g", "b", mqs, cids)] == [3, 4, 5]
    assert [q.queue_id for q in allocate_average("g", "c", mqs, cids)] == [6, 7]
    assert allocate_average("g", "zzz", mqs, cids) == []


def test_diff_assignment():
    a, b, c = _queues(3)
    d = diff_assignment([a, b], [b, c])
    assert d.added == (c,) and d.removed == (a,) and d.changed
    assert not diff_assignment([a], [a]).changed


# -- routes ----------------------------------------------------------------------------------------------------------
ROUTE = {"queue_datas": [{"broker_name": "broker-b", "read_queue_nums": 2, "write_queue_nums": 2,
                          "perm": PERM_READ | PERM_WRITE, "topic_sys_flag": 0},
                         {"broker_name": "broker-a", "read_queue_nums": 4, "write_queue_nums": 3,
                          "perm": PERM_READ | PERM_WRITE, "topic_sys_flag": 0}],
         "broker_datas": [{"cluster": "c", "broker_name": "broker-a",
                           "broker_addrs": {"0": "127.0.0.1:1", "1": "127.0.0.1:2", "2": "127.0.0.1:3"}},
                          {"cluster": "c", "broker_name": "broker-b", "broker_addrs": {"0": "127.0.0.1:4"}}]}


def test_parse_route_and_queues():
    route = parse_route("T", ROUTE)
    assert route.broker("broker-a").master_addr == "127.0.0.1:1"
    assert len(route.write_queues()) == 5
    assert len(route.read_queues()) == 6
    assert route.write_queues()[0] == MessageQueue("T", "broker-a", 0)


def test_parse_route_malformed_names_topic():
    with pytest.raises(NoRouteError, match="'T'"):
        parse_route("T", {"queue_datas": [{"broker_name": "x"}]})


def test_write_queues_skip_groups_without_leader_or_write_perm():
    data = json.loads(json.dumps(ROUTE))
    data["broker_datas"][1]["broker_addrs"] = {}
    data["queue_datas"][1]["perm"] = PERM_READ
    route = parse_route("T", data)
    assert route.write_queues() == []
    with pytest.raises(NoRouteError, match="no writable queue"):
        TopicPublishInfo(route).select(None)


def test_fault_tracker_avoids_failed_group_for_isolation_period():
    now = [100.0]
    ft = FaultTracker(isolation_ms=1000, clock=lambda: now[0])
    ft.update("a", 5, isolation=True)
    assert not ft.is_available("a") and ft.is_available("b")
    now[0] += 1.01
    assert ft.is_available("a")
    ft.update("a", 600, isolation=False)  # slow: avoided a while
    assert not ft.is_available("a")
    ft.update("a", 1, isolation=False)
    assert ft.is_available("a")


def test_select_round_robin_and_fault_avoidance():
    info = TopicPublishInfo(parse_route("T", ROUTE))
    picks = [info.select(None) for _ in range(10)]
    assert len(set(picks)) == 5  # round robin over every writable queue
    ft = FaultTracker(clock=lambda: 0.0)
    ft.update("broker-a", 0, isolation=True)
    assert {info.select(ft).broker_name for _ in range(10)} == {"broker-b"}
    # a retry avoids the group that just failed even if the tracker has not marked it
    assert {info.select(None, last_broker="broker-b").broker_name for _ in range(10)} == {"broker-a"}
    # everything unavailable: still answers rather than failing
    ft.update("broker-b", 0, isolation=True)
    assert info.select(ft).broker_name in {"broker-a", "broker-b"}


async def test_route_cache_single_flight_hints_and_failover_between_namesrvs():
    import trio
    calls = []

    async def query(addr, topic):
        calls.append(addr)
        if addr == "ns:1":
            raise ConnectionRefusedError("down")
        await trio.sleep(0.01)
        return ROUTE if topic == "T" else None

    cache = RouteCache(["ns:1", "ns:2"], query)
    cache._ns_index = 0
    async with trio.open_nursery() as n:
        for _ in range(5):
            n.start_soon(cache.get, "T")
    assert calls.count("ns:2") == 1
    assert cache.master_addr("broker-a") == "127.0.0.1:1"
    cache.set_leader_hint("broker-a", "127.0.0.1:2")
    assert cache.master_addr("broker-a") == "127.0.0.1:2"
    assert cache.replica_addrs("broker-a")[0] == "127.0.0.1:2"
    assert set(cache.replica_addrs("broker-a")) == {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}
    cache.drop_leader_hint("broker-a", "127.0.0.1:2")
    assert cache.master_addr("broker-a") == "127.0.0.1:1"
    with pytest.raises(NoRouteError, match="no name server that answered knows topic 'U'"):
        await cache.get("U")


async def test_a_route_query_given_up_by_its_starter_is_asked_again_by_those_who_waited_for_it():
    # They were handed the starter's trio.Cancelled, which unwound tasks nobody had cancelled.
    import trio

    calls: list[str] = []

    async def query(addr, topic):
        calls.append(topic)
        await trio.sleep(0.2)
        return ROUTE if topic == "T" else None

    cache = RouteCache(["ns:1"], query)
    outcomes: list[object] = []

    async def wait_for(topic: str) -> None:
        try:
            outcomes.append((await cache.refresh(topic)).broker_datas[0].broker_name)
        except NoRouteError as e:
            outcomes.append(type(e).__name__)

    for topic, expected in (("T", "broker-a"), ("U", "NoRouteError")):
        calls.clear()
        outcomes.clear()
        gave_up: list[bool] = []

        async def starter() -> None:
            with trio.move_on_after(0.05) as scope:
                await cache.refresh(topic)
            gave_up.append(scope.cancelled_caught)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(starter)
            while topic not in calls:  # the starter's query is under way
                await trio.sleep(0.001)
            nursery.start_soon(wait_for, topic)
            nursery.start_soon(wait_for, topic)
        assert gave_up == [True]
        assert outcomes == [expected, expected] and calls == [topic, topic], (outcomes, calls)
    # A finished query is the answer for those who waited: one call for any number of them.
    calls.clear()
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(wait_for, "T")
    assert calls == ["T"]


async def test_a_malformed_route_from_one_name_server_is_that_ones_failure_and_the_next_is_asked():
    # A body that was not CBOR raised a bare ValueError from the route query, which the background refreshes
    # (expecting RaftMQError) let through, taking the client down; a malformed map ended the query at the first
    # name server, however well the others knew the topic.
    from client.route import decode_route_response

    for body in (b"\xff\x00", b"\x83\x01"):  # not CBOR; CBOR but an array
        with pytest.raises(NoRouteError, match="name server's route for topic 'T'") as info:
            decode_route_response({}, body, "T")
        assert info.value.retriable
    answers = {"ns:1": {"queue_datas": 5, "broker_datas": []}, "ns:2": ROUTE}

    async def query(addr, topic):
        return answers[addr]

    cache = RouteCache(["ns:1", "ns:2"], query)
    cache._ns_index = 0
    assert await cache.refresh("T") == parse_route("T", ROUTE)
    answers["ns:2"] = {"queue_datas": [{"broker_name": None}]}  # both malformed: the error says so
    with pytest.raises(NoRouteError, match="malformed"):
        await cache.refresh("T")


async def test_a_peers_bad_broker_address_is_refused_where_it_comes_in():
    # A route naming "x" as a broker, or a NOT_LEADER hint of "nonsense", reached the connection pool, whose
    # ValueError (meant for a caller's bad argument) ended the client's heartbeat task and with it the client.
    import copy

    bad = copy.deepcopy(ROUTE)
    bad["broker_datas"][0]["broker_addrs"]["0"] = "x"
    with pytest.raises(NoRouteError, match="malformed.*broker address must look like HOST:PORT"):
        parse_route("T", bad)
    bad["broker_datas"][0]["broker_addrs"]["0"] = ["127.0.0.1:1"]
    with pytest.raises(NoRouteError, match="malformed"):
        parse_route("T", bad)
    cache = RouteCache(["ns:1"], lambda addr, topic: _answer(ROUTE))
    await cache.refresh("T")
    cache.set_leader_hint("broker-a", "127.0.0.1:3")
    for hint in ("nonsense", "127.0.0.1:0", "127.0.0.1:99999"):
        cache.set_leader_hint("broker-a", hint)  # ignored, and the older hint with it: the route decides
        assert cache.master_addr("broker-a") == "127.0.0.1:1"


def test_new_send_result_is_a_plain_send_result():
    from client.message import SendResult, SendStatus, _NewSendResult
    from tests.unit.client.test_record_decode import assert_built_as_the_dataclass
    args = (SendStatus.FLUSH_DISK_TIMEOUT, "id1", "off1", MessageQueue("T", "broker-a", 3), 7, ("id1",))
    assert_built_as_the_dataclass(_NewSendResult(*args), SendResult(*args), args, {"queue_offset": 8},
                                  hashable=True)


async def test_master_addr_follows_each_route_and_hint_change_after_it_was_asked():
    # The answer is remembered between sends; every change that may alter it must be seen at once.
    routes = {"T": ROUTE}
    cache = RouteCache(["ns:1"], lambda addr, topic: _answer(routes[topic]))
    assert cache.master_addr("broker-a") is None  # no route yet
    await cache.refresh("T")
    assert cache.master_addr("broker-a") == "127.0.0.1:1"
    cache.set_leader_hint("broker-a", "127.0.0.1:3")
    assert cache.master_addr("broker-a") == "127.0.0.1:3"
    cache.set_leader_hint("broker-a", None)
    assert cache.master_addr("broker-a") == "127.0.0.1:1"
    cache.set_leader_hint("broker-a", "127.0.0.1:3")
    cache.drop_leader_hint("broker-a", "127.0.0.1:3")
    assert cache.master_addr("broker-a") == "127.0.0.1:1"
    moved = json.loads(json.dumps(ROUTE))
    moved["broker_datas"][0]["broker_addrs"] = {"0": "127.0.0.1:2", "1": "127.0.0.1:1"}
    routes["T"] = moved
    await cache.refresh("T")  # a new leader registered
    assert cache.master_addr("broker-a") == "127.0.0.1:2"
    del moved["broker_datas"][0]["broker_addrs"]["0"]
    await cache.refresh("T")  # no leader registered: a follower is asked, and redirects
    assert cache.master_addr("broker-a") == "127.0.0.1:1"
    cache.install_default("U", {"broker-c": {0: "127.0.0.1:9"}}, 4)
    assert cache.master_addr("broker-c") == "127.0.0.1:9"


async def _answer(route):
    return route


def test_select_without_faults_to_skip_is_plain_round_robin():
    info = TopicPublishInfo(parse_route("T", ROUTE))
    ft = FaultTracker(clock=lambda: 0.0)
    ft.update("broker-a", 600, isolation=False)
    ft.update("broker-a", 1, isolation=False)  # fast again: nothing avoided any more
    assert not ft.avoiding
    start = next(info._counter) + 1
    assert [info.select(ft) for _ in range(10)] == [info.queues[(start + i) % 5] for i in range(10)]
    ft.update("broker-b", 0, isolation=True)
    assert ft.avoiding and {info.select(ft).broker_name for _ in range(10)} == {"broker-a"}


async def test_a_name_server_that_does_not_know_the_topic_is_not_the_last_word():
    """Found by probing: a name server restarted less than a registration interval (30 s) ago answers
    TOPIC_NOT_EXIST for topics the others route; the cache took the first such answer as 'no name server knows
    topic', so the producer auto-created the topic and the push consumer thought it created later."""
    calls = []
    answers = {"ns:1": {}, "ns:2": {"T": ROUTE}, "ns:3": {}}

    async def query(addr, topic):
        calls.append(addr)
        if answers[addr] is None:
            raise ConnectionRefusedError("down")
        return answers[addr].get(topic)

    cache = RouteCache(["ns:1", "ns:2", "ns:3"], query)
    cache._ns_index = 0
    route = await cache.get("T")
    assert route.broker("broker-a").master_addr == "127.0.0.1:1"
    assert calls == ["ns:1", "ns:2"]
    calls.clear()
    await cache.refresh("T")  # the next query starts with the name server that routed it
    assert calls == ["ns:2"]

    # Unknown everywhere: only then is the topic unknown, after asking every name server once.
    calls.clear()
    with pytest.raises(NoRouteError, match="no name server knows topic 'U' \\(asked ns:2, ns:3, ns:1\\)") as e:
        await cache.get("U")
    assert e.value.topic_unknown is True
    assert calls == ["ns:2", "ns:3", "ns:1"]

    # One name server down and the rest saying unknown: no one routes it. Still topic_unknown, as before (a
    # consumer subscribed to a topic created later must consume it from its first message), and said so.
    answers["ns:2"] = None
    with pytest.raises(NoRouteError, match="no name server that answered knows topic 'U' \\(ns:3, ns:1; "
                                           "ns:2 did not answer: down\\)") as e:
        await cache.get("U")
    assert e.value.topic_unknown is True
    # None answering at all is not 'unknown'.
    answers["ns:1"] = answers["ns:3"] = None
    with pytest.raises(NoRouteError, match="no name server answered for topic 'U'") as e:
        await cache.get("U")
    assert getattr(e.value, "topic_unknown", False) is False

# -- offsets ---------------------------------------------------------------------------------------------------------
def test_offset_store_dirty_and_increase_only():
    s = OffsetStore()
    mq = MessageQueue("T", "b", 0)
    s.update(mq, 5)
    s.update(mq, 3, increase_only=True)
    assert s.read_cached(mq) == 5 and s.dirty() == {mq: 5}
    s.mark_clean(mq, 5)
    assert s.dirty() == {}
    with pytest.raises(ValueError, match="must be >= 0"):
        s.update(mq, -1)


async def test_local_file_offset_store_roundtrip(tmp_path):
    path = tmp_path / "o.json"
    s = LocalFileOffsetStore(path)
    mq = MessageQueue("T", "b", 1)
    s.update(mq, 42)
    await s.persist_all()
    assert await LocalFileOffsetStore(path).read_from_store(mq) == 42
    path.write_text("{nope")
    with pytest.raises(ValueError, match="malformed"):
        LocalFileOffsetStore(path)


async def test_local_offset_store_refuses_an_unusable_directory_and_survives_a_failed_write(tmp_path, caplog):
    """Found by probing: a directory that could not be created raised a bare FileExistsError from the first
    background persist and took the broadcasting consumer down; now it fails when the store is made, and a later
    failed write is logged and retried like a failed remote commit."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="directory .*file/sub' for the offset file cannot be created"):
        LocalFileOffsetStore(tmp_path / "file" / "sub" / "offsets.json")
    s = LocalFileOffsetStore(tmp_path / "dir" / "offsets.json")
    mq = MessageQueue("T", "b", 1)
    s.update(mq, 7)
    (tmp_path / "dir").rmdir()
    (tmp_path / "dir").write_text("")  # the directory replaced by a file under the running consumer
    assert await s.persist_all() == 1
    assert "offset file not written" in caplog.text
    assert s.dirty() == {mq: 7}
    (tmp_path / "dir").unlink()
    assert await s.persist_all() == 0
    assert await LocalFileOffsetStore(tmp_path / "dir" / "offsets.json").read_from_store(mq) == 7


# -- messages and API ------------------------------------------------------------------------------------------------
def test_message_properties_and_validation():
    m = Message("T", b"x", tags="TagA", keys=["k1", "k2"], properties={"a": "b"})
    assert m.wire_properties() == {"a": "b", "TAGS": "TagA", "KEYS": "k1 k2"}
    with pytest.raises(TypeError, match="body must be bytes"):
        Message("T", "text")
    with pytest.raises(ValueError, match="topic must not be empty"):
        Message("", b"")
    assert Message("T", b"x", keys=("k1", "k2")).wire_properties()["KEYS"] == "k1 k2"
    for bad in (-1, ["k1", 2], {"k": "v"}, b"k"):  # were a TypeError from str.join, or stored as their repr
        with pytest.raises(TypeError, match="Message.keys must be a string or a list of strings"):
            Message("T", b"x", keys=bad)
    # Found by probing: properties=None or a list raised AttributeError ('.items'); a flag outside int32 was sent
    # by send() unchecked and refused by the broker (send_batch refused it, as a ValueError).
    for bad in (None, [("a", "b")]):
        with pytest.raises(TypeError, match="Message.properties must map str to str, got"):
            Message("T", b"x", properties=bad)
    for bad in ("1", 1.0, True, 2 ** 31, -(2 ** 31) - 1):
        with pytest.raises(ValueError, match=r"Message.flag must be an integer within -2147483648..2147483647, got"):
            Message("T", b"x", flag=bad)
    assert Message("T", b"x", flag=-(2 ** 31)).flag == -(2 ** 31)
    # Found by probing: a list key with a space was indexed as two keys (query_message by it found nothing), and a
    # tag no expression can name ("A ", "A||B", "*") reached '*' subscribers only.
    with pytest.raises(ValueError, match="keys list items must not contain the key separator ' ', got \\['order 1'"):
        Message("T", b"x", keys=["order 1"])
    assert Message("T", b"x", keys="k1 k2").wire_properties()["KEYS"] == "k1 k2"  # a str: separated keys
    for bad in ("A ", " A", "A||B", "A|B", "*"):
        with pytest.raises(ValueError, match="cannot be named by a tag expression"):
            Message("T", b"x", tags=bad)
    assert Message("T", b"x", tags="Tag A").tags == "Tag A"
    # tags="A" silently replaced properties={"TAGS": "B"}, and a TAGS property skipped the checks of tags.
    for name, attribute in (("TAGS", "tags"), ("KEYS", "keys")):
        with pytest.raises(ValueError, match=f"Message.properties must not set '{name}': give Message.{attribute}"):
            Message("T", b"x", properties={name: "B"})
    # TRAN_MSG by hand made a half message that no END_TRANSACTION would end and no listener check.
    for name in ("TRAN_MSG", "PGROUP"):
        with pytest.raises(ValueError, match=f"must not set '{name}': send it with Producer.send_in_transaction"):
            Message("T", b"x", properties={name: "true"})
    keys = {new_uniq_key() for _ in range(1000)}
    assert len(keys) == 1000


def test_public_api_is_pinned():
    assert sorted(client.__all__) == sorted([
        "open_producer", "Producer", "ProducerConfig",
        "open_push_consumer", "PushConsumer", "PushConsumerConfig", "ConsumeStatus", "ReconsumeLater",
        "open_pull_consumer", "PullConsumer", "PullConsumerConfig",
        "open_lite_pull_consumer", "LitePullConsumer", "LitePullConsumerConfig",
        "open_simple_consumer", "SimpleConsumer", "SimpleConsumerConfig", "ReceivedMessage",
        "open_admin", "AdminClient", "ClusterInfo", "ConsumeStats", "ConsumerConnection", "OffsetReset",
        "QueueConsumeStats", "TopicQueueStatus", "DelayLevelProgress", "TopicPermUpdate", "ProducerConnection",
        "GroupDeletion", "BrokerConfigUpdate", "SubscriptionGroup", "SubscriptionGroupUpdate",
        "Message", "MessageExt", "MessageQueue", "SendResult", "SendStatus", "PullResult", "PullStatus",
        "create_reply_message",
        "Subscription", "MessageSelector", "parse_subscription", "tags_code",
        "allocate_average", "allocate_average_by_circle", "allocate_consistent_hash", "allocate_by_config",
        "TransactionListener", "TransactionSendResult", "TransactionState",
        "TraceContext", "TraceType",
        "RaftMQError", "RemotingError", "ConnectError", "ConnectionClosedError", "RequestTimeoutError",
        "BrokerError", "NotLeaderError", "ClientError", "NoRouteError", "ClientClosedError",
        "MessageTooLargeError", "SendFailedError", "ConfigError", "SubscriptionRefusedError", "ReplyTimeoutError",
        "TooManyRequestsError"])
    for name in client.__all__:
        assert hasattr(client, name), name


async def test_route_without_registered_leader_keeps_queues_and_asks_a_follower():
    data = json.loads(json.dumps(ROUTE))
    data["broker_datas"][0]["broker_addrs"] = {"2": "127.0.0.1:2", "3": "127.0.0.1:3"}  # leader just died

    async def query(addr, topic):
        return data

    cache = RouteCache(["ns:1"], query)
    cache.set_leader_hint("broker-a", "127.0.0.1:9")
    await cache.refresh("T")  # a route without a master must not disturb the hint
    assert cache.master_addr("broker-a") == "127.0.0.1:9"
    cache.drop_leader_hint("broker-a", "127.0.0.1:9")
    assert cache.master_addr("broker-a") == "127.0.0.1:2"
    assert len((await cache.publish_info("T")).queues) == 5


def test_a_delayed_message_carries_its_level_as_the_delay_property_and_only_that_way():
    m = Message("T", b"x", delay_level=3)
    assert m.wire_properties()["DELAY"] == "3"
    assert "DELAY" not in Message("T", b"x").wire_properties()
    for bad in (-1, True, "3", 2 ** 31):
        with pytest.raises(ValueError, match="delay_level"):
            Message("T", b"x", delay_level=bad)
    with pytest.raises(ValueError, match="give Message.delay_level"):
        Message("T", b"x", properties={"DELAY": "3"})
