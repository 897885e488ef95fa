"""Transactional messages against one in-process broker node, driven by raw requests: where a half message waits,
what END_TRANSACTION does (once), what it refuses, and the check-back with a raw producer connection."""

from __future__ import annotations

import time

import cbor2
import pytest
import trio

from remoting.codec import make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.config import ConfigError
from remoting.message import (TRANSACTION_COMMIT_TYPE, TRANSACTION_PREPARED_TYPE, TRANSACTION_ROLLBACK_TYPE,
                              MessageInput, decode_record, encode_batch, iter_records, parse_msg_id)
from remoting.transport import open_connection, open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, member_call, start_broker, wait_leader

GROUP = "tx_group"


async def heartbeat_producer(client, addr: str) -> None:
    """Make ``client`` a producer of GROUP on ``addr``, which then asks it (``RawProducer``) for check-backs."""
    r = await call(client, addr, RequestCode.HEART_BEAT,
                   {"client_id": "raw-producer", "producers": [{"producer_group": GROUP}], "consumers": []})
    assert r.code == ResponseCode.SUCCESS


async def send_half(client, addr: str, key: str, *, topic: str = "TxT", queue_id: int = 1, group: str = GROUP,
                    **extra: str):
    props = {"TRAN_MSG": "true", "PGROUP": group, "UNIQ_KEY": f"U-{key}", "KEYS": key, **extra}
    r = await call(client, addr, RequestCode.SEND_MESSAGE,
                   {"topic": topic, "queue_id": queue_id, "producer_group": group, "properties": props},
                   f"body-{key}".encode())
    assert r.code == ResponseCode.SUCCESS, r.remark
    return r


def end_ext(half, state: int, *, group: str = GROUP, from_check: bool = False) -> dict:
    _, phy = parse_msg_id(half.ext["msg_id"])
    return {"producer_group": group, "tran_state_table_offset": half.ext["queue_offset"], "commit_log_offset": phy,
            "commit_or_rollback": state, "from_transaction_check": from_check, "msg_id": half.ext["msg_id"]}


async def pull(client, addr: str, topic: str, queue_id: int, offset: int = 0):
    r = await call(client, addr, RequestCode.PULL_MESSAGE,
                   {"consumer_group": "cg", "topic": topic, "queue_id": queue_id, "queue_offset": offset,
                    "max_msg_nums": 64})
    return (list(iter_records(r.body)) if r.code == ResponseCode.SUCCESS else []), r


async def commit_log_end(client, addr: str) -> int:
    r = await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)
    return cbor2.loads(r.body)["commit_log_max_offset"]


def test_transaction_config_keys_take_rocketmqs_defaults_and_refuse_bad_values(tmp_path):
    (config,) = broker_configs(tmp_path, None)
    assert (config.transaction_timeout_ms, config.transaction_check_max, config.transaction_check_interval_ms) == \
        (6_000, 15, 60_000)
    for key, bad in (("transaction_timeout_ms", 0), ("transaction_check_max", 0), ("transaction_check_max", "3"),
                     ("transaction_check_interval_ms", 5)):
        with pytest.raises(ConfigError, match=key):
            broker_configs(tmp_path, None, **{key: bad})


async def test_a_half_waits_unseen_then_commit_delivers_it_once_and_rollback_never(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        half = await send_half(client, addr, "c1", color="red")
        assert half.ext["queue_id"] == 0
        viewed = decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                           {"msg_id": half.ext["msg_id"]})).body)
        assert (viewed.topic, viewed.queue_id) == ("RMQ_SYS_TRANS_HALF_TOPIC", 0)
        assert viewed.properties["REAL_TOPIC"] == "TxT" and viewed.properties["REAL_QID"] == "1"
        assert viewed.sys_flag & 0xC == TRANSACTION_PREPARED_TYPE
        assert (await pull(client, addr, "TxT", 1))[0] == []
        # Nor can a consumer have it copied to its retry topic, to be consumed before (or without) its commit.
        back = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK,
                          {"offset": viewed.phy_offset, "group": "curious", "delay_level": 0})
        assert back.code == ResponseCode.INVALID_REQUEST and "RMQ_SYS_TRANS_HALF_TOPIC" in back.remark, back.remark

        r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(half, TRANSACTION_COMMIT_TYPE))
        assert r.code == ResponseCode.SUCCESS and r.ext["outcome"] == "committed", r.remark
        (real,), _ = await pull(client, addr, "TxT", 1)
        assert real.body == b"body-c1" and real.msg_id == r.ext["msg_id"] and real.queue_offset == 0
        assert real.properties["UNIQ_KEY"] == "U-c1" and real.properties["TRAN_MSG"] == "true"
        assert real.properties["color"] == "red" and real.properties["KEYS"] == "c1"
        assert not {"REAL_TOPIC", "REAL_QID", "PGROUP"} & set(real.properties)
        assert real.sys_flag & 0xC == TRANSACTION_COMMIT_TYPE
        _, half_phy = parse_msg_id(half.ext["msg_id"])
        assert real.prepared_transaction_offset == half_phy
        # Its op record lies right behind it: one batch.
        (op,), _ = await pull_op(client, addr)
        assert op.body == b"0" and op.properties["TAGS"] == "d" and op.phy_offset == real.phy_offset + real.size

        # Ended again, either way: nothing changes, the answer says what was decided.
        end = await commit_log_end(client, addr)
        for state in (TRANSACTION_COMMIT_TYPE, TRANSACTION_ROLLBACK_TYPE):
            r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(half, state, from_check=True))
            assert r.code == ResponseCode.TRANSACTION_SHOULD_COMMIT and "already committed" in r.remark, r.remark
        assert await commit_log_end(client, addr) == end
        assert len((await pull(client, addr, "TxT", 1))[0]) == 1

        # Five ENDs of one half at once (the producer's late answer racing the answers to checks): one acts.
        raced = await send_half(client, addr, "c2")
        answers = []

        async def end_once(state: int) -> None:
            # A connection each: one connection's requests are handled one after another.
            async with open_remoting_client() as own:
                answers.append((await call(own, addr, RequestCode.END_TRANSACTION, end_ext(raced, state))).code)

        async with trio.open_nursery() as racing:
            for state in (TRANSACTION_COMMIT_TYPE,) * 3 + (TRANSACTION_ROLLBACK_TYPE,) * 2:
                racing.start_soon(end_once, state)
        assert answers.count(ResponseCode.SUCCESS) == 1, answers
        assert set(answers) <= {ResponseCode.SUCCESS, ResponseCode.SYSTEM_BUSY, ResponseCode.TRANSACTION_SHOULD_COMMIT,
                                ResponseCode.TRANSACTION_SHOULD_ROLLBACK}, answers
        assert len((await pull(client, addr, "TxT", 1))[0]) <= 2

        rolled = await send_half(client, addr, "r1")
        r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(rolled, TRANSACTION_ROLLBACK_TYPE))
        assert r.code == ResponseCode.SUCCESS and r.ext["outcome"] == "rolled back"
        r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(rolled, TRANSACTION_COMMIT_TYPE))
        assert r.code == ResponseCode.TRANSACTION_SHOULD_ROLLBACK and "already rolled back" in r.remark
        unknown = await send_half(client, addr, "u1")
        r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(unknown, 0))
        assert r.code == ResponseCode.SUCCESS and r.ext["outcome"] == "unknown"
        delivered = [m.body for m in (await pull(client, addr, "TxT", 1))[0]]
        assert delivered in ([b"body-c1"], [b"body-c1", b"body-c2"]), delivered
        ops, _ = await pull_op(client, addr)
        assert [m.body for m in ops] == [b"0", b"1", b"2"]  # one op record per half ended, none for the unknown
        assert [m.properties["TRAN_OUTCOME"] for m in ops][0::2] == ["commit", "rollback"]
        info = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
        assert info["transactions_committed"] + info["transactions_rolled_back"] == 3
        assert info["transaction_half_max_offset"] == 4


async def pull_op(client, addr):
    # The op topic is not pullable (below): its records are read from the whole commit log.
    end = await commit_log_end(client, addr)
    r = await member_call(client, addr, RequestCode.FETCH_COMMIT_LOG, {"phy_offset": 0, "max_bytes": end,
                                                                       "group": "broker-a"})
    assert r.code == ResponseCode.SUCCESS, r.remark
    return [v for v in iter_records(r.body) if v.topic == "RMQ_SYS_TRANS_OP_HALF_TOPIC"], r


async def test_an_end_whose_producer_hung_up_while_it_waited_is_still_carried_out(nursery, tmp_path, monkeypatch):
    """The END's append is the broker's, not the request's: cancelled with the connection of a producer that hung
    up, a queued append was never proposed, and its half stayed "uncertain" for the rest of the term (every END
    for it answered SYSTEM_BUSY, and no half after it was checked again)."""
    from broker.node import BrokerNode

    (config,) = broker_configs(tmp_path, None)
    addr = await start_broker(nursery, config)
    gate: list[trio.Event] = []
    real_append = BrokerNode.append_messages

    async def gated_append(self, batch: bytes):
        if gate:
            await gate[0].wait()
        return await real_append(self, batch)

    monkeypatch.setattr(BrokerNode, "append_messages", gated_append)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        half = await send_half(client, addr, "hung-up")
        gate.append(trio.Event())
        async with open_connection(addr) as producer:
            with trio.move_on_after(0.3) as waited:
                await producer.invoke(make_request(RequestCode.END_TRANSACTION,
                                                   ext=end_ext(half, TRANSACTION_COMMIT_TYPE)), timeout_s=5.0)
            assert waited.cancelled_caught  # the END waits at the gate; its producer goes away
        await trio.sleep(0.2)  # the broker has seen the connection close
        gate.pop().set()
        with trio.fail_after(5):
            while not (await pull(client, addr, "TxT", 1))[0]:
                await trio.sleep(0.05)
        (real,), _ = await pull(client, addr, "TxT", 1)
        assert real.body == b"body-hung-up"
        again = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(half, TRANSACTION_COMMIT_TYPE))
        assert again.code == ResponseCode.TRANSACTION_SHOULD_COMMIT and "already committed" in again.remark, \
            (again.code, again.remark)


async def test_bad_end_transactions_get_their_own_codes_and_change_nothing(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        plain = await call(client, addr, RequestCode.SEND_MESSAGE,
                           {"topic": "TxT", "queue_id": 0, "properties": {"KEYS": "plain"}}, b"plain")
        half = await send_half(client, addr, "h1")
        second = await send_half(client, addr, "h2")
        end = await commit_log_end(client, addr)
        good = end_ext(half, TRANSACTION_COMMIT_TYPE)
        _, plain_phy = parse_msg_id(plain.ext["msg_id"])
        _, second_phy = parse_msg_id(second.ext["msg_id"])
        cases = [
            ({**good, "commit_log_offset": plain_phy}, ResponseCode.NO_MESSAGE, "no half message"),
            ({**good, "commit_log_offset": plain_phy + 10}, ResponseCode.NO_MESSAGE, "no half message"),
            ({**good, "commit_log_offset": second_phy}, ResponseCode.NO_MESSAGE, "no half message"),
            ({**good, "tran_state_table_offset": 99}, ResponseCode.NO_MESSAGE, "no half message"),
            ({**good, "producer_group": "other_group"}, ResponseCode.TRANSACTION_STATE_GROUP_WRONG, "'other_group'"),
            ({**good, "transaction_id": "U-h2"}, ResponseCode.INVALID_REQUEST, "'transaction_id'"),
            ({**good, "commit_or_rollback": 4}, ResponseCode.INVALID_REQUEST, "'commit_or_rollback'"),
            ({**good, "commit_or_rollback": "COMMIT"}, ResponseCode.INVALID_REQUEST, "'commit_or_rollback'"),
            ({**good, "commit_log_offset": -1}, ResponseCode.INVALID_REQUEST, "'commit_log_offset'"),
            ({**good, "from_transaction_check": "yes"}, ResponseCode.INVALID_REQUEST, "'from_transaction_check'"),
            ({**good, "producer_group": "bad group"}, ResponseCode.INVALID_REQUEST, "'producer_group'"),
        ]
        for field in ("producer_group", "tran_state_table_offset", "commit_log_offset", "commit_or_rollback"):
            cases.append(({k: v for k, v in good.items() if k != field}, ResponseCode.INVALID_REQUEST, f"'{field}'"))
        for ext, code, needle in cases:
            r = await call(client, addr, RequestCode.END_TRANSACTION, ext)
            assert r.code == code and needle in r.remark, (ext, r.code, r.remark)
        assert await commit_log_end(client, addr) == end
        # A transactional message may not be delayed, and needs its group and id; a batch may not be one.
        for props, needle in (({"DELAY": "1"}, "delayed"), ({"PGROUP": ""}, "'PGROUP'"),
                              ({"UNIQ_KEY": ""}, "'UNIQ_KEY'"), ({"TRAN_MSG": "false"}, "'TRAN_MSG'")):
            r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": "TxT", "queue_id": 0, "properties": {
                "TRAN_MSG": "true", "PGROUP": GROUP, "UNIQ_KEY": "U-x", **props}}, b"x")
            assert r.code == ResponseCode.INVALID_REQUEST and needle in r.remark, (props, r.remark)
        batch = encode_batch([MessageInput("TxT", 0, b"a"), MessageInput("TxT", 0, b"b", sys_flag=0x4)],
                             ("127.0.0.1", 1))
        r = await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": "TxT", "queue_id": 0}, batch)
        assert r.code == ResponseCode.MESSAGE_ILLEGAL and "transactional" in r.remark
        for topic in ("RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC"):
            _, r = await pull(client, addr, topic, 0)
            assert r.code == ResponseCode.NO_PERMISSION and "transaction records" in r.remark
            r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": topic, "queue_id": 0}, b"x")
            assert r.code == ResponseCode.NO_PERMISSION and "reserved" in r.remark
        assert await commit_log_end(client, addr) == end
        # ... and the broker still serves: the good request goes through.
        r = await call(client, addr, RequestCode.END_TRANSACTION, good)
        assert r.code == ResponseCode.SUCCESS and r.ext["outcome"] == "committed"


class RawProducer:
    """A producer connection that records CHECK_TRANSACTION_STATE requests (what the client's ServerRequests
    would answer)."""

    def __init__(self) -> None:
        self.checks: list[tuple[dict, bytes]] = []
        self.arrived = trio.Event()

    async def handle(self, request, conn):
        if request.code == RequestCode.CHECK_TRANSACTION_STATE:
            self.checks.append((dict(request.ext), request.body))
            self.arrived.set()
            return None
        return make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED)


async def test_a_half_not_ended_is_checked_each_interval_and_discarded_after_the_last_check(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, transaction_timeout_ms=300, transaction_check_interval_ms=100,
                               transaction_check_max=2)
    addr = await start_broker(nursery, config)
    producer = RawProducer()
    async with open_remoting_client(handler=producer) as client:
        await wait_leader(client, addr)
        await heartbeat_producer(client, addr)
        answered = await send_half(client, addr, "a1")
        await send_half(client, addr, "f1")
        with trio.fail_after(10):
            while len({ext["transaction_id"] for ext, _ in producer.checks}) < 2:
                await trio.sleep(0.02)
        ext, body = next(c for c in producer.checks if c[0]["transaction_id"] == "U-a1")
        assert ext["producer_group"] == GROUP and ext["broker_name"] == "broker-a"
        copy = decode_record(body)
        assert copy.properties["TRANSACTION_CHECK_TIMES"] == "1" and copy.body == b"body-a1"
        assert copy.phy_offset == ext["commit_log_offset"] and copy.properties["REAL_TOPIC"] == "TxT"
        # The producer's own END for the first copy arrives late: it ends the live copy, found by its id.
        late = {**end_ext(answered, TRANSACTION_COMMIT_TYPE), "transaction_id": "U-a1"}
        r = await call(client, addr, RequestCode.END_TRANSACTION, late)
        assert r.code == ResponseCode.SUCCESS and r.ext["outcome"] == "committed", r.remark
        # The other is never answered: checked transaction_check_max times, then discarded where operators look.
        with trio.fail_after(15):
            while True:
                dead, _ = await pull(client, addr, "TRANS_CHECK_MAX_TIME_TOPIC", 0)
                if dead:
                    break
                await trio.sleep(0.05)
        (discarded,) = dead
        assert discarded.body == b"body-f1" and discarded.properties["TRANSACTION_CHECK_TIMES"] == "2"
        assert discarded.properties["REAL_TOPIC"] == "TxT" and discarded.properties["PGROUP"] == GROUP
        found = await call(client, addr, RequestCode.QUERY_MESSAGE, {"topic": "TRANS_CHECK_MAX_TIME_TOPIC",
                                                                     "key": "f1"})
        assert [v.body for v in iter_records(found.body)] == [b"body-f1"]  # what `admin query-msg-key` asks
        f1_checks = [e for e, _ in producer.checks if e["transaction_id"] == "U-f1"]
        assert len(f1_checks) == 2
        a1_checks = [e for e, _ in producer.checks if e["transaction_id"] == "U-a1"]
        await trio.sleep(0.6)
        assert [m.body for m in (await pull(client, addr, "TxT", 1))[0]] == [b"body-a1"]
        assert [e for e, _ in producer.checks if e["transaction_id"] == "U-a1"] == a1_checks, "checked after its end"
        # Ending the discarded one now changes nothing: it is below the check progress, its outcome forgotten.
        end = await commit_log_end(client, addr)
        r = await call(client, addr, RequestCode.END_TRANSACTION,
                       {**end_ext(answered, TRANSACTION_COMMIT_TYPE), "tran_state_table_offset": f1_checks[-1][
                           "tran_state_table_offset"], "commit_log_offset": f1_checks[-1]["commit_log_offset"]})
        assert r.code == ResponseCode.TRANSACTION_STATE_UNKNOW and "nothing was done" in r.remark, r.remark
        assert await commit_log_end(client, addr) == end
        info = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
        assert info["transactions_discarded"] == 1 and info["transaction_checks"] >= 3
        assert info["transaction_half_offset"] >= 3


async def test_a_half_too_big_to_carry_one_more_check_count_is_discarded_not_fatal(nursery, tmp_path):
    # Its properties just under RocketMQ's 32,767 bytes, the check count a re-stored copy adds made it unstorable:
    # the check round raised MessageFormatError out of the node's nursery and stopped the broker, and every leader
    # after it at the same half, the replicated progress never passing it.
    import functools

    from broker.node import serve_broker
    from remoting.message import MAX_PROPERTIES_SIZE, encode_properties

    (config,) = broker_configs(tmp_path, None)
    nodes = []
    host, port = await nursery.start(functools.partial(serve_broker, config, on_serving=nodes.append))
    addr, node = f"{host}:{port}", nodes[0]
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        small = await send_half(client, addr, "small", pad="x" * 100)
        stored = decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                           {"msg_id": small.ext["msg_id"]})).body)
        # The same properties with a pad that leaves 10 bytes ("TRANSACTION_CHECK_TIMES\x011\x02" takes 26).
        pad = 100 + MAX_PROPERTIES_SIZE - 10 - len(encode_properties(stored.properties))
        big = await send_half(client, addr, "big", pad="x" * pad)  # 4 bytes shorter in its id and key: 14 left
        checked = await node.transactions.check_round(now_ms=int(time.time() * 1000) + 3_600_000)
        assert checked == 2 and (node.transactions.checks, node.transactions.discarded) == (1, 1)
        (discarded,), _ = await pull(client, addr, "TRANS_CHECK_MAX_TIME_TOPIC", 0)
        assert discarded.properties["pad"] == "x" * pad and "TRANSACTION_CHECK_TIMES" not in discarded.properties
        assert big.ext["queue_offset"] == 1
        r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(big, TRANSACTION_COMMIT_TYPE))
        # Settled (and passed by the check progress): nothing is committed.
        assert r.code == ResponseCode.TRANSACTION_STATE_UNKNOW and "settled" in r.remark, (r.code, r.remark)
        assert (await pull(client, addr, "TxT", 1))[0] == []


async def test_a_commit_of_a_half_whose_topic_was_deleted_is_rolled_back_not_stored(nursery, tmp_path):
    # The commit stored the message behind the deletion's cut: once the name was created again, it was that new
    # topic's first message (and END_TRANSACTION said "committed" for a topic that no longer existed).
    (config,) = broker_configs(tmp_path, None)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        halves = {}
        for topic in ("TxGone", "TxAgain"):
            r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": topic})
            assert r.code == ResponseCode.SUCCESS, r.remark
            halves[topic] = await send_half(client, addr, topic, topic=topic, queue_id=0)
            r = await call(client, addr, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": topic})
            assert r.code == ResponseCode.SUCCESS, r.remark
        # TxAgain exists again (a new topic under the name) by the time its old transaction commits.
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "TxAgain"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        for topic, half in halves.items():
            r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(half, TRANSACTION_COMMIT_TYPE))
            assert r.code == ResponseCode.TOPIC_NOT_EXIST and r.ext["outcome"] == "rolled back", (topic, r.remark)
            assert f"topic {topic!r} was deleted after the half message" in r.remark, r.remark
            # Settled: a repeated END (or the check's answer) is told the outcome, nothing is stored.
            r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(half, TRANSACTION_COMMIT_TYPE))
            assert r.code == ResponseCode.TRANSACTION_SHOULD_ROLLBACK, (topic, r.code, r.remark)
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "TxGone"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        for topic in halves:
            assert (await pull(client, addr, topic, 0))[0] == [], topic
        ops, _ = await pull_op(client, addr)
        assert [m.properties["TRAN_OUTCOME"] for m in ops] == ["rollback", "rollback"]


async def test_a_half_whose_topic_was_deleted_is_rolled_back_by_the_check_not_restored_past_the_cut(
        nursery, tmp_path):
    # The check round re-stored it past the deletion record; the producer's COMMIT then named the new copy, which no
    # cut covered, and the message landed in the topic created again under the name.
    (config,) = broker_configs(tmp_path, None, transaction_timeout_ms=300, transaction_check_interval_ms=100)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "TxR"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        half = await send_half(client, addr, "k1", topic="TxR", queue_id=0)
        r = await call(client, addr, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": "TxR"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        with trio.fail_after(10):  # the next check round settles it
            while cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)[
                    "transactions_rolled_back"] < 1:
                await trio.sleep(0.05)
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "TxR"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(half, TRANSACTION_COMMIT_TYPE))
        # Settled as rolled back (or, the check progress past it, no longer held): nothing is committed.
        assert r.code in (ResponseCode.TRANSACTION_SHOULD_ROLLBACK, ResponseCode.TRANSACTION_STATE_UNKNOW), \
            (r.code, r.remark)
        assert (await pull(client, addr, "TxR", 0))[0] == []
        info = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
        assert (info["transactions_committed"], info["transactions_rolled_back"]) == (0, 1)
