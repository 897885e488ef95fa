"""ACL with real processes: a name server and the 3-node group broker-a with ``acl_enable`` on, started once for the
module and sharing one ACL file; clients in this process, ``raftmq admin`` as the operator runs it.

An admin account creates the topic (a non-admin one cannot); a producer with PUB sends, one without credentials,
with a wrong secret or with DENY on the topic is refused NO_PERMISSION naming the topic, and the group keeps
serving; a consumer with SUB consumes (heartbeats, rebalance, pulls and offset commits all pass the ACL); a
transaction is settled by its producer's END_TRANSACTION and by a check-back; a send-back is judged by the message
stored at its offset and an offset clone needs an admin; an account added to the file on disk works without a
restart; the members' own requests (commit-log copies: members only; a leadership transfer: a member or an admin)
are refused to others; a broker whose ACL file is bad does not start."""

from __future__ import annotations

import json
import subprocess
import tomllib

import pytest
import trio

from client import Message, SendFailedError, TransactionState, open_producer, open_push_consumer
from dledger.member_auth import MemberSigner
from dledger.service import get_raft_status
from remoting.acl import RequestSigner
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.message import iter_records, parse_msg_id
from remoting.transport import open_remoting_client
from tests.cluster.test_admin_cli import _admin
from tests.cluster.test_e2e_produce_consume import Cluster
from tests.procs import raftmq_argv, spawner

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(180)]

TOPIC = "AclTopic"
ACL = """\
[[accounts]]
access_key = "rocketmq2"
secret_key = "admin-secret"
admin = true

[[accounts]]
access_key = "producer1"
secret_key = "producer-secret"
default_topic_perm = "DENY"
default_group_perm = "DENY"
topic_perms = ["AclTopic=PUB"]

[[accounts]]
access_key = "consumer1"
secret_key = "consumer-secret"
topic_perms = ["AclTopic=SUB"]
group_perms = ["acl_readers=SUB"]

[[accounts]]
access_key = "denied-user"
secret_key = "denied-secret"
default_topic_perm = "PUB"
topic_perms = ["AclTopic=DENY"]
"""
ADMIN = {"access_key": "rocketmq2", "secret_key": "admin-secret"}
PRODUCER = {"access_key": "producer1", "secret_key": "producer-secret"}
CONSUMER = {"access_key": "consumer1", "secret_key": "consumer-secret"}
ONE_TRY = {"retry_times_when_send_failed": 0, "send_msg_timeout_ms": 3000}


@pytest.fixture(scope="module")
def acl_cluster(tmp_path_factory):
    """(cluster, acl file): every process stopped at the end, pass or fail. Transaction checks come fast, so that
    a check-back is seen within the test."""
    tmp = tmp_path_factory.mktemp("acl")
    acl_path = tmp / "plain_acl.toml"
    acl_path.write_text(ACL)
    with spawner(tmp) as spawn:
        cluster = Cluster(spawn, tmp / "cluster", {"acl_enable": "true", "acl_file": json.dumps(str(acl_path)),
                                                   "transaction_timeout_ms": "500",
                                                   "transaction_check_interval_ms": "300"})
        trio.run(cluster.leader_addr)
        yield cluster, acl_path


async def _admin_cli(namesrv: str, *args: str, expect_rc: int | None):
    return await trio.to_thread.run_sync(lambda: _admin(namesrv, *args, expect_rc=expect_rc))


async def _create_topic(namesrv: str) -> None:
    """As the operator, through the CLI's flags; retried while the group's leader gets ready."""
    with trio.fail_after(30):
        while (await _admin_cli(namesrv, "create-topic", TOPIC, "--read-queues", "2", "--write-queues", "2",
                                "--access-key", ADMIN["access_key"], "--secret-key", ADMIN["secret_key"],
                                expect_rc=None)).returncode:
            await trio.sleep(0.3)


async def _refused(namesrv: str, **credentials) -> BaseException:
    async with open_producer(namesrv, **ONE_TRY, **credentials) as producer:
        with pytest.raises(SendFailedError) as refused:
            await producer.send(Message(TOPIC, b"refused"))
    error = refused.value.last_error
    assert error.code == ResponseCode.NO_PERMISSION, error
    assert f"refused SEND_MESSAGE (code 10) on topic '{TOPIC}'" in str(error)
    return error


async def test_admin_topics_sends_by_permission_and_the_group_keeps_serving(acl_cluster):
    cluster, _ = acl_cluster
    namesrv = cluster.namesrv
    non_admin = await _admin_cli(namesrv, "create-topic", "NotMine", "--access-key", PRODUCER["access_key"],
                                 "--secret-key", PRODUCER["secret_key"], expect_rc=1)
    assert "account 'producer1' is not an admin account" in non_admin.stderr, non_admin.stderr
    assert "UPDATE_AND_CREATE_TOPIC (code 17) on topic 'NotMine'" in non_admin.stderr
    await _create_topic(namesrv)

    async with open_producer(namesrv, **PRODUCER) as producer:
        first = await producer.send(Message(TOPIC, b"allowed-1"))
        assert "carries no AccessKey" in str(await _refused(namesrv))
        wrong = await _refused(namesrv, access_key="producer1", secret_key="not-the-secret")
        assert "its Signature does not match account 'producer1'" in str(wrong)
        assert "not-the-secret" not in str(wrong) and "producer-secret" not in str(wrong)
        denied = await _refused(namesrv, access_key="denied-user", secret_key="denied-secret")
        assert "account 'denied-user' has no PUB permission on topic 'AclTopic' (topic_perms entry " \
               "AclTopic=DENY)" in str(denied)
        # The refusals cost nobody else anything.
        second = await producer.send(Message(TOPIC, b"allowed-2"))
        assert second.msg_id != first.msg_id


async def test_a_consumer_with_sub_consumes_and_transactions_settle(acl_cluster):
    cluster, _ = acl_cluster
    namesrv = cluster.namesrv
    await _create_topic(namesrv)

    class Listener:
        def __init__(self) -> None:
            self.checked: list[str] = []

        async def execute(self, msg, arg) -> TransactionState:
            return TransactionState.COMMIT if msg.keys == "tx-commit" else TransactionState.UNKNOWN

        async def check(self, msg) -> TransactionState:
            self.checked.append(msg.keys[0])
            return TransactionState.COMMIT

    listener = Listener()
    got: set[bytes] = set()
    everything = trio.Event()
    wanted = {b"plain", b"tx-commit", b"tx-checked"}

    async def on_message(msg) -> None:
        got.add(msg.body)
        if wanted <= got:
            everything.set()

    # Frequent heartbeats: a broker checks a transaction back with a producer of its group that sent one.
    async with open_producer(namesrv, producer_group="acl_tx_producers", transaction_listener=listener,
                             heartbeat_broker_interval_ms=300, **PRODUCER) as producer, \
            open_push_consumer(namesrv, topic=TOPIC, handler=on_message, consumer_group="acl_readers",
                               consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=500,
                               **CONSUMER):
        await producer.send(Message(TOPIC, b"plain"))
        await producer.send_in_transaction(Message(TOPIC, b"tx-commit", keys="tx-commit"))
        # UNKNOWN at first: the broker's check-back (CHECK_TRANSACTION_STATE, broker to client) asks the listener,
        # whose answer goes back as a signed END_TRANSACTION.
        await producer.send_in_transaction(Message(TOPIC, b"tx-checked", keys="tx-checked"))
        with trio.fail_after(60):
            await everything.wait()
    assert "tx-checked" in listener.checked


async def test_a_send_back_is_judged_by_its_stored_message_and_an_offset_clone_needs_an_admin(acl_cluster):
    """CONSUMER_SEND_MSG_BACK copies the message stored at its offset into the sender's group: consumer1 (SUB on
    AclTopic and its group only) may not have one of another topic copied, with or without origin_topic."""
    cluster, _ = acl_cluster
    namesrv = cluster.namesrv
    await _create_topic(namesrv)
    async with open_producer(namesrv, **ADMIN) as admin_producer, open_producer(namesrv, **PRODUCER) as producer:
        secret = await admin_producer.send(Message("AclSecret", b"not for consumer1"))
        readable = await producer.send(Message(TOPIC, b"for consumer1"))
    leader = await cluster.leader_addr()
    async with open_remoting_client(signer=RequestSigner(CONSUMER["access_key"], CONSUMER["secret_key"]).sign) as rpc:
        async def send_back(result, **ext):
            # delay_level -1: straight to the group's dead letters, so nothing is redelivered to the other tests.
            return await rpc.invoke(leader, make_request(RequestCode.CONSUMER_SEND_MSG_BACK, {
                "group": "acl_readers", "offset": parse_msg_id(result.offset_msg_id)[1], "delay_level": -1, **ext}))

        for refused in (await send_back(secret), await send_back(secret, origin_topic=TOPIC)):
            assert refused.code == ResponseCode.NO_PERMISSION, refused
            assert "account 'consumer1' has no SUB permission on topic 'AclSecret'" in refused.remark
        allowed = await send_back(readable)
        assert (allowed.code, allowed.ext.get("topic")) == (ResponseCode.SUCCESS, "%DLQ%acl_readers"), allowed
        clone = await rpc.invoke(leader, make_request(RequestCode.CLONE_GROUP_OFFSET, {
            "src_group": "acl_readers", "dest_group": "acl_others", "topic": TOPIC}))
        assert clone.code == ResponseCode.NO_PERMISSION, clone
        assert "CLONE_GROUP_OFFSET (code 314) on topic 'AclTopic': account 'consumer1' is not an admin" in clone.remark


async def test_an_account_added_to_the_file_works_without_a_restart(acl_cluster):
    cluster, acl_path = acl_cluster
    namesrv = cluster.namesrv
    await _create_topic(namesrv)
    late = {"access_key": "late-user", "secret_key": "late-secret"}
    assert "no account has AccessKey 'late-user'" in str(await _refused(namesrv, **late))
    try:
        acl_path.write_text(ACL + '\n[[accounts]]\naccess_key = "late-user"\nsecret_key = "late-secret"\n'
                                  'topic_perms = ["AclTopic=PUB"]\n')
        async with open_producer(namesrv, **ONE_TRY, **late) as producer:
            with trio.fail_after(20):
                while True:
                    try:
                        await producer.send(Message(TOPIC, b"late"))
                        break
                    except SendFailedError as e:
                        assert "no account has AccessKey 'late-user'" in str(e.last_error)
                        await trio.sleep(0.2)
    finally:
        acl_path.write_text(ACL)


async def test_members_own_requests_are_theirs_alone_and_a_transfer_needs_an_admin_or_a_member(acl_cluster):
    # FETCH_COMMIT_LOG and TRANSFER_LEADERSHIP were served to anyone reaching a service port, ACL or not: a stranger
    # read every stored message and moved the master at will.
    cluster, _ = acl_cluster
    await _create_topic(cluster.namesrv)
    async with open_producer(cluster.namesrv, **PRODUCER) as producer:
        await producer.send(Message(TOPIC, b"for members' eyes"))
    leader = await cluster.leader_addr()
    secret = tomllib.loads(cluster.paths["n1"].read_text())["dledger"]["secret"]
    admin, member = RequestSigner(ADMIN["access_key"], ADMIN["secret_key"]), MemberSigner(secret)
    fetch = make_request(RequestCode.FETCH_COMMIT_LOG, ext={"group": "broker-a", "phy_offset": 0, "max_bytes": 4096})
    async with open_remoting_client() as rpc:
        with trio.fail_after(60):
            for stranger in (fetch, admin.sign(fetch), MemberSigner("a secret of some other group").sign(fetch)):
                r = await rpc.invoke(leader, stranger, timeout_s=5)
                assert r.code == ResponseCode.NO_PERMISSION and not r.body, (r.code, r.remark)
                assert "served to the members of group 'broker-a' only" in r.remark, r.remark
            r = await rpc.invoke(leader, member.sign(fetch), timeout_s=5)
            assert r.code == ResponseCode.SUCCESS, (r.code, r.remark)
            assert b"for members' eyes" in b"".join(v.body for v in iter_records(r.body))
            # The status lookup stays open (raftmq chaos asks it with nothing to sign with); checksums of the log do
            # not: the crc32c of each prefix a caller names read the log back a byte a query.
            assert (await get_raft_status(rpc, leader, "broker-a"))[0]["role"] == "LEADER"
            sums = make_request(RequestCode.GET_RAFT_STATUS, ext={"group": "broker-a", "checksum_up_to": 1})
            for stranger, why in ((sums, "carries no AccessKey"),
                                  (RequestSigner(PRODUCER["access_key"], PRODUCER["secret_key"]).sign(sums),
                                   "GET_RAFT_STATUS (code 1002): account 'producer1' is not an admin account")):
                r = await rpc.invoke(leader, stranger, timeout_s=5)
                assert r.code == ResponseCode.NO_PERMISSION and not r.body and why in r.remark, (r.code, r.remark)
            for allowed in (admin.sign(sums), member.sign(sums)):
                r = await rpc.invoke(leader, allowed, timeout_s=5)
                assert r.code == ResponseCode.SUCCESS and r.body, (r.code, r.remark)
            # So `raftmq verify` needs an admin account here.
            members = ",".join(cluster.addr_of.values())
            verify = ["verify", "--group", "broker-a", "--members", members, "--max-lag-bytes", str(1 << 30)]
            refused = await trio.to_thread.run_sync(lambda: subprocess.run(raftmq_argv(*verify), capture_output=True,
                                                                           text=True, timeout=30))
            assert refused.returncode == 2 and "NO_PERMISSION" in refused.stderr, refused
            done = await trio.to_thread.run_sync(lambda: subprocess.run(
                raftmq_argv(*verify, "--access-key", ADMIN["access_key"], "--secret-key", ADMIN["secret_key"]),
                capture_output=True, text=True, timeout=30))
            assert done.returncode == 0 and "are identical" in done.stdout, (done.stdout, done.stderr)

            to = next(nid for nid in cluster.addr_of if cluster.addr_of[nid] != leader)
            transfer = make_request(RequestCode.TRANSFER_LEADERSHIP,
                                    ext={"group": "broker-a", "to": to, "timeout_ms": 5000})
            r = await rpc.invoke(leader, transfer, timeout_s=10)
            assert r.code == ResponseCode.NO_PERMISSION and "carries no AccessKey" in r.remark, r.remark
            r = await rpc.invoke(leader, RequestSigner(PRODUCER["access_key"], PRODUCER["secret_key"]).sign(transfer),
                                 timeout_s=10)
            assert r.code == ResponseCode.NO_PERMISSION, r.remark
            assert "TRANSFER_LEADERSHIP (code 1003): account 'producer1' is not an admin account" in r.remark, r.remark
            assert (await get_raft_status(rpc, leader, "broker-a"))[0]["role"] == "LEADER"  # nothing moved
            r = await rpc.invoke(leader, admin.sign(transfer), timeout_s=10)
            assert r.code == ResponseCode.SUCCESS and r.ext["leader_id"] == to, (r.code, r.remark)
            # A member's (a node handing over before a restart) needs no account; back to where it was.
            back = make_request(RequestCode.TRANSFER_LEADERSHIP,
                                ext={"group": "broker-a", "to": cluster.node_at(leader), "timeout_ms": 5000})
            r = await rpc.invoke(cluster.addr_of[to], member.sign(back), timeout_s=10)
            assert r.code == ResponseCode.SUCCESS and r.ext["leader_id"] == cluster.node_at(leader), (r.code, r.remark)


def test_a_bad_acl_file_stops_a_broker_before_it_starts(acl_cluster, tmp_path):
    cluster, _ = acl_cluster
    bad = tmp_path / "bad_acl.toml"
    bad.write_text('[[accounts]]\naccess_key = "producer1"\nsecret_key = "producer-secret"\n'
                   'topic_perms = ["AclTopic=WRITE"]\n')
    done = subprocess.run(raftmq_argv("broker", "--config", str(cluster.paths["n1"]), "--set", "acl_enable=true",
                                      "--set", f"acl_file={json.dumps(str(bad))}"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert f"ACL file {str(bad)!r}: accounts[0] (access_key 'producer1'): topic_perms[0] 'AclTopic=WRITE': its " \
           f"permission must be one of DENY, PUB, SUB, PUB|SUB, got 'WRITE'" in done.stderr, done.stderr
