"""The error hierarchy: flags, the for_code registry, messages that read as sentences, and the code tables."""

from __future__ import annotations

import pickle

import pytest

from remoting import errors
from remoting.codes import NON_ERROR_CODES, RequestCode, ResponseCode
from remoting.errors import (
    BrokerError,
    ConnectError,
    ConnectionClosedError,
    FrameTooLargeError,
    NotLeaderError,
    ProtocolError,
    RaftMQError,
    RemotingError,
    RequestTimeoutError,
    for_code,
)


def test_every_error_response_code_has_its_own_class():
    for code in ResponseCode:
        if code == ResponseCode.SUCCESS:
            continue
        error = for_code(code, "why")
        assert type(error) is not BrokerError, f"{code.name} has no registered class"
        assert error.code == code and isinstance(error, BrokerError)
    assert errors.registered_codes() == {c for c in ResponseCode if c != ResponseCode.SUCCESS}


def test_non_error_codes_are_a_subset_of_the_response_codes():
    assert ResponseCode.SUCCESS in NON_ERROR_CODES
    assert all(isinstance(code, ResponseCode) for code in NON_ERROR_CODES)
    assert ResponseCode.NOT_LEADER not in NON_ERROR_CODES


def test_success_is_not_an_error():
    with pytest.raises(ValueError, match="SUCCESS"):
        for_code(ResponseCode.SUCCESS)


@pytest.mark.parametrize("code,cls_name,retriable,refresh_route", [
    (ResponseCode.NOT_LEADER, "NotLeaderError", True, True),
    (ResponseCode.SYSTEM_BUSY, "SystemBusyError", True, False),
    (ResponseCode.SYSTEM_ERROR, "BrokerSystemError", True, False),
    (ResponseCode.TOPIC_NOT_EXIST, "TopicNotExistError", False, True),
    (ResponseCode.MESSAGE_ILLEGAL, "MessageIllegalError", False, False),
    (ResponseCode.SERVICE_NOT_AVAILABLE, "ServiceNotAvailableError", True, True),
    (ResponseCode.INVALID_REQUEST, "InvalidRequestError", False, False),
    (ResponseCode.REQUEST_CODE_NOT_SUPPORTED, "RequestCodeNotSupportedError", False, False),
])
def test_flags(code, cls_name, retriable, refresh_route):
    error = for_code(code, "x")
    assert type(error).__name__ == cls_name
    assert (error.retriable, error.refresh_route) == (retriable, refresh_route)
    assert type(error) is getattr(errors, cls_name)


def test_fields_travel_with_the_error():
    error = for_code(ResponseCode.NOT_LEADER, "node n1 is a follower", leader_addr="127.0.0.1:10911")
    assert isinstance(error, NotLeaderError)
    assert error.leader_addr == "127.0.0.1:10911"
    assert error.fields == {"leader_addr": "127.0.0.1:10911"}
    assert str(error) == ("this node is not the leader of its Raft group (NOT_LEADER): node n1 is a follower; "
                          "the leader is 127.0.0.1:10911")
    assert "not known yet" in str(for_code(ResponseCode.NOT_LEADER, "no leader"))
    missing = for_code(ResponseCode.TOPIC_NOT_EXIST, "topic 'orders' does not exist", topic="orders")
    assert missing.topic == "orders" and missing.remark == "topic 'orders' does not exist"
    assert str(missing) == "the topic does not exist (TOPIC_NOT_EXIST): topic 'orders' does not exist"
    assert for_code(ResponseCode.TOPIC_NOT_EXIST).topic is None
    odd = for_code(ResponseCode.MESSAGE_ILLEGAL, "body too large", max_size=4096, size=5000)
    assert (odd.max_size, odd.size) == (4096, 5000)


def test_unknown_code_still_gives_a_broker_error():
    error = for_code(4242, "from a newer server", detail=1)
    assert type(error) is BrokerError and error.code == 4242 and error.detail == 1
    assert str(error) == "the server reported an error (code 4242): from a newer server"
    assert not error.retriable


def test_handlers_can_raise_errors_directly():
    error = errors.TopicNotExistError("topic t does not exist", topic="t")
    assert error.code == ResponseCode.TOPIC_NOT_EXIST and error.topic == "t"


def test_broker_errors_pickle():
    error = for_code(ResponseCode.NOT_LEADER, "moved", leader_addr="h:1")
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is NotLeaderError and clone.leader_addr == "h:1" and str(clone) == str(error)


def test_transport_errors():
    assert issubclass(FrameTooLargeError, ProtocolError)
    for cls in (ConnectError, ConnectionClosedError, RequestTimeoutError, ProtocolError):
        assert issubclass(cls, RemotingError) and issubclass(cls, RaftMQError)
    assert issubclass(BrokerError, RaftMQError) and not issubclass(BrokerError, RemotingError)
    closed = ConnectionClosedError("127.0.0.1:9876", "closed by peer")
    assert (closed.retriable, closed.refresh_route) == (True, True)
    assert str(closed) == "the connection to 127.0.0.1:9876 closed before the response arrived: closed by peer"
    timeout = RequestTimeoutError("127.0.0.1:9876", 0.5, 105)
    assert (timeout.retriable, timeout.refresh_route) == (True, False)
    assert str(timeout) == "127.0.0.1:9876 did not answer request code 105 within 0.5 s"
    connect = ConnectError("127.0.0.1:1", "Connection refused")
    assert (connect.retriable, connect.refresh_route) == (True, True)
    assert str(connect) == "could not connect to 127.0.0.1:1: Connection refused"
    too_large = FrameTooLargeError(20_000_000, 16_777_216)
    assert not too_large.retriable
    assert str(too_large) == "frame of 20000000 bytes exceeds the maximum frame size of 16777216 bytes"


# RocketMQ's numbers (RequestCode.java / ResponseCode.java) for the codes raftmq uses; ours start at 1000.
@pytest.mark.parametrize("member,number", [
    (RequestCode.SEND_MESSAGE, 10), (RequestCode.PULL_MESSAGE, 11), (RequestCode.QUERY_MESSAGE, 12),
    (RequestCode.QUERY_BROKER_OFFSET, 13), (RequestCode.QUERY_CONSUMER_OFFSET, 14),
    (RequestCode.UPDATE_CONSUMER_OFFSET, 15), (RequestCode.UPDATE_AND_CREATE_TOPIC, 17),
    (RequestCode.GET_ALL_TOPIC_CONFIG, 21), (RequestCode.GET_BROKER_RUNTIME_INFO, 28),
    (RequestCode.SEARCH_OFFSET_BY_TIMESTAMP, 29), (RequestCode.GET_MAX_OFFSET, 30),
    (RequestCode.GET_MIN_OFFSET, 31), (RequestCode.GET_EARLIEST_MSG_STORETIME, 32),
    (RequestCode.VIEW_MESSAGE_BY_ID, 33), (RequestCode.HEART_BEAT, 34), (RequestCode.UNREGISTER_CLIENT, 35),
    (RequestCode.CONSUMER_SEND_MSG_BACK, 36), (RequestCode.END_TRANSACTION, 37),
    (RequestCode.GET_CONSUMER_LIST_BY_GROUP, 38), (RequestCode.CHECK_TRANSACTION_STATE, 39),
    (RequestCode.NOTIFY_CONSUMER_IDS_CHANGED, 40), (RequestCode.LOCK_BATCH_MQ, 41),
    (RequestCode.UNLOCK_BATCH_MQ, 42), (RequestCode.REGISTER_BROKER, 103), (RequestCode.UNREGISTER_BROKER, 104),
    (RequestCode.GET_ROUTEINFO_BY_TOPIC, 105), (RequestCode.GET_BROKER_CLUSTER_INFO, 106),
    (RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER, 206), (RequestCode.DELETE_TOPIC_IN_BROKER, 215),
    (RequestCode.SEND_MESSAGE_V2, 310), (RequestCode.SEND_BATCH_MESSAGE, 320),
    (RequestCode.ECHO, 1000), (RequestCode.FETCH_COMMIT_LOG, 1001), (RequestCode.GET_RAFT_STATUS, 1002),
    (ResponseCode.SUCCESS, 0), (ResponseCode.SYSTEM_ERROR, 1), (ResponseCode.SYSTEM_BUSY, 2),
    (ResponseCode.REQUEST_CODE_NOT_SUPPORTED, 3), (ResponseCode.TRANSACTION_FAILED, 4),
    (ResponseCode.FLUSH_DISK_TIMEOUT, 10), (ResponseCode.SLAVE_NOT_AVAILABLE, 11),
    (ResponseCode.FLUSH_SLAVE_TIMEOUT, 12), (ResponseCode.MESSAGE_ILLEGAL, 13),
    (ResponseCode.SERVICE_NOT_AVAILABLE, 14), (ResponseCode.VERSION_NOT_SUPPORTED, 15),
    (ResponseCode.NO_PERMISSION, 16), (ResponseCode.TOPIC_NOT_EXIST, 17), (ResponseCode.TOPIC_EXIST_ALREADY, 18),
    (ResponseCode.PULL_NOT_FOUND, 19), (ResponseCode.PULL_RETRY_IMMEDIATELY, 20),
    (ResponseCode.PULL_OFFSET_MOVED, 21), (ResponseCode.QUERY_NOT_FOUND, 22),
    (ResponseCode.SUBSCRIPTION_PARSE_FAILED, 23), (ResponseCode.SUBSCRIPTION_NOT_EXIST, 24),
    (ResponseCode.SUBSCRIPTION_NOT_LATEST, 25), (ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST, 26),
    (ResponseCode.NOT_LEADER, 1000), (ResponseCode.INVALID_REQUEST, 1001),
])
def test_code_numbers(member, number):
    assert int(member) == number


def test_codes_are_unique():
    # Iterating an enum skips aliases, so counting its members could never see two names for one number.
    for enum in (RequestCode, ResponseCode):
        assert [name for name, member in enum.__members__.items() if member.name != name] == []


def test_ext_keys_cannot_shadow_the_error_itself():
    error = for_code(ResponseCode.SYSTEM_BUSY, "busy", remark="other", fields=1, retriable=False, topic="t",
                     code=7)
    assert error.remark == "busy" and error.retriable and error.topic == "t"
    assert error.code == ResponseCode.SYSTEM_BUSY
    assert error.fields == {"remark": "other", "fields": 1, "retriable": False, "topic": "t", "code": 7}
    clone = pickle.loads(pickle.dumps(error))
    assert clone.fields == error.fields and clone.code == error.code
