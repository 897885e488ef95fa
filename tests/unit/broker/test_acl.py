"""The broker's ACL (broker/acl.py): the file's validation, address patterns, the permission matrix, the
checker's order of judgement, the requests judged by the message stored at an offset, the logging of refusals and
the reload of a changed file. Requests are signed as a client signs them (remoting/acl.py); nothing is served."""

from __future__ import annotations

import ipaddress
import logging
import os
import textwrap
import tomllib

import cbor2
import pytest

from broker.acl import (ADMIN_CODES, DENY, PUB, REFUSAL_LOG_INTERVAL_S, SUB, AclChecker, AddressPattern,
                        acl_file_path, load_acl_file, parse_acl_rules, parse_perm, permits, request_resources)
from broker.pop import MAX_BATCH_ACK, ReceiptHandle
from dledger.service import DLedgerService
from remoting.acl import RequestSigner
from remoting.codec import make_request
from remoting.codes import RequestCode
from remoting.config import ConfigError
from remoting.message import (PROPERTY_REAL_TOPIC, PROPERTY_RETRY_TOPIC, SCHEDULE_TOPIC, TRANS_HALF_TOPIC,
                              create_msg_id)

ACL = textwrap.dedent("""\
    global_white_remote_addresses = ["10.10.103.*"]

    [[accounts]]
    access_key = "producer1"
    secret_key = "producer-secret"
    default_topic_perm = "SUB"
    default_group_perm = "SUB"
    topic_perms = ["Orders=PUB", "Audit=DENY", "Both=PUB|SUB"]
    group_perms = ["blocked=DENY"]

    [[accounts]]
    access_key = "rocketmq2"
    secret_key = "admin-secret"
    admin = true
    white_remote_address = "192.168.1.*"

    [[accounts]]
    access_key = "listed-admin"
    secret_key = "admin-secret2"
    admin = true
    topic_perms = ["Orders=DENY"]
""")

PRODUCER = RequestSigner("producer1", "producer-secret")
ADMIN = RequestSigner("rocketmq2", "admin-secret")
LISTED_ADMIN = RequestSigner("listed-admin", "admin-secret2")
FROM = "127.0.0.1:40000"


@pytest.fixture
def acl_file(tmp_path):
    path = tmp_path / "plain_acl.toml"
    path.write_text(ACL)
    return path


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def checker(acl_file):
    return AclChecker(acl_file, broker_name="broker-a", clock=Clock())


def send(topic: str, **ext):
    return make_request(RequestCode.SEND_MESSAGE_V2, {"topic": topic, "producer_group": "pg", **ext}, b"body")


def pull(topic: str, group: str):
    return make_request(RequestCode.PULL_MESSAGE, {"topic": topic, "consumer_group": group, "queue_id": 0,
                                                   "queue_offset": 0})


# --- the file -----------------------------------------------------------------------------------------------------

def test_the_file_loads_with_its_defaults(acl_file):
    rules = load_acl_file(acl_file)
    assert [p.text for p in rules.global_white] == ["10.10.103.*"]
    producer = rules.accounts["producer1"]
    assert (producer.admin, producer.default_topic_perm, producer.white_remote_address) == (False, SUB, None)
    assert dict(producer.topic_perms) == {"Orders": PUB, "Audit": DENY, "Both": PUB | SUB}
    admin = rules.accounts["rocketmq2"]
    # Left out, a default permission is DENY (RocketMQ's parsePermFromString(null)).
    assert (admin.admin, admin.default_topic_perm, admin.default_group_perm) == (True, DENY, DENY)
    assert "admin-secret" not in repr(rules)


@pytest.mark.parametrize("text, expected", [
    ('accounts = [{access_key = "producer1", secret_key = "short"}]', "accounts[0] (access_key 'producer1'): "
                                                                       "secret_key must be at least 7 characters"),
    ('accounts = [{access_key = "abc", secret_key = "long-enough"}]', "accounts[0] (access_key 'abc'): access_key "
                                                                        "must be at least 7 characters"),
    ('accounts = [{secret_key = "long-enough"}]', "accounts[0]: access_key is required"),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough", topic_perms = ["A=ALL"]}]',
     "topic_perms[0] 'A=ALL': its permission must be one of DENY, PUB, SUB, PUB|SUB, got 'ALL'"),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough", topic_perms = ["A"]}]',
     "topic_perms[0] must be \"NAME=PERM\""),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough", topic_perms = ["A=PUB", "A=SUB"]}]',
     "topic_perms[1] 'A=SUB': topic 'A' is listed twice"),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough", topic_perms = ["%RETRY%g=SUB"]}]',
     "list 'g' in group_perms instead"),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough", topic_perms = ["%RETRY%g+T=SUB"]}]',
     "a POP retry topic is its group's and its topic's resource; list 'g' in group_perms and 'T' in topic_perms"),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough", group_perms = ["bad group=SUB"]}]',
     "group_perms[0] 'bad group=SUB': group 'bad group'"),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough", default_group_perm = "READ"}]',
     "default_group_perm must be one of DENY, PUB, SUB, PUB|SUB, got 'READ'"),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough", admin = "yes"}]',
     "admin must be true or false, got 'yes'"),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough", whiteRemoteAddress = "*"}]',
     "unknown key 'whiteRemoteAddress'"),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough", white_remote_address = "10.0.0.300"}]',
     "white_remote_address '10.0.0.300': '300' is not a number within 0..255"),
    ('accounts = [{access_key = "producer1", secret_key = "long-enough"}, '
     '{access_key = "producer1", secret_key = "other-secret"}]',
     "accounts[1]: access_key 'producer1' is given to an earlier account too"),
    ('global_white_remote_addresses = ["10.0.*"]', "global_white_remote_addresses[0] '10.0.*': '10.0.*' is not "
                                                   "four dot-separated parts"),
    ('global_white_remote_addresses = "*"', "global_white_remote_addresses must be a list"),
    ('access_key = "producer1"', "unknown key 'access_key'"),
])
def test_a_bad_entry_is_refused_naming_it(tmp_path, text, expected):
    path = tmp_path / "acl.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_acl_file(path)
    assert str(refused.value).startswith(f"ACL file {str(path)!r}: ")
    assert expected in str(refused.value)


def test_a_bad_secret_is_never_repeated_and_a_missing_or_broken_file_is_named(tmp_path):
    path = tmp_path / "acl.toml"
    path.write_text('accounts = [{access_key = "producer1", secret_key = " padded-secret"}]')
    with pytest.raises(ConfigError) as refused:
        load_acl_file(path)
    assert "secret_key must not contain control characters" in str(refused.value)
    assert "padded-secret" not in str(refused.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_acl_file(tmp_path / "missing.toml")
    path.write_text("accounts = [")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_acl_file(path)


def test_the_default_file_is_in_the_store_directory(tmp_path):
    class Store:
        store_dir = tmp_path / "store"

    class Config:
        acl_file = ""
        store = Store()

    assert acl_file_path(Config()) == tmp_path / "store" / "plain_acl.toml"
    Config.acl_file = "/etc/raftmq/acl.toml"
    assert str(acl_file_path(Config())) == "/etc/raftmq/acl.toml"


# --- addresses and permissions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern, yes, no", [
    ("*", ["1.2.3.4", "::1"], []),
    ("192.168.0.*", ["192.168.0.1", "192.168.0.255"], ["192.168.1.1"]),
    ("192.168.1.{1,2,3}", ["192.168.1.2"], ["192.168.1.4"]),
    ("192.168.1.1,192.168.2.100", ["192.168.2.100"], ["192.168.2.1"]),
    ("192.168.100-200.10-20", ["192.168.150.15", "192.168.100.10"], ["192.168.99.15", "192.168.150.21"]),
    ("10.0.0.0/8,::1", ["10.9.8.7", "::1", "::ffff:10.1.1.1"], ["11.0.0.1", "::2"]),
])
def test_address_patterns(pattern, yes, no):
    parsed = AddressPattern.parse(pattern, "x")
    assert all(parsed.matches(ipaddress.ip_address(a)) for a in yes)
    assert not any(parsed.matches(ipaddress.ip_address(a)) for a in no)
    assert not parsed.matches(None) or pattern == "*"


def test_deny_beats_everything_else_of_an_entry():
    assert permits(PUB | SUB, PUB) and permits(PUB | SUB, SUB)
    assert permits(PUB, PUB) and not permits(PUB, SUB) and not permits(SUB, PUB)
    assert not permits(DENY | PUB | SUB, PUB)
    assert parse_perm(" sub|pub ", "x") == PUB | SUB


def test_what_each_request_needs():
    assert request_resources(send("Orders")) == [("topic", "Orders", PUB)]
    # A retry topic is its group's resource.
    assert request_resources(send("%RETRY%g1")) == [("group", "g1", SUB)]
    assert request_resources(pull("Orders", "g1")) == [("topic", "Orders", SUB), ("group", "g1", SUB)]
    heartbeat = make_request(RequestCode.HEART_BEAT, body=cbor2.dumps({
        "client_id": "c", "producers": [{"producer_group": "pg"}],
        "consumers": [{"consumer_group": "g1", "subscriptions": [{"topic": "Orders"}, {"topic": "%RETRY%g1"}]}]}))
    assert request_resources(heartbeat) == [("group", "g1", SUB), ("topic", "Orders", SUB), ("group", "g1", SUB)]
    offset = make_request(RequestCode.UPDATE_CONSUMER_OFFSET, {"consumer_group": "g1", "topic": "Orders"})
    assert request_resources(offset) == [("group", "g1", SUB), ("topic", "Orders", SUB)]
    for code in (RequestCode.POP_MESSAGE, RequestCode.ACK_MESSAGE, RequestCode.CHANGE_MESSAGE_INVISIBLETIME):
        pop = make_request(code, {"consumer_group": "g1", "topic": "Orders"})
        assert request_resources(pop) == [("group", "g1", SUB), ("topic", "Orders", SUB)]
    # A batch ack: SUB on the group and on the topic each receipt handle names (a POP retry topic's group and topic);
    # a handle that cannot be read names nothing (the processor refuses it), nor does a body that is no list of
    # strings (the processor refuses it whole).
    handles = ["2 broker-a g1 Orders 0 5 5 1700000000000 30000", "2 broker-a g1 %RETRY%g1+Audit 1 7 7 1 30000",
               "2 broker-a g1 Orders 1 9 9 1700000000000 30000", "garbage"]
    batch = make_request(RequestCode.BATCH_ACK_MESSAGE, {"consumer_group": "g1"}, cbor2.dumps(handles))
    assert request_resources(batch) == [("group", "g1", SUB), ("topic", "Orders", SUB), ("topic", "Audit", SUB)]
    for body in (b"", cbor2.dumps({"consumer_group": "g2"}), b"\xff", cbor2.dumps(handles + [7])):
        bad = make_request(RequestCode.BATCH_ACK_MESSAGE, {"consumer_group": "g1"}, body)
        assert request_resources(bad) == [("group", "g1", SUB)]
    lock = make_request(RequestCode.LOCK_BATCH_MQ, body=cbor2.dumps({"consumer_group": "g1"}))
    assert request_resources(lock) == [("group", "g1", SUB)]
    end = make_request(RequestCode.END_TRANSACTION, {"producer_group": "pg", "commit_log_offset": 42})
    stored = {42: (TRANS_HALF_TOPIC, {PROPERTY_REAL_TOPIC: "Orders"}), 43: ("Orders", {})}
    assert request_resources(end, stored.get) == [("topic", "Orders", PUB)]
    assert request_resources(end) == [("topic", "", PUB)]  # no half there: judged as no topic at all
    not_half = make_request(RequestCode.END_TRANSACTION, {"producer_group": "pg", "commit_log_offset": 43})
    assert request_resources(not_half, stored.get) == [("topic", "", PUB)]
    # A field of the wrong type names nothing: the processor refuses the request for it.
    assert request_resources(send(7)) == []  # type: ignore[arg-type]


def test_a_pop_retry_topic_is_both_its_groups_and_its_topics():
    # RocketMQ 5's %RETRY%<group>+<topic>: '+' is in no group or topic name, so it splits there.
    both = [("group", "g1", SUB), ("topic", "Orders", SUB)]
    assert request_resources(send("%RETRY%g1+Orders")) == both
    assert request_resources(pull("%RETRY%g1+Orders", "g1")) == both + [("group", "g1", SUB)]
    assert request_resources(send("%RETRY%g1_Orders")) == [("group", "g1_Orders", SUB)]  # a push group's retry topic


# The records a fake store holds, by commit-log offset: (topic, properties).
STORED = {
    100: ("Audit", {}),
    200: ("%RETRY%g1", {PROPERTY_RETRY_TOPIC: "Orders2"}),  # a sent-back copy, delivered to the retry topic
    300: (TRANS_HALF_TOPIC, {PROPERTY_REAL_TOPIC: "Orders2"}),  # a transaction's half message, never committed
    400: (SCHEDULE_TOPIC, {PROPERTY_REAL_TOPIC: "%RETRY%g1", PROPERTY_RETRY_TOPIC: "Audit"}),  # a retry, waiting
    500: ("Orders2", {}),
}


def send_back(offset, group: str = "g1", **ext):
    return make_request(RequestCode.CONSUMER_SEND_MSG_BACK, {"group": group, "offset": offset, "delay_level": 0,
                                                             "max_reconsume_times": 16, **ext})


def test_send_back_and_view_by_id_are_judged_by_the_stored_message():
    def needs(request):
        return request_resources(request, STORED.get)

    g1 = ("group", "g1", SUB)
    # Without origin_topic, and with one that is not what is stored: the stored topic decides.
    assert needs(send_back(100)) == [g1, ("topic", "Audit", SUB)]
    assert needs(send_back(100, origin_topic="Orders2")) == [g1, ("topic", "Audit", SUB)]
    # A retry copy: its group's retry topic and the topic it was first consumed from.
    assert needs(send_back(200)) == [g1, ("topic", "Orders2", SUB)]
    assert needs(send_back(200, group="g2")) == [("group", "g2", SUB), g1, ("topic", "Orders2", SUB)]
    assert needs(send_back(300)) == [g1, ("topic", TRANS_HALF_TOPIC, SUB), ("topic", "Orders2", SUB)]
    assert needs(send_back(400)) == [g1, ("topic", SCHEDULE_TOPIC, SUB), ("topic", "Audit", SUB)]
    # Nothing stored there (or no usable offset): the marker no account is granted.
    for offset in (999, -1, "100", None):
        assert needs(send_back(offset)) == [g1, ("topic", "", SUB)]
    view = make_request(RequestCode.VIEW_MESSAGE_BY_ID, {"offset": 100})
    assert needs(view) == [("topic", "Audit", SUB)]
    by_id = make_request(RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": create_msg_id(("127.0.0.1", 10911), 200)})
    assert needs(by_id) == [g1, ("topic", "Orders2", SUB)]
    bad_id = make_request(RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": "not-an-id"})
    assert needs(bad_id) == [("topic", "", SUB)]


def test_a_send_back_reads_only_what_its_account_may_read(acl_file):
    checker = AclChecker(acl_file, broker_name="broker-a", clock=Clock(), stored_message=STORED.get)
    # producer1: SUB on every group and topic but Audit (DENY), Orders (PUB only) and the group blocked.
    assert checker.check(PRODUCER.sign(send_back(500)), FROM) is None
    assert checker.check(PRODUCER.sign(send_back(200)), FROM) is None
    refused = checker.check(PRODUCER.sign(send_back(100)), FROM)
    assert refused == ("ACL of broker broker-a refused CONSUMER_SEND_MSG_BACK (code 36) on consumer group 'g1', "
                       "topic 'Audit': account 'producer1' has no SUB permission on topic 'Audit' (topic_perms "
                       "entry Audit=DENY)")
    assert "no SUB permission on topic 'Audit'" in checker.check(PRODUCER.sign(send_back(400)), FROM)
    assert "no SUB permission on topic 'Audit'" in checker.check(PRODUCER.sign(
        make_request(RequestCode.VIEW_MESSAGE_BY_ID, {"offset": 100})), FROM)
    nothing = checker.check(PRODUCER.sign(send_back(999)), FROM)
    assert nothing.endswith("on consumer group 'g1', the topic of an unknown message: no message is stored at the "
                            "offset it names here, so no topic permission can be checked")
    # An admin without lists may read anything, and is let through to the processor's own answer.
    assert checker.check(ADMIN.sign(send_back(999)), "192.168.1.7:5000") is None


def test_a_batch_ack_needs_sub_on_every_topic_its_handles_name(checker):
    def batch(*topics: str):
        handles = [f"2 broker-a g1 {topic} 0 5 5 1700000000000 30000" for topic in topics]
        return make_request(RequestCode.BATCH_ACK_MESSAGE, {"consumer_group": "g1"}, cbor2.dumps(handles))

    assert checker.check(PRODUCER.sign(batch("Orders2", "%RETRY%g1+Orders2")), FROM) is None
    refused = checker.check(PRODUCER.sign(batch("Orders2", "%RETRY%g1+Audit")), FROM)
    assert "BATCH_ACK_MESSAGE (code 200151)" in refused and "no SUB permission on topic 'Audit'" in refused


def test_an_oversized_batch_ack_is_judged_without_reading_its_handles(checker, monkeypatch):
    decoded = []
    real_decode = ReceiptHandle.decode
    monkeypatch.setattr("broker.acl.ReceiptHandle.decode", lambda text: decoded.append(text) or real_decode(text))

    def batch(handles, *, signer=PRODUCER):
        request = make_request(RequestCode.BATCH_ACK_MESSAGE, {"consumer_group": "blocked"}, cbor2.dumps(handles))
        return signer.sign(request) if signer else request

    many = [f"2 broker-a g1 T{i} 0 5 5 1700000000000 30000" for i in range(5_000)]
    # Past MAX_BATCH_ACK (the processor refuses it whole): only the group is judged, no handle is read.
    assert request_resources(batch(many, signer=None)) == [("group", "blocked", SUB)]
    refused = checker.check(batch(many), FROM)
    assert refused == ("ACL of broker broker-a refused BATCH_ACK_MESSAGE (code 200151) on consumer group 'blocked': "
                       "account 'producer1' has no SUB permission on consumer group 'blocked' (group_perms entry "
                       "blocked=DENY)")
    # Unsigned, or signed with a wrong secret: refused before anything but the ext is looked at.
    assert checker.check(batch(many[:MAX_BATCH_ACK], signer=None), FROM).endswith("it carries no AccessKey (this "
                                                                                "broker has acl_enable on: give the "
                                                                                "client access_key and secret_key)")
    wrong = checker.check(batch(many[:MAX_BATCH_ACK], signer=RequestSigner("producer1", "not-the-secret")), FROM)
    assert "on consumer group 'blocked': its Signature does not match" in wrong
    # A body with one entry nesting a million items is not decoded either (it is no list of strings).
    nested = make_request(RequestCode.BATCH_ACK_MESSAGE, {"consumer_group": "g1"}, cbor2.dumps([[0] * 1_000_000]))
    assert request_resources(nested) == [("group", "g1", SUB)]
    assert decoded == []

    # A full batch is read, and its refusal names its first resources and how many more.
    fine = [f"2 broker-a g1 T{i} 0 5 5 1700000000000 30000" for i in range(MAX_BATCH_ACK - 1)]
    full = make_request(RequestCode.BATCH_ACK_MESSAGE, {"consumer_group": "g1"},
                        cbor2.dumps(fine + ["2 broker-a g1 Audit 0 5 5 1700000000000 30000"]))
    refused = checker.check(PRODUCER.sign(full), FROM)
    assert len(decoded) == MAX_BATCH_ACK
    assert refused == ("ACL of broker broker-a refused BATCH_ACK_MESSAGE (code 200151) on consumer group 'g1', topic "
                       "'T0', topic 'T1', topic 'T2', topic 'T3' and 1020 more: account 'producer1' has no SUB "
                       "permission on topic 'Audit' (topic_perms entry Audit=DENY)")


def test_a_refusal_before_the_signature_holds_reads_no_stored_message(acl_file):
    looked = []
    checker = AclChecker(acl_file, broker_name="broker-a", clock=Clock(),
                         stored_message=lambda offset: looked.append(offset) or STORED.get(offset))
    view = make_request(RequestCode.VIEW_MESSAGE_BY_ID, {"offset": 100})
    assert checker.check(view, FROM) == ("ACL of broker broker-a refused VIEW_MESSAGE_BY_ID (code 33): it carries no "
                                         "AccessKey (this broker has acl_enable on: give the client access_key and "
                                         "secret_key)")
    assert "on consumer group 'g1': no account has AccessKey" in checker.check(
        RequestSigner("nobody-here", "whatever1").sign(send_back(100)), FROM)
    assert looked == []  # the topic stored at offset 100 (Audit) was neither read nor told
    assert "no SUB permission on topic 'Audit'" in checker.check(PRODUCER.sign(view), FROM)
    assert looked == [100]


@pytest.mark.parametrize("code", [RequestCode.CLONE_GROUP_OFFSET, RequestCode.GET_CONSUMER_RUNNING_INFO,
                                  RequestCode.GET_PRODUCER_CONNECTION_LIST, RequestCode.GET_BROKER_CONFIG])
def test_operator_requests_need_an_admin(checker, code):
    request = make_request(code, {"src_group": "g1", "dest_group": "g2", "topic": "Orders2", "consumer_group": "g1",
                                  "client_id": "c1", "producer_group": "pg"})
    assert checker.check(PRODUCER.sign(request), FROM).endswith(
        "account 'producer1' is not an admin account (admin = true is needed)")
    assert checker.check(ADMIN.sign(request), "192.168.1.7:5000") is None


# What a broker serves that needs a valid signature only (reviewed: offsets, counts, names and tables, never a
# message's body or another client's insides; clients ask some of them for every account).
SIGNATURE_ONLY = {
    RequestCode.GET_ALL_TOPIC_CONFIG, RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG, RequestCode.GET_TOPIC_STATS_INFO,
    RequestCode.GET_MAX_OFFSET, RequestCode.GET_MIN_OFFSET, RequestCode.SEARCH_OFFSET_BY_TIMESTAMP,
    RequestCode.GET_EARLIEST_MSG_STORETIME, RequestCode.GET_BROKER_RUNTIME_INFO, RequestCode.GET_ALL_DELAY_OFFSET,
}
# Codes a broker node does not serve (a name server's, or a broker's requests to clients): answered
# REQUEST_CODE_NOT_SUPPORTED before the ACL is asked.
NOT_SERVED_BY_BROKERS = {
    RequestCode.QUERY_BROKER_OFFSET, RequestCode.CHECK_TRANSACTION_STATE, RequestCode.NOTIFY_CONSUMER_IDS_CHANGED,
    RequestCode.GET_ALL_CONSUMER_OFFSET, RequestCode.PUT_KV_CONFIG, RequestCode.GET_KV_CONFIG,
    RequestCode.DELETE_KV_CONFIG, RequestCode.REGISTER_BROKER, RequestCode.UNREGISTER_BROKER,
    RequestCode.GET_ROUTEINFO_BY_TOPIC, RequestCode.GET_BROKER_CLUSTER_INFO, RequestCode.WIPE_WRITE_PERM_OF_BROKER,
    RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER, RequestCode.DELETE_TOPIC_IN_NAMESRV,
    RequestCode.RESET_CONSUMER_CLIENT_OFFSET, RequestCode.GET_TOPICS_BY_CLUSTER, RequestCode.QUERY_TOPIC_CONSUME_BY_WHO,
    RequestCode.CONSUME_MESSAGE_DIRECTLY, RequestCode.QUERY_DATA_VERSION, RequestCode.PUSH_REPLY_MESSAGE_TO_CLIENT,
    RequestCode.ECHO,
}


def test_every_request_code_is_judged_or_reviewed():
    """A new code must be decided: admin, a resource it names, or reviewed as needing a signature only."""
    everything = {"topic": "Orders2", "consumer_group": "g1", "group": "g1", "offset": 500, "commit_log_offset": 300,
                  "msg_id": create_msg_id(("127.0.0.1", 10911), 500)}
    undecided = []
    for code in RequestCode:
        if code in ADMIN_CODES or code in SIGNATURE_ONLY or code in NOT_SERVED_BY_BROKERS \
                or code in DLedgerService.CODES:
            continue
        request = make_request(code, everything, cbor2.dumps({**everything, "consumers": [everything]}))
        if not request_resources(request, STORED.get):
            undecided.append(code.name)
    assert undecided == []


# --- the checker --------------------------------------------------------------------------------------------------

def test_a_signed_send_with_pub_passes_and_the_refusals_say_why(checker):
    assert checker.check(PRODUCER.sign(send("Orders")), FROM) is None
    assert checker.check(PRODUCER.sign(send("Both")), FROM) is None

    unsigned = checker.check(send("Orders"), FROM)
    assert unsigned == ("ACL of broker broker-a refused SEND_MESSAGE_V2 (code 310) on topic 'Orders': it carries no "
                        "AccessKey (this broker has acl_enable on: give the client access_key and secret_key)")
    unknown = checker.check(RequestSigner("nobody-here", "whatever1").sign(send("Orders")), FROM)
    assert "on topic 'Orders': no account has AccessKey 'nobody-here'" in unknown
    wrong = checker.check(RequestSigner("producer1", "not-the-secret").sign(send("Orders")), FROM)
    assert "on topic 'Orders': its Signature does not match account 'producer1'" in wrong
    assert "producer-secret" not in wrong and "not-the-secret" not in wrong
    denied = checker.check(PRODUCER.sign(send("Audit")), FROM)
    assert denied.endswith("on topic 'Audit': account 'producer1' has no PUB permission on topic 'Audit' "
                           "(topic_perms entry Audit=DENY)")
    by_default = checker.check(PRODUCER.sign(send("Elsewhere")), FROM)
    assert by_default.endswith("has no PUB permission on topic 'Elsewhere' (default_topic_perm SUB)")


def test_a_request_changed_after_signing_is_refused(checker):
    signed = PRODUCER.sign(send("Orders"))
    for changed in (make_request(signed.code, {**signed.ext, "queue_id": 3}, signed.body),
                    make_request(signed.code, signed.ext, b"other body"),
                    make_request(RequestCode.SEND_MESSAGE, signed.ext, signed.body)):
        assert "Signature does not match" in checker.check(changed, FROM)


def test_groups_retry_topics_and_pulls(checker):
    assert checker.check(PRODUCER.sign(pull("Orders2", "g1")), FROM) is None  # default SUB, both
    refused = checker.check(PRODUCER.sign(pull("Orders2", "blocked")), FROM)
    assert refused.endswith("has no SUB permission on consumer group 'blocked' (group_perms entry blocked=DENY)")
    assert "has no SUB permission on consumer group 'blocked'" in checker.check(
        PRODUCER.sign(send("%RETRY%blocked")), FROM)
    assert "no SUB permission on topic 'Orders'" in checker.check(PRODUCER.sign(pull("Orders", "g1")), FROM)


def test_admin_requests_need_an_admin_and_an_admin_without_lists_may_do_anything(checker):
    create = make_request(RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic": "NewTopic"})
    refused = checker.check(PRODUCER.sign(create), FROM)
    assert refused == ("ACL of broker broker-a refused UPDATE_AND_CREATE_TOPIC (code 17) on topic 'NewTopic': "
                       "account 'producer1' is not an admin account (admin = true is needed)")
    # rocketmq2 is usable from 192.168.1.* only.
    assert checker.check(ADMIN.sign(create), "192.168.1.7:5000") is None
    assert checker.check(ADMIN.sign(send("Audit")), "192.168.1.7:5000") is None
    away = checker.check(ADMIN.sign(create), FROM)
    assert away.endswith("account 'rocketmq2' may not be used from 127.0.0.1 (white_remote_address '192.168.1.*')")
    # An admin with lists is held to them.
    assert checker.check(LISTED_ADMIN.sign(create), FROM) is None
    assert "no PUB permission on topic 'Orders' (topic_perms entry Orders=DENY)" in checker.check(
        LISTED_ADMIN.sign(send("Orders")), FROM)


def test_the_global_white_list_needs_nothing_else(checker):
    assert checker.check(send("Audit"), "10.10.103.9:1234") is None
    assert checker.check(make_request(RequestCode.UPDATE_BROKER_CONFIG, {}), "10.10.103.9:1234") is None
    assert checker.check(send("Audit"), "10.10.104.9:1234") is not None


def test_requests_with_no_resource_need_only_a_valid_signature(checker):
    info = make_request(RequestCode.GET_BROKER_RUNTIME_INFO)
    assert checker.check(PRODUCER.sign(info), FROM) is None
    assert "carries no AccessKey" in checker.check(info, FROM)


def test_an_edited_file_is_read_again_and_a_bad_one_keeps_the_last_good(checker, acl_file, caplog):
    clock = checker._clock
    assert checker.check(PRODUCER.sign(send("Audit")), FROM) is not None
    acl_file.write_text(ACL.replace('"Audit=DENY"', '"Audit=PUB"'))
    # Looked at no more than twice a second: not yet; then read once, and applied when the next look reads the same.
    assert checker.check(PRODUCER.sign(send("Audit")), FROM) is not None
    clock.now += 0.5
    assert checker.check(PRODUCER.sign(send("Audit")), FROM) is not None
    clock.now += 0.5
    assert checker.check(PRODUCER.sign(send("Audit")), FROM) is None

    caplog.set_level(logging.WARNING, logger="broker.acl")
    acl_file.write_text(ACL.replace('"Audit=DENY"', '"Audit=EVERYTHING"'))
    for _ in range(2):
        clock.now += 0.5
        assert checker.check(PRODUCER.sign(send("Audit")), FROM) is None  # the last good rules
    [warning] = [r for r in caplog.records if "does not load" in r.getMessage()]
    assert "Audit=EVERYTHING" in warning.getMessage()
    clock.now += 0.5
    checker.check(PRODUCER.sign(send("Audit")), FROM)
    assert len([r for r in caplog.records if "does not load" in r.getMessage()]) == 1  # once per bad version

    acl_file.unlink()
    clock.now += 0.5
    assert checker.check(PRODUCER.sign(send("Audit")), FROM) is None
    acl_file.write_text(ACL)
    for _ in range(2):
        clock.now += 0.5
        checker.check(PRODUCER.sign(send("Audit")), FROM)
    assert checker.check(PRODUCER.sign(send("Audit")), FROM) is not None


def test_a_file_caught_half_written_is_never_applied(tmp_path):
    """An editor truncates the file and writes it anew: a look in between may read a valid prefix, here an admin
    account without its white_remote_address. Only what two looks apart read alike (bytes and mtime) is applied."""
    whole = ACL + '\n[[accounts]]\naccess_key = "late-admin"\nsecret_key = "late-secret"\nadmin = true\n' \
                  'white_remote_address = "192.168.1.*"\n'
    half = whole[:whole.rindex("white_remote_address")]
    assert "late-admin" in parse_acl_rules(tomllib.loads(half)).accounts  # a valid file on its own
    path = tmp_path / "plain_acl.toml"
    path.write_text(whole)
    clock = Clock()
    checker = AclChecker(path, broker_name="broker-a", clock=clock)
    create = make_request(RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic": "NewTopic"})

    def from_here(secret: str) -> str | None:
        clock.now += 0.5
        return checker.check(RequestSigner("late-admin", secret).sign(create), FROM)

    def write(text: str, mtime_s: int) -> None:
        path.write_text(text)
        os.utime(path, (mtime_s, mtime_s))  # the file system's clock may not tick between two quick writes

    assert "may not be used from 127.0.0.1" in from_here("late-secret")
    write(half, 1000)
    assert "may not be used from 127.0.0.1" in from_here("late-secret")  # read once: not applied
    write(whole.replace("late-secret", "late-secret2"), 1001)  # the editor is done
    assert "may not be used from 127.0.0.1" in from_here("late-secret")
    assert "may not be used from 127.0.0.1" in from_here("late-secret2")  # read alike twice: applied
    # The next edit caught half-written at two looks, but rewritten in between: its mtime tells.
    write(half, 1002)
    from_here("late-secret2")
    write(whole, 1003)
    write(half, 1004)
    assert "may not be used from 127.0.0.1" in from_here("late-secret2")
    # Changed and changed back before it settled: nothing to apply.
    write(whole.replace("late-secret", "late-secret2"), 1001)
    assert "may not be used from 127.0.0.1" in from_here("late-secret2")
    assert "may not be used from 127.0.0.1" in from_here("late-secret2")


def test_refusals_are_logged_rate_limited_and_oneway_ones_as_warnings(checker, caplog):
    caplog.set_level(logging.INFO, logger="broker.acl")
    clock = checker._clock

    def lines():
        return [r for r in caplog.records if "refused by ACL" in r.getMessage()]

    for _ in range(5):
        checker.check(PRODUCER.sign(send("Audit")), FROM)
    [first] = lines()
    assert first.levelno == logging.INFO
    assert "code=310 oneway=False remote=127.0.0.1:40000 not_logged_since_last=0: ACL of broker broker-a refused " \
           "SEND_MESSAGE_V2" in first.getMessage()
    assert "producer-secret" not in first.getMessage()
    # Another code of the same account, and another account, have their own allowance.
    end = make_request(RequestCode.END_TRANSACTION, {"producer_group": "pg", "commit_log_offset": 7}, oneway=True)
    checker.check(PRODUCER.sign(end), FROM)
    checker.check(PRODUCER.sign(end), FROM)
    checker.check(RequestSigner("nobody-here", "whatever1").sign(send("Audit")), FROM)
    checker.check(RequestSigner("nobody-else", "whatever2").sign(send("Audit")), FROM)  # unknown keys: one bucket
    assert [(r.levelname, "oneway=True" in r.getMessage()) for r in lines()] == [
        ("INFO", False), ("WARNING", True), ("INFO", False)]
    assert "no half message is stored at its commit_log_offset" in lines()[1].getMessage()
    clock.now += REFUSAL_LOG_INTERVAL_S
    checker.check(PRODUCER.sign(send("Audit")), FROM)
    assert "not_logged_since_last=4:" in lines()[-1].getMessage()


def test_a_bad_file_at_start_is_refused(tmp_path):
    path = tmp_path / "acl.toml"
    path.write_text('accounts = [{access_key = "producer1"}]')
    with pytest.raises(ConfigError, match=r"accounts\[0\] \(access_key 'producer1'\): secret_key is required"):
        AclChecker(path, broker_name="broker-a")
