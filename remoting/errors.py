"""raftmq's error hierarchy, rooted at ``RaftMQError``.

Two flags tell a client what to do, after nats.py and aiokafka: ``retriable`` (the same request may succeed
if sent again, possibly to another broker group) and ``refresh_route`` (the cached topic route is probably
stale: fetch it again before retrying). They are class attributes so a caller tests ``err.retriable``
without knowing the class.

``RemotingError`` covers the transport (connections, timeouts, bad frames). ``BrokerError`` is a response
code other than success coming back from a server: ``for_code(code, remark, **fields)`` picks the subclass
registered for the code, so a client turns any error response into a precise exception, and a server handler
may ``raise`` one (the transport answers it with its code, remark and fields as ``ext``).
"""

from __future__ import annotations

import errno
from typing import Any, ClassVar

from remoting.codes import ResponseCode

__all__ = [
    "BrokerError", "BrokerSystemError", "ConnectError", "ConnectionClosedError", "ConsumeMsgTimeoutError",
    "ConsumerNotOnlineError", "FatalServerError", "FilterDataNotExistError", "FilterDataNotLatestError",
    "FlushDiskTimeoutError", "FlushSlaveTimeoutError",
    "FrameTooLargeError", "InvalidRequestError", "MessageIllegalError", "NoBuyerIdError", "NoMessageError",
    "NoPermissionError", "NotInCurrentUnitError", "NotLeaderError", "ProtocolError", "PullNotFoundError",
    "PullOffsetMovedError", "PullRetryImmediatelyError", "QueryNotFoundError", "RESOURCE_ERRNOS", "RaftMQError",
    "RemotingError",
    "RequestCodeNotSupportedError", "RequestTimeoutError", "ServiceNotAvailableError", "SlaveNotAvailableError",
    "SubscriptionGroupNotExistError", "SubscriptionNotExistError", "SubscriptionNotLatestError",
    "SubscriptionParseFailedError", "SystemBusyError", "TopicExistAlreadyError",
    "TopicNotExistError", "TransactionFailedError", "TransactionShouldCommitError",
    "TransactionShouldRollbackError", "TransactionStateGroupWrongError", "TransactionStateUnknownError",
    "VersionNotSupportedError", "for_code", "registered_codes",
]


class RaftMQError(Exception):
    """Root of every raftmq error."""

    retriable: ClassVar[bool] = False
    refresh_route: ClassVar[bool] = False


class FatalServerError(RaftMQError):
    """The server cannot go on without risking stored data: it stops, and ``raftmq`` logs the message as one
    CRITICAL line (no traceback) and exits with status 3. The message says what the operator must do."""


# OSError numbers of a server out of descriptors or memory for a moment (a burst of client connections): the
# store's dispatch, an apply and the Raft transport wait these out, unlike a full disk or an I/O error, which
# stop the node (FatalServerError).
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


# ---------------------------------------------------------------------------------------------- transport


class RemotingError(RaftMQError):
    """The transport failed: a connection, a timeout or a frame."""


class ConnectError(RemotingError):
    retriable = True
    refresh_route = True

    def __init__(self, addr: str, reason: str) -> None:
        self.addr = addr
        self.reason = reason
        super().__init__(f"could not connect to {addr}: {reason}")


class ConnectionClosedError(RemotingError):
    retriable = True
    refresh_route = True

    def __init__(self, addr: str, reason: str, *, bad_frame: bool = False) -> None:
        self.addr = addr
        self.reason = reason
        # The connection was closed because the peer sent bytes that are no raftmq frame: it speaks another
        # protocol (or is broken), so asking it again will not help. Callers test this, not the reason's text.
        self.bad_frame = bad_frame
        super().__init__(f"the connection to {addr} closed before the response arrived: {reason}")


class RequestTimeoutError(RemotingError):
    retriable = True

    def __init__(self, addr: str, timeout_s: float, code: int | None = None) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self.code = code
        what = f"request code {code}" if code is not None else "the request"
        super().__init__(f"{addr} did not answer {what} within {timeout_s:g} s")


class ProtocolError(RemotingError):
    """Bytes on the wire that are not a valid frame; the connection they came on cannot be trusted any more."""


class FrameTooLargeError(ProtocolError):
    def __init__(self, size: int, max_size: int) -> None:
        self.size = size
        self.max_size = max_size
        super().__init__(f"frame of {size} bytes exceeds the maximum frame size of {max_size} bytes")


# ---------------------------------------------------------------------------------------------- responses


class BrokerError(RaftMQError):
    """A server answered with an error ``code``; ``remark`` is its explanation and ``fields`` the ext values
    that go with it (e.g. ``topic``, ``leader_addr``), also readable as attributes."""

    code: int = ResponseCode.SYSTEM_ERROR
    description: ClassVar[str] = "the server reported an error"
    field_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, remark: str | None = None, /, *, code: int | None = None, **fields: Any) -> None:
        if code is not None:
            self.code = int(code)
        self.remark = remark
        self.fields = fields
        for name in self.field_names:
            setattr(self, name, fields.get(name))
        for name, value in fields.items():
            if not hasattr(self, name):  # an ext key never shadows remark, fields, code or a method
                setattr(self, name, value)
        super().__init__(self._message())

    def _message(self) -> str:
        try:
            name = ResponseCode(self.code).name
        except ValueError:
            name = f"code {self.code}"
        text = f"{self.description} ({name})"
        if self.remark:
            text += f": {self.remark}"
        return text

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self.remark, self.code, self.fields))


def _rebuild(cls: type[BrokerError], remark: str | None, code: int, fields: dict[str, Any]) -> BrokerError:
    fields = dict(fields)
    ext_code = fields.pop("code", _MISSING)
    error = cls(remark, code=code, **fields)
    if ext_code is not _MISSING:
        error.fields["code"] = ext_code
    return error


_REGISTRY: dict[int, type[BrokerError]] = {}
_MISSING = object()


def _register(code: ResponseCode, description: str, *, retriable: bool = False, refresh_route: bool = False,
              fields: tuple[str, ...] = ()):
    def decorate(cls: type[BrokerError]) -> type[BrokerError]:
        cls.code = code
        cls.description = description
        cls.retriable = retriable
        cls.refresh_route = refresh_route
        cls.field_names = fields
        _REGISTRY[code] = cls
        return cls
    return decorate


def for_code(code: int, remark: str | None = None, /, **fields: Any) -> BrokerError:
    """The exception for response ``code`` (a ``BrokerError`` subclass, or ``BrokerError`` itself for a code
    this version does not know). ``SUCCESS`` is not an error and raises ``ValueError``."""
    if code == ResponseCode.SUCCESS:
        raise ValueError("response code SUCCESS (0) is not an error")
    # An ext key named "code" is kept in fields, never taken for the response code.
    ext_code = fields.pop("code", _MISSING)
    cls = _REGISTRY.get(code)
    error = BrokerError(remark, code=code, **fields) if cls is None else cls(remark, **fields)
    if ext_code is not _MISSING:
        error.fields["code"] = ext_code
    return error


def registered_codes() -> frozenset[int]:
    return frozenset(_REGISTRY)


# Not "SystemError": that is a Python builtin.
@_register(ResponseCode.SYSTEM_ERROR, "the server failed unexpectedly", retriable=True)
class BrokerSystemError(BrokerError):
    pass


@_register(ResponseCode.SYSTEM_BUSY, "the server is too busy to take the request now", retriable=True)
class SystemBusyError(BrokerError):
    pass


@_register(ResponseCode.REQUEST_CODE_NOT_SUPPORTED, "the server does not support this request code")
class RequestCodeNotSupportedError(BrokerError):
    pass


@_register(ResponseCode.TRANSACTION_FAILED, "the transaction could not be completed")
class TransactionFailedError(BrokerError):
    pass


# The outcome is unknown after these two timeouts (the write may still land), so a retry can duplicate the
# message; RocketMQ's delivery is at-least-once and retries them, and so do we for the replication one.
@_register(ResponseCode.FLUSH_DISK_TIMEOUT, "the message was not flushed to disk in time")
class FlushDiskTimeoutError(BrokerError):
    pass


@_register(ResponseCode.FLUSH_SLAVE_TIMEOUT, "the message was not replicated to a majority in time",
           retriable=True)
class FlushSlaveTimeoutError(BrokerError):
    pass


@_register(ResponseCode.SLAVE_NOT_AVAILABLE, "no replica is available to take the write", retriable=True)
class SlaveNotAvailableError(BrokerError):
    pass


@_register(ResponseCode.MESSAGE_ILLEGAL, "the message was rejected as illegal", fields=("max_size",))
class MessageIllegalError(BrokerError):
    pass


@_register(ResponseCode.SERVICE_NOT_AVAILABLE, "the service is not available on this node", retriable=True,
           refresh_route=True)
class ServiceNotAvailableError(BrokerError):
    pass


@_register(ResponseCode.VERSION_NOT_SUPPORTED, "the server does not support this protocol version")
class VersionNotSupportedError(BrokerError):
    pass


@_register(ResponseCode.NO_PERMISSION, "the broker does not permit this operation", retriable=True,
           refresh_route=True, fields=("topic",))
class NoPermissionError(BrokerError):
    pass


@_register(ResponseCode.TOPIC_NOT_EXIST, "the topic does not exist", refresh_route=True, fields=("topic",))
class TopicNotExistError(BrokerError):
    pass


@_register(ResponseCode.TOPIC_EXIST_ALREADY, "the topic exists already", fields=("topic",))
class TopicExistAlreadyError(BrokerError):
    pass


@_register(ResponseCode.PULL_NOT_FOUND, "no new message was found")
class PullNotFoundError(BrokerError):
    pass


@_register(ResponseCode.PULL_RETRY_IMMEDIATELY, "the pull should be retried at once", retriable=True)
class PullRetryImmediatelyError(BrokerError):
    pass


@_register(ResponseCode.PULL_OFFSET_MOVED, "the pull offset is out of range and was moved")
class PullOffsetMovedError(BrokerError):
    pass


@_register(ResponseCode.QUERY_NOT_FOUND, "no message matched the query")
class QueryNotFoundError(BrokerError):
    pass


@_register(ResponseCode.SUBSCRIPTION_PARSE_FAILED, "the subscription expression could not be parsed")
class SubscriptionParseFailedError(BrokerError):
    pass


@_register(ResponseCode.SUBSCRIPTION_NOT_EXIST, "the subscription does not exist",
           fields=("consumer_group", "topic"))
class SubscriptionNotExistError(BrokerError):
    pass


@_register(ResponseCode.SUBSCRIPTION_NOT_LATEST, "the subscription is not the latest version", retriable=True,
           fields=("consumer_group", "topic"))
class SubscriptionNotLatestError(BrokerError):
    pass


@_register(ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST, "the subscription group does not exist",
           fields=("consumer_group",))
class SubscriptionGroupNotExistError(BrokerError):
    pass


@_register(ResponseCode.FILTER_DATA_NOT_EXIST, "the filter data does not exist")
class FilterDataNotExistError(BrokerError):
    pass


@_register(ResponseCode.FILTER_DATA_NOT_LATEST, "the filter data is not the latest version", retriable=True)
class FilterDataNotLatestError(BrokerError):
    pass


@_register(ResponseCode.TRANSACTION_SHOULD_COMMIT, "the transaction should be committed")
class TransactionShouldCommitError(BrokerError):
    pass


@_register(ResponseCode.TRANSACTION_SHOULD_ROLLBACK, "the transaction should be rolled back")
class TransactionShouldRollbackError(BrokerError):
    pass


@_register(ResponseCode.TRANSACTION_STATE_UNKNOW, "the transaction state is unknown")
class TransactionStateUnknownError(BrokerError):
    pass


@_register(ResponseCode.TRANSACTION_STATE_GROUP_WRONG, "the transaction belongs to another producer group")
class TransactionStateGroupWrongError(BrokerError):
    pass


@_register(ResponseCode.NO_BUYER_ID, "the request carries no buyer id")
class NoBuyerIdError(BrokerError):
    pass


@_register(ResponseCode.NOT_IN_CURRENT_UNIT, "the request is not for the current unit")
class NotInCurrentUnitError(BrokerError):
    pass


@_register(ResponseCode.CONSUMER_NOT_ONLINE, "the consumer is not online", fields=("consumer_group",))
class ConsumerNotOnlineError(BrokerError):
    pass


@_register(ResponseCode.CONSUME_MSG_TIMEOUT, "the consumer did not consume the message in time")
class ConsumeMsgTimeoutError(BrokerError):
    pass


@_register(ResponseCode.NO_MESSAGE, "the message does not exist")
class NoMessageError(BrokerError):
    pass


@_register(ResponseCode.NOT_LEADER, "this node is not the leader of its Raft group", retriable=True,
           refresh_route=True, fields=("leader_addr",))
class NotLeaderError(BrokerError):
    def _message(self) -> str:
        text = super()._message()
        leader = self.fields.get("leader_addr")
        return f"{text}; the leader is {leader}" if leader else f"{text}; the leader is not known yet"


@_register(ResponseCode.INVALID_REQUEST, "the request is invalid", fields=("field",))
class InvalidRequestError(BrokerError):
    pass

