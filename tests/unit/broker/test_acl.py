"""The broker's ACL (broker/acl.py): the file's validation, address patterns, the permission matrix, the
checker's order of judgement and its reload of a changed file. Requests are signed as a client signs them
(remoting/acl.py); nothing is served."""

from __future__ import annotations

import ipaddress
import logging
import textwrap

import cbor2
import pytest

from broker.acl import (DENY, PUB, SUB, AclChecker, AddressPattern, acl_file_path, load_acl_file, parse_acl_rules,
                        parse_perm, permits, request_resources)
from remoting.acl import RequestSigner
from remoting.codec import make_request
from remoting.codes import RequestCode
from remoting.config import ConfigError

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
    if hasattr(RequestCode, "POP_MESSAGE"):
        pop = make_request(RequestCode.POP_MESSAGE, {"consumer_group": "g1", "topic": "Orders"})
        assert request_resources(pop) == [("group", "g1", SUB), ("topic", "Orders", SUB)]
    lock = make_request(RequestCode.LOCK_BATCH_MQ, body=cbor2.dumps({"consumer_group": "g1"}))
    assert request_resources(lock) == [("group", "g1", SUB)]
    end = make_request(RequestCode.END_TRANSACTION, {"producer_group": "pg", "commit_log_offset": 42})
    assert request_resources(end, {42: "Orders"}.get) == [("topic", "Orders", PUB)]
    assert request_resources(end) == [("topic", "", PUB)]  # no half there: judged as no topic at all
    # A field of the wrong type names nothing: the processor refuses the request for it.
    assert request_resources(send(7)) == []  # type: ignore[arg-type]


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
    # Looked at no more than twice a second: not yet.
    assert checker.check(PRODUCER.sign(send("Audit")), FROM) is not None
    clock.now += 0.5
    assert checker.check(PRODUCER.sign(send("Audit")), FROM) is None

    caplog.set_level(logging.WARNING, logger="broker.acl")
    acl_file.write_text(ACL.replace('"Audit=DENY"', '"Audit=EVERYTHING"'))
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
    clock.now += 0.5
    assert checker.check(PRODUCER.sign(send("Audit")), FROM) is not None


def test_a_bad_file_at_start_is_refused(tmp_path):
    path = tmp_path / "acl.toml"
    path.write_text('accounts = [{access_key = "producer1"}]')
    with pytest.raises(ConfigError, match=r"accounts\[0\] \(access_key 'producer1'\): secret_key is required"):
        AclChecker(path, broker_name="broker-a")
