"""Producer and consumer logic against the in-memory fake cluster: redirects, retries, fault avoidance,
rebalancing, offsets, flow control, tag filtering."""

from __future__ import annotations

import functools
import json
import logging

import cbor2
import pytest
import trio
import trio.testing

import client.admin
import client.errors
import client.instance
import client.producer
import client.pull_consumer
import client.push_consumer
import client.route
from client import (Message, MessageQueue, MessageTooLargeError, SendStatus, open_pull_consumer,
                    open_push_consumer, open_producer)
from client.errors import ConfigError, MessageIllegalError
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import ConnectError, for_code


@pytest.fixture
def cluster(monkeypatch):
    groups = [FakeGroup("broker-a", ["a:1", "a:2", "a:3"]), FakeGroup("broker-b", ["b:1", "b:2", "b:3"])]
    fake = FakeRemoting(groups)
    for mod in (client.producer, client.pull_consumer, client.push_consumer, client.admin):
        monkeypatch.setattr(mod, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


async def test_send_round_robin_and_result(cluster):
    async with open_producer(NAMESRV) as p:
        results = [await p.send(Message("T", b"x%d" % i, tags="A")) for i in range(16)]
    assert all(r.send_status is SendStatus.SEND_OK for r in results)
    assert {r.message_queue for r in results} == {MessageQueue("T", b, q) for b in ("broker-a", "broker-b")
                                                   for q in range(4)}
    assert len({r.msg_id for r in results}) == 16


async def test_not_leader_redirects_at_once_and_hint_sticks(cluster):
    a = cluster.groups[0]
    a.leader = "a:2"  # the route still names a:1 ... until the client refreshes; the first answer redirects
    cluster.route = (lambda orig: (lambda topic: orig(topic) | {"broker_datas": [
        {"cluster": "c", "broker_name": "broker-a", "broker_addrs": {"0": "a:1", "1": "a:1", "2": "a:2"}},
        {"cluster": "c", "broker_name": "broker-b", "broker_addrs": {"0": "b:1"}}]}))(cluster.route)
    async with open_producer(NAMESRV) as p:
        mq = MessageQueue("T", "broker-a", 0)
        r = await p.send(Message("T", b"x"), queue=mq)
        assert r.queue_offset == 0
        assert p.statistics().redirects == 1
        await p.send(Message("T", b"y"), queue=mq)
        assert p.statistics().redirects == 1  # the hint was remembered
    sends_to_a1 = [c for c in cluster.calls if c == ("a:1", RequestCode.SEND_MESSAGE)]
    assert len(sends_to_a1) == 1


async def test_dead_group_is_retried_elsewhere_and_avoided(cluster):
    cluster.groups[0].dead.add("a:1")
    async with open_producer(NAMESRV, retry_backoff_ms=0) as p:
        results = [await p.send(Message("T", b"x")) for _ in range(10)]
    assert {r.message_queue.broker_name for r in results} == {"broker-b"}
    dead_tries = [c for c in cluster.calls if c == ("a:1", RequestCode.SEND_MESSAGE)]
    assert len(dead_tries) == 1  # isolated after the first failure


async def test_non_retriable_error_and_local_size_check(cluster):
    async with open_producer(NAMESRV, max_message_size_bytes=10) as p:
        with pytest.raises(MessageIllegalError, match="body rejected"):
            await p.send(Message("T", b"x", properties={"reject": "1"}))
        with pytest.raises(MessageTooLargeError, match="exceeds max_message_size_bytes 10"):
            await p.send(Message("T", b"x" * 11))
    # A batch is limited as a whole, as the broker limits it (was sent, and refused by the broker; over the frame
    # size, refused by the connection as "frame of N bytes exceeds the maximum frame size").
    async with open_producer(NAMESRV, max_message_size_bytes=1000) as p:
        with pytest.raises(MessageTooLargeError, match="send_batch: 10 messages take 1[0-9]{3} bytes as one batch, "
                                                       "more than max_message_size_bytes 1000"):
            await p.send_batch([Message("T", b"x" * 100)] * 10)
        assert (await p.send_batch([Message("T", b"x" * 100)] * 5)).send_status is SendStatus.SEND_OK
    assert len([c for c in cluster.calls if c[1] == RequestCode.SEND_BATCH_MESSAGE]) == 1


async def test_an_instance_name_too_long_for_a_client_id_the_brokers_take_is_refused_when_opened(cluster):
    # Brokers refuse a client id over 255 characters in every heartbeat; instance_name, part of it, was unbounded.
    from broker.consumer_manager import parse_heartbeat

    with pytest.raises(ConfigError, match="instance_name must be 1 to 127 characters long .is 128; it is part of "
                                          "the client id, which brokers hold to 255"):
        async with open_producer(NAMESRV, instance_name="n" * 128):
            pass
    async with open_producer(NAMESRV, instance_name="n" * 127, client_ip="255.255.255.255") as p:
        assert len(p.client_id) <= 255 and parse_heartbeat({"client_id": p.client_id}).client_id == p.client_id


async def test_bad_send_arguments_are_refused_before_anything_is_sent(cluster):
    """Found by probing the API with odd values: a queue that was no MessageQueue, a sharding key that was no
    string and a batch that was no sequence raised AttributeError from deep inside; a queue of another topic
    stored the message in that queue of the message's own topic; an empty body was sent (RocketMQ's client
    refuses it: "the message body length is zero")."""
    async with open_producer(NAMESRV) as p:
        message = Message("T", b"x")
        for call, error, text in [
            (p.send(message, queue=3), TypeError, "queue must be a MessageQueue, got 3"),
            (p.send(message, queue=MessageQueue("U", "broker-a", 0)), ValueError, "not of the message's topic 'T'"),
            (p.send_oneway(message, queue=MessageQueue("U", "broker-a", 0)), ValueError, "of topic 'U'"),
            (p.send(message, sharding_key=5), TypeError, "sharding_key must be a string, got 5"),
            (p.send(message, timeout_s=-1), ValueError, "timeout_s must be a positive number of seconds, got -1"),
            (p.send(message, timeout_s="3"), ValueError, "got '3'"),
            (p.send(message, timeout_s=float("nan")), ValueError, "got nan"),
            (p.send(Message("T", b"")), ValueError, "message body of topic 'T' is empty"),
            (p.send_batch([message, Message("T", b"")]), ValueError, "is empty"),
            (p.send_batch(message), TypeError, "send_batch expects a sequence of Message, got Message"),
            (p.send_batch("T"), TypeError, "got str"),
            (p.send_batch([message], queue="T"), TypeError, "queue must be a MessageQueue"),
            # A queue_id of -1 made the broker pick the queue (the pinned send stored elsewhere); a str one was
            # refused by the broker; a oneway send to a queue the topic does not have was dropped without a word.
            (p.send(message, queue=MessageQueue("T", "broker-a", -1)), ValueError,
             "queue_id must be an integer within 0..2147483647, got -1"),
            (p.send_oneway(message, queue=MessageQueue("T", "broker-a", -1)), ValueError, "got -1"),
            (p.send(message, queue=MessageQueue("T", "broker-a", "0")), ValueError, "queue_id must be .* got '0'"),
            (p.send_batch([message], queue=MessageQueue("T", "broker-a", True)), ValueError, "got True"),
            (p.send(message, queue=MessageQueue("T", "", 0)), ValueError, "broker_name must be a non-empty string"),
            (p.send_oneway(message, queue=MessageQueue("T", "broker-a", 4)), ValueError,
             "queue T@broker-a:4 is not a write queue of topic 'T' .*4 on broker-a, 4 on broker-b"),
            (p.send_oneway(message, queue=MessageQueue("T", "broker-c", 0)), ValueError, "not a write queue"),
            # The pinned queue won and the key was ignored without a word.
            (p.send(message, queue=MessageQueue("T", "broker-a", 0), sharding_key="k"), ValueError,
             "give queue or sharding_key, not both (got queue T@broker-a:0 and sharding_key 'k'"),
        ]:
            with pytest.raises(error, match=text.replace("(", r"\(")):
                await call
        assert await p.send(message, queue=MessageQueue("T", "broker-a", 0), timeout_s=2)
        # A message changed after it was made skipped its checks: an AssertionError for a topic set to None, a
        # TypeError from str.join for keys, a frame ProtocolError for a str body; properties set to None were
        # dropped by send_batch.
        for name, value, error, text in [("topic", None, TypeError, "Message.topic must be a string, got None"),
                                         ("keys", 5, TypeError, "Message.keys must be a string or a list"),
                                         ("body", "text", TypeError, "Message.body must be bytes, got str"),
                                         ("properties", None, TypeError, "Message.properties must map str to str"),
                                         ("flag", "1", ValueError, "Message.flag must be an integer")]:
            changed = Message("T", b"x")
            setattr(changed, name, value)
            for call in (p.send(changed), p.send_batch([changed]), p.send_oneway(changed)):
                with pytest.raises(error, match=text):
                    await call
    sends = [c for c in cluster.calls if c[1] in (RequestCode.SEND_MESSAGE, RequestCode.SEND_BATCH_MESSAGE)]
    assert sends == [("a:1", RequestCode.SEND_MESSAGE)]  # the good one only


async def test_properties_the_broker_would_refuse_are_refused_before_anything_is_sent(cluster):
    """Found by probing: a lone surrogate in a tag, key or property failed as a ProtocolError naming the request
    header ('ext') or, from send_batch, as a bare UnicodeEncodeError; a separator byte, an empty name or more than
    32767 bytes of properties reached the broker, which refused it, and a oneway send was dropped without a
    word."""
    biggest = "é" * 16357 + "xx"  # with TAGS, KEYS and the UNIQ_KEY a send adds: 32767 bytes, the broker's limit
    async with open_producer(NAMESRV) as p:
        mq = MessageQueue("T", "broker-a", 0)
        for fields, text in [({"keys": "\ud800"}, r"Message.keys is not valid text \(surrogates not allowed"),
                             ({"tags": "A\udfff"}, r"Message.tags is not valid text .* at position 1"),
                             ({"properties": {"p": "\ud800"}}, r"Message.properties\['p'\] is not valid text"),
                             ({"properties": {"\ud800": "v"}}, r"Message.properties\['\\ud800'\] is not valid"),
                             ({"properties": {"p": "a\x01b"}}, r"Message.properties\['p'\] must not contain the "
                                                              r"separator bytes \\x01 and \\x02, got 'a\\x01b'"),
                             ({"properties": {"p\x02": "v"}}, "must not contain the separator bytes"),
                             ({"properties": {"": "v"}}, "Message.properties must not have an empty name"),
                             ({"tags": "A", "keys": "k", "properties": {"p": biggest + "x"}},
                              "take 32768 bytes encoded, more than 32767")]:
            with pytest.raises(ValueError, match=text):
                Message("T", b"x", **fields)
            changed = Message("T", b"x")
            for name, value in fields.items():
                setattr(changed, name, value)
            for call in (p.send(changed), p.send_batch([changed]), p.send_oneway(changed, queue=mq)):
                with pytest.raises(ValueError, match=text):
                    await call
        assert cluster.calls == [c for c in cluster.calls if c[1] not in (RequestCode.SEND_MESSAGE,
                                                                           RequestCode.SEND_BATCH_MESSAGE)]
        assert await p.send(Message("T", b"x", tags="A", keys="k", properties={"p": biggest}))
        # A unique id of the caller's own counts as it is, not as the one a send would add.
        assert await p.send(Message("T", b"x", properties={"UNIQ_KEY": "u", "p": "x" * (32767 - 11 - 3)}))
        with pytest.raises(ValueError, match="take 32768 bytes"):
            Message("T", b"x", properties={"UNIQ_KEY": "u", "p": "x" * (32767 - 11 - 2)})


async def test_bad_consumer_arguments_are_refused_when_opened_or_called(cluster, tmp_path):
    """Found by probing the consumer API with odd values: without a topic the push consumer failed with an
    ExceptionGroup, an illegal group name or topic ran on with every heartbeat or route query refused, a handler
    that was no function waited for the first message to fail, and the pull consumer's arguments failed on a
    comparison or an AttributeError."""
    async def handler(msg) -> None:
        pass

    for options, error, text in [
        ({"handler": handler}, ValueError, "needs a topic or subscriptions"),
        ({"topic": "T", "handler": handler, "consumer_group": "bad group"}, ConfigError,
         "consumer_group contains illegal characters; allowed are letters"),
        ({"topic": "T", "handler": handler, "consumer_group": "g" * 256}, ConfigError, "256 characters long"),
        ({"topic": "bad topic", "handler": handler}, ValueError, "subscription topic 'bad topic' contains"),
        ({"topic": "T", "expression": 5, "handler": handler}, TypeError, "tag expression of topic 'T' must be"),
        ({"subscriptions": {"T": ["A"]}, "handler": handler}, TypeError, "must be a string, got \\['A'\\]"),
        ({"topic": "T", "handler": 5}, TypeError, "handler must be an async function"),
        # A plain function was taken: awaiting its None failed every attempt, and every message was skipped.
        ({"topic": "T", "handler": lambda msg: None}, TypeError, "handler must be an async function"),
        ({"topic": "T", "handler": _no_argument}, TypeError,
         "handler must take the message as its one argument, got .* with signature \\(\\)"),
        ({"topic": "T", "handler": _two_arguments}, TypeError, "signature \\(msg, context\\)"),
        # A list of topic names went through dict(): ["T1"] subscribed topic "T" with expression "1".
        ({"subscriptions": ["T1"], "handler": handler}, TypeError,
         "subscriptions must map topic to tag expression, .* got \\['T1'\\]"),
        ({"subscriptions": "T", "handler": handler}, TypeError, "subscriptions must map topic to tag expression"),
        # An expression without a topic, or a topic also in subscriptions with another expression, was ignored.
        ({"subscriptions": {"T": "*"}, "expression": "A", "handler": handler}, ValueError,
         "expression 'A' is for topic, which is not given"),
        ({"topic": "T", "expression": "A", "subscriptions": {"T": "B"}, "handler": handler}, ValueError,
         "topic 'T' is subscribed twice: with expression 'A' and, in subscriptions, 'B'"),
        # Java int and long on the wire: beyond them the broker refused every pull or the start offset query.
        ({"topic": "T", "handler": handler, "broker_suspend_max_time_ms": 2 ** 31}, ConfigError,
         "broker_suspend_max_time_ms must be <= 2147483647"),
        ({"topic": "T", "handler": handler, "consume_timestamp_ms": 2 ** 63}, ConfigError,
         "consume_timestamp_ms must be <= 9223372036854775807"),
        # A legal group (up to 255) too long for %RETRY%<group> failed on "subscription topic is 128 chars long".
        ({"topic": "T", "handler": handler, "consumer_group": "g" * 121}, ConfigError,
         "consumer_group 'g+'... is 121 characters long; a CLUSTERING consumer's group names its retry topic "
         "%RETRY%<group>, so it may have at most 120"),
    ]:
        with pytest.raises(error, match=text):
            async with open_push_consumer(NAMESRV, **options):
                pass
    # An offset_store_dir that cannot be made failed the first persist in the background, as a bare OSError in an
    # ExceptionGroup that took the consumer down.
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="offset_store_dir '.*file' cannot keep the offsets: directory"):
        async with open_push_consumer(NAMESRV, topic="T", handler=handler, message_model="BROADCASTING",
                                      offset_store_dir=str(tmp_path / "file")):
            pass

    # Two members of a broadcasting group in one process with one instance_name (both "DEFAULT") wrote one offset
    # file, each overwriting the other's offsets.
    broadcasting = dict(topic="T", handler=handler, message_model="BROADCASTING", offset_store_dir=str(tmp_path))
    async with open_push_consumer(NAMESRV, **broadcasting):
        with pytest.raises(ConfigError, match="another BROADCASTING consumer of group 'DEFAULT_CONSUMER' in this "
                                              "process keeps its offsets in .*give each member its own instance_name "
                                              "\\(now 'DEFAULT'\\)"):
            async with open_push_consumer(NAMESRV, **broadcasting):
                pass
        async with open_push_consumer(NAMESRV, instance_name="other", **broadcasting):
            pass
    async with open_push_consumer(NAMESRV, **broadcasting):  # released on close
        pass

    class Handler:
        async def __call__(self, msg) -> None:
            pass

    for ok in (functools.partial(handler), Handler()):  # async callables that are no plain async def
        async with open_push_consumer(NAMESRV, topic="T", handler=ok):
            pass
    for options, text in [
        ({"producer_group": "a/b"}, "producer_group contains illegal characters; allowed are letters"),
        # Taken before: every send_batch (and auto-batched send) then failed on the batch's born host.
        ({"client_ip": "not an ip"}, "client_ip must be an IPv4 address, got 'not an ip'"),
        # Beyond the brokers' 120 s channel expiry a consumer dropped out of its group between heartbeats.
        ({"heartbeat_broker_interval_ms": 120_000}, "heartbeat_broker_interval_ms must be <= 60000"),
        # Taken before: every send of more than ~900 bytes then failed at the connection ("frame of N bytes exceeds
        # the maximum frame size of 1024 bytes").
        ({"max_frame_size_bytes": 1024}, "max_frame_size_bytes must be >= 4231167 \\(a message of "
                                         "max_message_size_bytes 4194304 with its properties and header\\), got 1024"),
        # Taken before (port 0 is a server's "any free port"): every request failed with "could not connect".
        ({"namesrv": "127.0.0.1:0"}, "namesrv_addrs needs a fixed port \\(it is dialed; .*\\), got '127.0.0.1:0'"),
        # Was a TypeError from list(): "'int' object is not iterable".
        ({"namesrv": 9876}, 'namesrv must be "HOST:PORT\\[;HOST:PORT...\\]" or a list of HOST:PORT, got 9876'),
    ]:
        with pytest.raises(ConfigError, match=text):
            async with open_producer(**options):
                pass

    mq = MessageQueue("T", "broker-a", 0)
    async with open_pull_consumer(NAMESRV, consumer_group="g") as c:
        for call, error, text in [(c.pull("T", 0), TypeError, "mq must be a MessageQueue, got 'T'"),
                                  (c.pull(MessageQueue("T", "broker-a", "0"), 0), ValueError,
                                   "queue_id must be an integer within 0..2147483647, got '0'"),
                                  (c.max_offset(MessageQueue("T", "broker-a", -1)), ValueError, "got -1"),
                                  (c.commit(MessageQueue("bad topic", "broker-a", 0), 1), ValueError,
                                   "topic 'bad topic' contains characters"),
                                  (c.pull(mq, "0"), ValueError, "offset must be an integer within 0.."),
                                  (c.pull(mq, 0, 0), ValueError, "max_nums must be an integer within 1..1024"),
                                  (c.pull(mq, 0, block_ms=-1), ValueError, "block_ms"),
                                  (c.pull(mq, 0, block_ms=2 ** 31), ValueError, "block_ms must be an integer "
                                                                                 "within 0..2147483647"),
                                  (c.min_offset(None), TypeError, "mq must be a MessageQueue, got None"),
                                  (c.search_offset(mq, "x"), ValueError, "timestamp_ms must be an integer"),
                                  (c.commit(mq, True), ValueError, "offset must be an integer .* got True")]:
            with pytest.raises(error, match=text):
                await call
        assert (await c.pull(mq, 0)).next_begin_offset == 0


async def test_an_instance_name_that_would_put_the_offset_file_elsewhere_is_refused(cluster, tmp_path):
    """Found by probing: a BROADCASTING consumer's offset file is named after its instance_name, and
    instance_name='../x' wrote it outside offset_store_dir (and one with a NUL named no file at all)."""
    store = tmp_path / "offsets"
    opts = dict(topic="T", consumer_group="bc", message_model="BROADCASTING", offset_store_dir=str(store))
    for name, text in [("../escaped", "must not contain '/', '\\\\' or '..'"), ("a/b", "must not contain '/'"),
                       ("..", "must not contain"), ("a\\b", "must not contain"),
                       ("a\0b", "must not contain control characters"),
                       ("a\nb", "must not contain control characters"),
                       ("", "must be 1 to 127 characters long \\(is 0;"),
                       ("x" * 128, "must be 1 to 127 characters long \\(is 128;")]:
        with pytest.raises(ConfigError, match="instance_name " + text):
            async with open_push_consumer(NAMESRV, instance_name=name, **opts):
                pass
        with pytest.raises(ConfigError, match="instance_name " + text):  # every client kind shares the field
            async with open_producer(NAMESRV, instance_name=name):
                pass
    assert list(tmp_path.iterdir()) == []
    # A config built directly is checked as a loaded one is, so no offset file is named after it.
    with pytest.raises(ConfigError, match=r"^instance_name must not contain '/', .*\), got '\.\./escaped'$"):
        client.push_consumer.PushConsumerConfig(instance_name="../escaped", message_model="BROADCASTING",
                                                offset_store_dir=str(store))
    assert list(tmp_path.iterdir()) == []
    for ok in ("m1", "host-1.example_2", "x" * 127, "pid 1234"):
        async with open_push_consumer(NAMESRV, instance_name=ok, **opts) as c:
            assert c._offsets.path == store / f"bc@{ok}.json"


async def test_a_broadcasting_members_offset_file_outlives_a_new_address_and_an_upgrade(cluster, tmp_path):
    # Named by group and instance_name: an address a container gets afresh at each start no longer starts the member
    # over; and the file of an earlier version (named by the address, 127.0.0.1 unless client_ip was set) is taken.
    opts = dict(topic="T", consumer_group="bc", message_model="BROADCASTING",
                offset_store_dir=str(tmp_path))
    mq = {"topic": "T", "broker_name": "broker-a", "queue_id": 0}
    (tmp_path / "bc@127.0.0.1@m1.json").write_text(json.dumps({"offsets": [{**mq, "offset": 7}]}))
    (tmp_path / "bc@10.1.2.3@m2.json").write_text(json.dumps({"offsets": [{**mq, "offset": 9}]}))
    for name, ip, offset in (("m1", "10.9.9.9", 7), ("m2", "10.1.2.3", 9), ("m1", "10.7.7.7", 7)):
        async with open_push_consumer(NAMESRV, instance_name=name, client_ip=ip, **opts) as c:
            assert c._offsets.path == tmp_path / f"bc@{name}.json"
            assert await c._offsets.read_from_store(MessageQueue("T", "broker-a", 0)) == offset
    # Each offset file has its lock beside it (held while its consumer is open; client/offset_store.py).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bc@m1.json", "bc@m1.json.lock", "bc@m2.json",
                                                         "bc@m2.json.lock"]

async def test_batch_and_pull_consumer_roundtrip(cluster):
    async with open_producer(NAMESRV) as p:
        mq = MessageQueue("T", "broker-b", 2)
        r = await p.send_batch([Message("T", b"m%d" % i, tags="A" if i % 2 else "B") for i in range(5)], queue=mq)
        assert r.queue_offset == 0 and len(r.msg_ids) == 5
    async with open_pull_consumer(NAMESRV, consumer_group="g") as c:
        assert mq in await c.fetch_queues("T")
        res = await c.pull(mq, 0, 32, expression="A")
        assert [m.body for m in res.messages] == [b"m1", b"m3"]
        assert res.next_begin_offset == 5 and res.messages[0].msg_id == r.msg_ids[1]
        assert await c.committed_offset(mq) is None
        await c.commit(mq, 5)
        assert await c.committed_offset(mq) == 5


@pytest.mark.parametrize("refusal", [True, False])
async def test_failing_pulls_are_logged_at_warning_without_flooding_the_log(cluster, caplog, refusal, autojump_clock):
    """A push consumer whose pulls all failed logged each at DEBUG: it ran on, consuming nothing, silently. Now
    a refusal is a WARNING at once, and any failure streak at its 10th, 100th, ... pull. (On the virtual clock:
    refused pulls back off to 3 s apart, 100 of them take minutes.)"""
    answer = cluster.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.PULL_MESSAGE and cluster.by_addr[addr].name == "broker-a":
            if refusal:
                return make_response(request, ResponseCode.SUBSCRIPTION_PARSE_FAILED, remark="bad subscription")
            raise ConnectError(addr, "connection refused")
        return await answer(addr, request, timeout_s)

    cluster.invoke = invoke
    caplog.set_level(logging.DEBUG, logger="client.push_consumer")

    async def handler(msg) -> None:
        pass

    async with open_push_consumer(NAMESRV, topic="T", handler=handler, pull_time_delay_ms_when_exception=10):
        with trio.fail_after(600):
            # Looked at every virtual half second: every 10 ms, the scan of a log growing with each pull took
            # 10 s of real CPU over the 300 virtual seconds the refused pulls need.
            while sum("pull failed 100 time(s)" in r.getMessage() for r in caplog.records) < 4:
                await trio.sleep(0.5)
    failed = [r for r in caplog.records if "pull failed" in r.getMessage()]
    warned = [r.getMessage() for r in failed if r.levelno == logging.WARNING]
    streaks = sorted(int(m.split("pull failed ")[1].split(" ")[0]) for m in warned)
    per_queue = ([1, 10, 100] if refusal else [10, 100])
    assert streaks == sorted(per_queue * 4), streaks  # broker-a's 4 queues
    assert all("broker-a" in m for m in warned)
    assert ("bad subscription" if refusal else "connection refused") in warned[0]


@pytest.mark.parametrize("refusal", [True, False])
async def test_refused_pulls_back_off_to_rocketmqs_3_s_and_failed_ones_retry_soon(cluster, autojump_clock, refusal):
    """A stopped consumer group's members pulled each queue every 200 ms for as long as it stayed stopped. A
    refusal now doubles the pause, up to RocketMQ's 3 s; an error that is soon over (a leader moving, a connection
    lost) is retried after pull_time_delay_ms_when_exception as before."""
    answer = cluster.invoke
    pulls: list[float] = []

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.PULL_MESSAGE and request.ext["queue_id"] == 0 \
                and cluster.by_addr[addr].name == "broker-a":
            pulls.append(trio.current_time())
            if refusal:
                return make_response(request, ResponseCode.NO_PERMISSION, remark="consume_enable is false")
            raise ConnectError(addr, "connection refused")
        return await answer(addr, request, timeout_s)

    cluster.invoke = invoke

    async def handler(msg) -> None:
        pass

    async with open_push_consumer(NAMESRV, topic="T", handler=handler):
        await trio.sleep(30)
    pulls = sorted(set(pulls))  # one pull asks the group's other nodes at once when its leader fails it
    gaps = [round(b - a, 1) for a, b in zip(pulls, pulls[1:])]
    if refusal:
        assert gaps[:4] == [0.2, 0.4, 0.8, 1.6] and set(gaps[4:]) == {3.0}, gaps
    else:
        assert set(gaps) == {0.2} and len(pulls) > 100, gaps


def test_a_pull_refused_by_permission_backs_off_and_one_that_failed_does_not():
    delay = client.pull_consumer.failed_pull_delay
    refused = [for_code(ResponseCode.NO_PERMISSION, "consume_enable is false"),
               for_code(ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST, "no group")]
    for error in refused:
        assert [delay(0.2, n, error) for n in (1, 2, 5, 6, 60)] == [0.2, 0.4, 3.0, 3.0, 3.0]
        assert delay(5.0, 3, error) == 5.0  # a configured pause past 3 s stays as configured
    for error in (for_code(ResponseCode.NOT_LEADER, "moved"), ConnectError("a:1", "refused"),
                  for_code(ResponseCode.SYSTEM_BUSY, "busy")):
        assert delay(0.2, 60, error) == 0.2
    # A failover's failures before a refusal do not lengthen the refusal's pause; a pull that went through ends both.
    failed = client.pull_consumer.FailedPulls(0.2)
    mq = MessageQueue("T", "broker-a", 0)
    lost = ConnectError("a:1", "refused")
    pauses = [failed.record(logging.getLogger("test"), mq, 0, e) for e in [lost] * 5 + refused[:1] * 3 + [lost]]
    assert pauses == [0.2] * 5 + [0.2, 0.4, 0.8] + [0.2] and failed.failures == 9
    failed.clear()
    assert failed.record(logging.getLogger("test"), mq, 0, refused[0]) == 0.2 and failed.failures == 1


async def test_failing_pulls_pause_at_least_10_ms_between_attempts(cluster, autojump_clock):
    """Found by probing: pull_time_delay_ms_when_exception=0 was taken, and a queue whose pulls all failed was
    pulled again at once, forever (a core spent on one unreachable broker)."""
    async def handler(msg) -> None:
        pass

    for delay in (0, 9, -1):
        with pytest.raises(ConfigError, match=f"pull_time_delay_ms_when_exception must be >= 10, got {delay}"):
            async with open_push_consumer(NAMESRV, topic="T", handler=handler,
                                          pull_time_delay_ms_when_exception=delay):
                pass
    answer = cluster.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.PULL_MESSAGE and cluster.by_addr[addr].name == "broker-a":
            raise ConnectError(addr, "connection refused")  # broker-a's 4 queues: every pull fails at once
        return await answer(addr, request, timeout_s)

    cluster.invoke = invoke
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, pull_time_delay_ms_when_exception=10,
                                  broker_suspend_max_time_ms=1000) as c:
        started, errors_before = trio.current_time(), c.statistics().pull_errors
        await trio.sleep(1)
        failed = c.statistics().pull_errors - errors_before
    assert trio.current_time() - started >= 1
    assert 0 < failed <= 4 * (100 + 1), failed  # at most one failed pull per queue per 10 ms


async def test_push_consumer_group_rebalances_and_consumes_everything_in_queue_order(cluster):
    total = 400
    seen: dict[str, list] = {}
    done = trio.Event()
    counts = {"n": 0}

    def record(name):
        async def handler(msg):
            seen.setdefault(name, []).append((msg.message_queue, msg.queue_offset, msg.body))
            counts["n"] += 1
            if counts["n"] >= total:
                done.set()
        return handler

    opts = dict(consumer_group="g", consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=50,
                persist_consumer_offset_interval_ms=20, broker_suspend_max_time_ms=50, pull_batch_size=8,
                pull_threshold_for_queue=16)
    async with open_producer(NAMESRV) as p:
        async with open_push_consumer(NAMESRV, topic="T", handler=record("c1"), **opts) as c1:
            async with open_push_consumer(NAMESRV, topic="T", handler=record("c2"), **opts) as c2:
                for i in range(total // 2):
                    await p.send(Message("T", b"%06d" % i))
                async with open_push_consumer(NAMESRV, topic="T", handler=record("c3"), **opts) as c3:
                    for i in range(total // 2, total):
                        await p.send(Message("T", b"%06d" % i))
                    with trio.fail_after(10):
                        await done.wait()
                    await trio.sleep(0.2)
                    assert len(c3.assigned_queues()) >= 2
                    parts = [set(c.assigned_queues()) for c in (c1, c2, c3)]
                    assert sum(len(x) for x in parts) == 8 and len(set().union(*parts)) == 8
    bodies = [b for msgs in seen.values() for _, _, b in msgs]
    assert set(bodies) == {b"%06d" % i for i in range(total)}
    for msgs in seen.values():
        last: dict = {}
        for mq, off, _ in msgs:
            assert off > last.get(mq, -1), "per-queue order broken"
            last[mq] = off
    # committed offsets reached the end of every queue
    for g in cluster.groups:
        for (topic, qid), log in g.logs.items():
            assert g.offsets[("g", topic, qid)] == len(log)


async def test_push_consumer_iterator_form_tag_filter_and_flow_control(cluster):
    async with open_producer(NAMESRV) as p:
        for i in range(60):
            await p.send(Message("T", b"%d" % i, tags="A" if i % 3 == 0 else "B"))
    async with open_push_consumer(NAMESRV, topic="T", expression="A", consumer_group="g2",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", pull_threshold_for_queue=2,
                                  pull_batch_size=2, broker_suspend_max_time_ms=20) as c:
        got = []
        with trio.fail_after(5):
            async for msg in c:
                got.append(int(msg.body))
                assert c.statistics().cached <= 8 * 2 + 2
                if len(got) == 20:
                    break
    assert sorted(got) == list(range(0, 60, 3))


async def test_unknown_topic_is_sent_to_every_group_for_auto_create(cluster):
    cluster.unknown_topics.add("New")
    async with open_producer(NAMESRV, default_topic_queue_nums=2) as p:
        results = [await p.send(Message("New", b"x")) for _ in range(8)]
    assert {r.message_queue for r in results} == {MessageQueue("New", b, q) for b in ("broker-a", "broker-b")
                                                   for q in range(2)}


@pytest.mark.parametrize("info", [b"\xff", cbor2.dumps({"broker_addr_table": ["broker-a"]}),
                                  cbor2.dumps({"broker_addr_table": {"broker-a": {"broker_addrs": {"0": "x"}}}})])
async def test_cluster_info_that_cannot_be_read_is_no_route_for_an_unknown_topic(cluster, info):
    # Read to send an unknown topic to every group for auto-create, it raised CBORDecodeError or AttributeError
    # out of the send (in the auto-batch's task, which expects RaftMQError: the end of the producer), or installed
    # a route to a broker at "x".
    original = cluster.invoke

    async def answer(addr, request, timeout_s=3.0):
        if request.code == RequestCode.GET_BROKER_CLUSTER_INFO:
            await trio.lowlevel.checkpoint()
            return make_response(request, ResponseCode.SUCCESS, body=info)
        return await original(addr, request, timeout_s)

    cluster.invoke = answer
    cluster.unknown_topics.add("New")
    async with open_producer(NAMESRV, retry_times_when_send_failed=0) as p:
        with pytest.raises(client.errors.SendFailedError, match="topic 'New' is unknown and the name server's "
                                                                "cluster info, to send it to every group for "
                                                                "auto-create, is malformed"):
            await p.send(Message("New", b"x"))
        assert (await p.send(Message("T", b"x"))).send_status is SendStatus.SEND_OK


async def test_consumer_may_subscribe_before_the_topic_exists(cluster):
    cluster.unknown_topics.add("Later")
    async with open_push_consumer(NAMESRV, topic="Later", consumer_group="g3", rebalance_interval_ms=20,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET") as c:
        assert c.assigned_queues() == []
        cluster.unknown_topics.discard("Later")
        async with open_producer(NAMESRV) as p:
            await p.send(Message("Later", b"hi"))
        with trio.fail_after(5):
            async for msg in c:
                assert msg.body == b"hi"
                break


async def test_a_name_server_without_registrations_yet_is_not_taken_as_the_last_word(cluster, monkeypatch):
    """Found by probing with two name servers, one just restarted (brokers re-register every 30 s): its
    TOPIC_NOT_EXIST was taken as 'no name server knows the topic', so the producer sent to a stand-in route for
    auto-creation and the push consumer got no queue (and took the topic for one created after it subscribed)."""
    cluster.empty_namesrvs.add("ns-restarted:9876")
    monkeypatch.setattr(client.route.random, "randrange", lambda n: 0)  # the restarted one is asked first
    namesrv = f"ns-restarted:9876;{NAMESRV}"
    async with open_producer(namesrv) as p:
        await p.send(Message("T", b"x"))
    assert ("ns-restarted:9876", RequestCode.GET_BROKER_CLUSTER_INFO) not in cluster.calls
    assert (NAMESRV, RequestCode.GET_ROUTEINFO_BY_TOPIC) in cluster.calls
    async with open_push_consumer(namesrv, topic="T", consumer_group="g5", rebalance_interval_ms=60_000) as c:
        assert len(c.assigned_queues()) == 8
        assert c._first_queues["T"] == frozenset(c.assigned_queues())

async def test_a_slow_name_server_cut_short_does_not_make_an_existing_topic_look_new(cluster, monkeypatch):
    """Found by review: once a name server (restarted, no registration yet) said it knows nothing, the others are
    waited for 0.5 s each; one that routes the topic but answered later was cut short, the topic taken for unknown,
    and a new group from its last offset took it for one created after it subscribed: every queue from its min
    offset, the topic's whole history."""
    cluster.empty_namesrvs.add("ns-restarted:9876")
    cluster.namesrv_route_delay_s = 0.8
    monkeypatch.setattr(client.route.random, "randrange", lambda n: 0)  # the restarted one is asked first
    namesrv = f"ns-restarted:9876;{NAMESRV}"
    async with open_push_consumer(namesrv, topic="T", consumer_group="g6", rebalance_interval_ms=60_000) as c:
        assert c._first_queues.get("T") != frozenset()


async def test_a_topic_created_after_subscribing_is_consumed_from_its_first_message(cluster):
    """Found by probing: a group subscribed (from its last offset, the default) before the topic existed started
    each queue at its max offset when the next rebalance found it, so what was sent in between, the topic's first
    messages, was never consumed (8 of 8 on the dev cluster)."""
    cluster.unknown_topics.add("Later")
    async with open_push_consumer(NAMESRV, topic="Later", consumer_group="g4", rebalance_interval_ms=10_000,
                                  broker_suspend_max_time_ms=20) as c:
        cluster.unknown_topics.discard("Later")
        async with open_producer(NAMESRV) as p:
            for i in range(8):
                await p.send(Message("Later", b"%d" % i))
        c.trigger_rebalance()
        with trio.fail_after(5):
            got = [msg async for msg in _take(c, 8)]
        assert sorted(m.body for m in got) == [b"%d" % i for i in range(8)]


async def test_broadcasting_members_each_get_every_queue_and_resume_from_a_local_file(cluster, tmp_path):
    async with open_producer(NAMESRV) as p:
        for i in range(20):
            await p.send(Message("B", b"%d" % i))
    opts = dict(consumer_group="bc", message_model="BROADCASTING", offset_store_dir=str(tmp_path),
                consume_from_where="CONSUME_FROM_FIRST_OFFSET", broker_suspend_max_time_ms=20)
    async with open_push_consumer(NAMESRV, topic="B", instance_name="m1", **opts) as m1, \
            open_push_consumer(NAMESRV, topic="B", instance_name="m2", **opts) as m2:
        assert len(m1.assigned_queues()) == len(m2.assigned_queues()) == 8
        for member in (m1, m2):
            with trio.fail_after(5):
                got = [msg async for msg in _take(member, 20)]
            assert sorted(int(m.body) for m in got) == list(range(20))
    async with open_producer(NAMESRV) as p:
        await p.send(Message("B", b"20"))
    async with open_push_consumer(NAMESRV, topic="B", instance_name="m1", **opts) as again:
        with trio.fail_after(5):
            assert [int(m.body) async for m in _take(again, 1)] == [20]


async def _take(consumer, n):
    async for msg in consumer:
        yield msg
        n -= 1
        if n == 0:
            return


async def test_push_consumer_iterator_commits_exactly_what_was_consumed(cluster):
    # Consumed offsets reach the offset store in batches (at each persist, queue removal, close): what is
    # committed must still be, per queue, one past the last message the loop finished with.
    async with open_producer(NAMESRV) as p:
        for i in range(80):
            await p.send(Message("T", b"%d" % i))
    per_queue: dict = {}
    async with open_push_consumer(NAMESRV, topic="T", consumer_group="g3",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", pull_batch_size=4,
                                  persist_consumer_offset_interval_ms=10, broker_suspend_max_time_ms=20) as c:
        with trio.fail_after(5):
            async for msg in c:
                per_queue[(msg.message_queue.broker_name, msg.queue_id)] = msg.queue_offset + 1
                if sum(per_queue.values()) >= 40:
                    await trio.sleep(0.05)  # a persist runs while a message is pending: it is not committed
                    mq = (msg.message_queue.broker_name, msg.queue_id)
                    group = next(g for g in cluster.groups if g.name == mq[0])
                    assert group.offsets.get(("g3", "T", mq[1]), 0) == msg.queue_offset
                    break
    committed = {(g.name, qid): off for g in cluster.groups for (grp, _, qid), off in g.offsets.items()
                 if grp == "g3"}
    assert committed == per_queue


async def test_a_push_consumer_is_iterated_by_one_task_at_a_time(cluster):
    """Found by probing: with two tasks iterating one consumer, one task's __anext__ acknowledged the message the
    other was still processing (the consumer keeps one pending message): its offset was committed past it, and a
    crash there lost it. Now the second task gets a RuntimeError; another task may take over once the first is
    done with its message."""
    text = "a push consumer is iterated by one task at a time; use the handler form for parallel consumption"
    mq = MessageQueue("T", "broker-a", 0)
    async with open_producer(NAMESRV) as p:
        for i in range(4):
            await p.send(Message("T", b"%d" % i), queue=mq)
    async with open_push_consumer(NAMESRV, topic="T", consumer_group="g6", broker_suspend_max_time_ms=20,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET") as c:
        pq = c._pqs[mq]
        got: list = []
        release = trio.Event()

        async def first_task() -> None:
            got.append(await c.__anext__())
            await release.wait()  # processing message 0

        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                n.start_soon(first_task)
                while not got:
                    await trio.sleep(0.001)
                assert got[0].queue_offset == 0
                with pytest.raises(RuntimeError, match=text):  # while the first task processes its message
                    await c.__anext__()
                assert pq.consume_offset() == 0  # message 0 not acknowledged by the other task
                release.set()
            # The first task finished: this one takes over (and message 0 counts as consumed, its loop moved on).
            assert (await c.__anext__()).queue_offset == 1
            assert pq.consume_offset() == 1
            # A task that lets its message go hands over too.
            c.ack_pending()
            results: list = []
            async with trio.open_nursery() as n:
                n.start_soon(_append_next, c, results)
            assert results[0].queue_offset == 2
            assert (await c.__anext__()).queue_offset == 3  # and back: that task has finished
            # A task waiting for a message counts too: two waiting tasks each took one, and one's was never acked.
            c.ack_pending()
            async with trio.open_nursery() as n:
                n.start_soon(_append_next, c, results)
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(RuntimeError, match=text):
                    await c.__anext__()
                n.cancel_scope.cancel()

async def _append_next(consumer, results: list) -> None:
    results.append(await consumer.__anext__())

def _route_queries(cluster) -> int:
    return sum(1 for addr, code in cluster.calls if code == RequestCode.GET_ROUTEINFO_BY_TOPIC)


async def _send_to_a1_answering_after(cluster, producer, delay_s: float):
    """Send to a:1's queue 0 while a:1 hangs; it answers again after ``delay_s``."""
    async def resume_a1() -> None:
        await trio.sleep(delay_s)
        cluster.resume("a:1")

    async with trio.open_nursery() as n:
        n.start_soon(resume_a1)
        return await producer.send(Message("T", b"x"), queue=MessageQueue("T", "broker-a", 0))


async def test_a_silent_leader_the_route_replaced_is_left_and_the_send_resent_to_the_new_one(cluster):
    # a:1 hangs (a stopped process: its connection stays open and answers nothing); its group elects a:2, which
    # registers, so the name server routes a:2 from then on. The send must not wait out its 3 s deadline on a:1.
    a = cluster.groups[0]
    cluster.hung.add("a:1")

    async def elect_a2() -> None:
        await trio.sleep(0.3)
        a.leader = "a:2"

    async with open_producer(NAMESRV, leader_silence_timeout_ms=100, retry_backoff_ms=0) as p:
        async with trio.open_nursery() as n:
            n.start_soon(elect_a2)
            r = await p.send(Message("T", b"x"), queue=MessageQueue("T", "broker-a", 0))
        assert "a:1" not in cluster.conns  # closed by the watch, which is what failed the waiting send over
        cluster.resume("a:1")  # so that closing the producer does not wait for it
    assert r.send_status is SendStatus.SEND_OK
    assert [addr for addr, code in cluster.calls if code == RequestCode.SEND_MESSAGE] == ["a:1", "a:2"]


async def test_a_silent_leader_still_routed_is_kept_and_its_late_answer_taken(cluster):
    # No new leader in the route (an election still running, or a slow leader): the watch keeps asking the name
    # server but leaves the connection alone, and the send completes on a:1 once it answers.
    cluster.hung.add("a:1")
    async with open_producer(NAMESRV, leader_silence_timeout_ms=50) as p:
        await p.routes.refresh("T")
        before = _route_queries(cluster)
        r = await _send_to_a1_answering_after(cluster, p, 0.5)
    assert r.send_status is SendStatus.SEND_OK
    assert [addr for addr, code in cluster.calls if code == RequestCode.SEND_MESSAGE] == ["a:1"]
    assert _route_queries(cluster) - before >= 3  # asked every 50 / 4 ms... at least a few times in 0.45 s


def _assert_sent_to_a1_then_a2_named_by_the_others(cluster, result) -> None:
    assert result.send_status is SendStatus.SEND_OK
    assert [addr for addr, code in cluster.calls if code == RequestCode.SEND_MESSAGE] == ["a:1", "a:2"]
    assert {addr for addr, code in cluster.calls if code == RequestCode.GET_BROKER_RUNTIME_INFO} == {"a:2", "a:3"}


async def test_with_the_name_server_silent_too_the_leader_the_other_nodes_name_is_taken(cluster):
    # The client cut off from the name server as well: the watch's route refresh gets no answer, but the status
    # it asks of a:2 and a:3 at the same time names a:2 (term 2) once a:2 is elected.
    a = cluster.groups[0]
    async with open_producer(NAMESRV, leader_silence_timeout_ms=100, retry_backoff_ms=0) as p:
        await p.routes.refresh("T")
        cluster.hung.update({"a:1", NAMESRV})

        async def elect_a2() -> None:
            await trio.sleep(0.3)
            a.leader, a.term = "a:2", 2

        async with trio.open_nursery() as n:
            n.start_soon(elect_a2)
            r = await p.send(Message("T", b"x"), queue=MessageQueue("T", "broker-a", 0))
        assert "a:1" not in cluster.conns  # closed by the watch
        cluster.resume("a:1")
    _assert_sent_to_a1_then_a2_named_by_the_others(cluster, r)


@pytest.mark.parametrize("body", [cbor2.dumps(["term", 2]), b"\xff"])
async def test_a_status_that_is_no_map_is_that_nodes_silence_and_the_other_node_is_heard(cluster, body):
    # a:2 answers its status as a CBOR list, or not as CBOR: status.get raised AttributeError, and cbor2 6 a
    # CBORDecodeError that is no ValueError, in the leader watch, which ended the producer. It is now as if a:2
    # had not answered; a:3 names a:2 and the send moves there.
    a = cluster.groups[0]
    original = cluster.invoke

    async def answer(addr, request, timeout_s=3.0):
        if addr == "a:2" and request.code == RequestCode.GET_BROKER_RUNTIME_INFO:
            await trio.lowlevel.checkpoint()
            cluster.calls.append((addr, request.code))
            return make_response(request, ResponseCode.SUCCESS, body=body)
        return await original(addr, request, timeout_s)

    cluster.invoke = answer
    async with open_producer(NAMESRV, leader_silence_timeout_ms=100, retry_backoff_ms=0) as p:
        await p.routes.refresh("T")
        cluster.hung.update({"a:1", NAMESRV})
        a.leader, a.term = "a:2", 2
        r = await p.send(Message("T", b"x"), queue=MessageQueue("T", "broker-a", 0))
        assert "a:1" not in cluster.conns  # closed by the watch
        cluster.resume("a:1")
    _assert_sent_to_a1_then_a2_named_by_the_others(cluster, r)


async def test_with_the_name_server_silent_too_a_leader_its_nodes_still_name_is_kept(cluster):
    async with open_producer(NAMESRV, leader_silence_timeout_ms=50) as p:
        await p.routes.refresh("T")
        cluster.hung.update({"a:1", NAMESRV})
        r = await _send_to_a1_answering_after(cluster, p, 0.5)
    assert r.send_status is SendStatus.SEND_OK
    assert [addr for addr, code in cluster.calls if code == RequestCode.SEND_MESSAGE] == ["a:1"]
    assert any(code == RequestCode.GET_BROKER_RUNTIME_INFO for _, code in cluster.calls)  # it did ask


async def test_a_long_poll_held_by_the_leader_does_not_count_as_silence(cluster, monkeypatch):
    # The heartbeat round is sent here, not by its background task: that one's first round, when it ran late
    # (make test's load), went to a:1 after a:1 hung and was silence indeed (26 route queries where 0 were expected).
    async def no_background_heartbeats(self) -> None:
        await trio.sleep_forever()

    monkeypatch.setattr(client.instance.ClientInstance, "_serve_heartbeat", no_background_heartbeats)
    async with open_producer(NAMESRV, leader_silence_timeout_ms=50) as p:
        await p.routes.refresh("T")
        await p._instance.send_heartbeat_to_all()  # answered
        assert ("a:1", RequestCode.HEART_BEAT) in cluster.calls
        cluster.hung.add("a:1")  # holds the pull, as a broker with nothing new does for up to 15 s
        before = _route_queries(cluster)
        async with trio.open_nursery() as n:
            n.start_soon(functools.partial(
                p._instance.invoke, "a:1", RequestCode.PULL_MESSAGE, {"topic": "T", "queue_id": 0}, timeout_s=5))
            await trio.sleep(0.4)
            assert _route_queries(cluster) == before
            n.cancel_scope.cancel()
        cluster.resume("a:1")


async def test_an_error_raised_in_the_async_with_block_comes_out_as_itself(cluster):
    """Found by probing: the clients yield inside their background nursery, so any error of the block (a send that
    failed, a bad argument) left ``async with open_producer(...)`` wrapped in an ExceptionGroup, and
    ``except SendFailedError`` around it caught nothing (remoting's own nursery unwraps a lone error for this)."""
    async def handler(msg) -> None:
        pass

    async def iterate(consumer) -> None:
        async for _ in consumer:
            pass

    mq = MessageQueue("T", "broker-a", 0)
    for opened, use, error in [
        (lambda: open_producer(NAMESRV), lambda p: p.send(Message("T", b"x"), timeout_s=-1), ValueError),
        (lambda: open_pull_consumer(NAMESRV), lambda c: c.pull(mq, -1), ValueError),
        (lambda: open_push_consumer(NAMESRV, topic="T", handler=handler), iterate, TypeError),
        (lambda: client.admin.open_admin(NAMESRV), lambda a: a.create_topic("T", wait_route_s=-1), ValueError),
    ]:
        with pytest.raises(error):
            async with opened() as c:
                await use(c)


async def test_a_consume_offset_beyond_the_queue_end_is_corrected_as_the_broker_says(cluster, caplog):
    """Found by probing: with the group's offset committed past a queue's end (a pull consumer's commit, a wiped
    store), every pull answered OFFSET_ILLEGAL with next_begin_offset 0, which the pull loop ignored (it only moved
    forward): 16,000 pulls and warnings in 4 s, and nothing new in that queue ever consumed. Now it follows the
    broker's correction as RocketMQ does (drop the queue's cache, pull from there: at least once)."""
    mq = MessageQueue("T", "broker-a", 0)
    async with open_producer(NAMESRV) as p:
        for i in range(3):
            await p.send(Message("T", b"%d" % i), queue=mq)
    async with open_pull_consumer(NAMESRV, consumer_group="g") as c:
        await c.commit(mq, 1000)
    caplog.set_level(logging.WARNING, "client.push_consumer")
    async with open_push_consumer(NAMESRV, topic="T", consumer_group="g", broker_suspend_max_time_ms=20) as consumer:
        with trio.fail_after(5):
            got = [msg async for msg in _take(consumer, 3)]
        assert [(m.message_queue, m.body) for m in got] == [(mq, b"0"), (mq, b"1"), (mq, b"2")]
        assert consumer.statistics().pulls < 100
    assert caplog.text.count("pull offset moved") == 1
    async with open_pull_consumer(NAMESRV, consumer_group="g") as c:
        assert await c.committed_offset(mq) == 3


async def _no_argument() -> None:
    pass


async def _two_arguments(msg, context) -> None:
    pass


async def test_a_message_the_block_raised_on_is_delivered_again(cluster):
    """Found by probing: leaving the iterator's block by an exception while handling a message still counted that
    message as consumed (close acknowledged the pending one) and committed past it: lost to the group. Leaving by
    ``break`` still counts it."""
    mq = MessageQueue("T", "broker-a", 0)
    async with open_producer(NAMESRV) as p:
        for i in range(3):
            await p.send(Message("T", b"%d" % i), queue=mq)
    opts = dict(topic="T", consumer_group="g6", consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                broker_suspend_max_time_ms=20)
    with pytest.raises(RuntimeError, match="handling failed"):
        async with open_push_consumer(NAMESRV, **opts) as c:
            with trio.fail_after(5):
                async for msg in c:
                    if msg.body == b"1":
                        raise RuntimeError("handling failed")
    async with open_push_consumer(NAMESRV, **opts) as c:
        with trio.fail_after(5):
            async for msg in c:
                assert (msg.message_queue, msg.body) == (mq, b"1")
                break
    async with open_push_consumer(NAMESRV, **opts) as c:
        with trio.fail_after(5):
            assert [m.body async for m in _take(c, 1)] == [b"2"]


async def test_a_malformed_consumer_list_is_that_nodes_failure_and_the_next_is_asked(cluster):
    # A body that was not CBOR, or a list that was not of ids, raised out of the rebalance task (which catches
    # RaftMQError) and ended the consumer.
    original = cluster.invoke
    odd_answers = {"a:1": b"\xff\x00", "a:2": cbor2.dumps({"consumer_id_list": 5})}

    async def odd(addr, request, timeout_s=3.0):
        if request.code == RequestCode.GET_CONSUMER_LIST_BY_GROUP and addr in odd_answers:
            await trio.lowlevel.checkpoint()
            return make_response(request, ResponseCode.SUCCESS, body=odd_answers[addr])
        return await original(addr, request, timeout_s)

    cluster.invoke = odd
    async with open_push_consumer(NAMESRV, topic="T", consumer_group="g", rebalance_interval_ms=50) as consumer:
        await consumer._instance.send_heartbeat_to_all()  # a member of its group on every node now
        ids = await consumer.find_consumer_ids("T")
        assert ids == [consumer.client_id], ids  # a:3's answer, after a:1's and a:2's were refused
        odd_answers["a:3"] = b"\xff"
        await trio.sleep(0.2)  # rebalances meanwhile (every 50 ms) meet the same answers: the consumer stays open
        assert await consumer.find_consumer_ids("T") == [consumer.client_id]  # broker-b's
        assert {a for a, code in cluster.calls if code == RequestCode.GET_CONSUMER_LIST_BY_GROUP} >= {"a:3", "b:1"}


async def test_malformed_offsets_and_records_from_a_broker_are_its_errors_not_the_consumers(cluster):
    # An offset of -1 or "7", or records that cannot be read, raised ValueError/KeyError/TypeError in the push
    # consumer's pull and rebalance tasks, which expect RaftMQError, and ended the consumer.
    from remoting.errors import BrokerSystemError

    original = cluster.invoke
    odd: dict[int, dict] = {}

    async def answer(addr, request, timeout_s=3.0):
        if request.code in odd:
            await trio.lowlevel.checkpoint()
            return make_response(request, ResponseCode.SUCCESS, **odd[request.code])
        return await original(addr, request, timeout_s)

    cluster.invoke = answer
    mq = MessageQueue("T", "broker-a", 0)
    async with open_pull_consumer(NAMESRV, consumer_group="g") as consumer:
        for ext in ({"offset": -1}, {"offset": "7"}, {}, {"offset": 2**63}):
            odd[RequestCode.GET_MAX_OFFSET] = {"ext": ext}
            with pytest.raises(BrokerSystemError, match="malformed GET_MAX_OFFSET answer.*is not an offset"):
                await consumer.max_offset(mq)
        odd[RequestCode.PULL_MESSAGE] = {"ext": {"next_begin_offset": -1}}
        with pytest.raises(BrokerSystemError, match="next_begin_offset -1 is not an offset"):
            await consumer.pull(mq, 0, 8)
        odd[RequestCode.PULL_MESSAGE] = {"ext": {"next_begin_offset": 1, "max_offset": 1}, "body": b"\x00" * 30}
        with pytest.raises(BrokerSystemError, match="records cannot be read"):
            await consumer.pull(mq, 0, 8)
        for ext in ({"offset": "7"}, {"offset": 2**63}, {"offset": -2}, {"offset": float("inf")}):
            odd[RequestCode.QUERY_CONSUMER_OFFSET] = {"ext": ext}
            with pytest.raises(BrokerSystemError, match="malformed QUERY_CONSUMER_OFFSET answer.*is not an offset"):
                await consumer.committed_offset(mq)
        odd[RequestCode.QUERY_CONSUMER_OFFSET] = {"ext": {"offset": -1}}
        assert await consumer.committed_offset(mq) is None
        lock_body = cbor2.dumps({"lock_ok_mq_set": [{"topic": "T", "broker_name": "broker-a", "queue_id": 0}]})
        for life in (float("inf"), 2**64, 0, "60000", None):
            # inf raised OverflowError in the orderly member's renewal task, which ended the consumer
            odd[RequestCode.LOCK_BATCH_MQ] = {"ext": {"rebalance_lock_max_live_time_ms": life}, "body": lock_body}
            with pytest.raises(BrokerSystemError, match="malformed LOCK_BATCH_MQ answer.*rebalance_lock_max_live"):
                await consumer._api.lock_batch("me", [mq])
        odd[RequestCode.LOCK_BATCH_MQ] = {"ext": {"rebalance_lock_max_live_time_ms": 60_000},
                                          "body": cbor2.dumps({"lock_ok_mq_set": [{"queue_id": float("inf")}]})}
        with pytest.raises(BrokerSystemError, match="malformed LOCK_BATCH_MQ answer"):
            await consumer._api.lock_batch("me", [mq])
        odd[RequestCode.LOCK_BATCH_MQ]["body"] = b"\xff"
        with pytest.raises(BrokerSystemError, match="malformed LOCK_BATCH_MQ answer"):
            await consumer._api.lock_batch("me", [mq])
        odd[RequestCode.LOCK_BATCH_MQ]["body"] = lock_body
        assert await consumer._api.lock_batch("me", [mq]) == ({mq}, 60_000)
        odd.clear()
        assert await consumer.max_offset(mq) == 0
        assert await consumer.committed_offset(mq) is None
