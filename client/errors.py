"""The client's errors: the remoting hierarchy re-exported, plus what only a client can get wrong.

Every error has ``retriable`` (sending again may succeed) and ``refresh_route`` (the cached route is probably
stale: ask the name servers now). The producer and consumers act on these two flags only, never on classes.
"""

from __future__ import annotations

from typing import Any

from remoting.config import ConfigError
from remoting.errors import (
    BrokerError,
    ConnectError,
    ConnectionClosedError,
    FrameTooLargeError,
    MessageIllegalError,
    NotLeaderError,
    ProtocolError,
    RaftMQError,
    RemotingError,
    RequestTimeoutError,
    ServiceNotAvailableError,
    SystemBusyError,
    TopicNotExistError,
    for_code,
)

__all__ = [
    "RaftMQError", "RemotingError", "ConnectionClosedError", "RequestTimeoutError", "ProtocolError",
    "FrameTooLargeError", "ConnectError", "BrokerError", "NotLeaderError", "SystemBusyError", "TopicNotExistError",
    "MessageIllegalError", "ServiceNotAvailableError", "for_code", "ConfigError",
    "ClientError", "NoRouteError", "ClientClosedError", "MessageTooLargeError", "SendFailedError",
    "UnknownBrokerError", "SubscriptionRefusedError", "ReplyTimeoutError", "TooManyRequestsError",
]


class ClientError(RaftMQError):
    """Something the client itself detected; ``fields`` name what was wrong."""

    retriable = False
    refresh_route = False

    def __init__(self, message: str, **fields: Any) -> None:
        Exception.__init__(self, message)
        self.message = message
        self.fields = fields
        for k, v in fields.items():
            setattr(self, k, v)

    def __str__(self) -> str:
        return self.message


class NoRouteError(ClientError):
    """No name server could give a usable route for the topic (unknown topic, or none answered)."""

    retriable = True
    refresh_route = True


class UnknownBrokerError(ClientError):
    """A broker group named by a queue is not in any cached route."""

    retriable = True
    refresh_route = True


class ClientClosedError(ClientError):
    """The producer or consumer was used after it was closed (or began closing), or closed before a send's message
    left: that message was not sent. A send whose request was out, unanswered, when its producer finished closing
    gets ``SendFailedError`` instead, its outcome unknown (the message may be stored)."""


class MessageTooLargeError(ClientError):
    """The message body exceeds ``max_message_size_bytes``; checked before sending."""


class SendFailedError(ClientError):
    """Every attempt of a send failed; ``attempts`` and ``last_error`` say how."""

    def __init__(self, message: str, *, attempts: int, last_error: BaseException, topic: str) -> None:
        super().__init__(message, attempts=attempts, last_error=last_error, topic=topic)
        self.retriable = getattr(last_error, "retriable", False)
        self.refresh_route = getattr(last_error, "refresh_route", False)


class SubscriptionRefusedError(ClientError):
    """A broker group serving the topic refused the subscription when asked (CHECK_CLIENT_CONFIG, RocketMQ's
    checkClientInBroker, whose MQClientException this is): it would refuse the pulls too. ``topic``,
    ``broker_name``, ``addr`` (the node that answered), ``code`` (its response code) and ``remark`` (its reason,
    e.g. a node without ``enable_property_filter`` for a SQL92 expression). Not retriable: the broker's config
    or the expression must change."""


class ReplyTimeoutError(ClientError):
    """``Producer.request`` sent its request, but no reply came within its timeout (RocketMQ's
    RequestTimeoutException): nothing answered, the answer is still on its way, or the broker could not push it; or
    the timeout went by before it was sent (fetching routes; ``correlation_id`` None then).
    ``topic``, ``correlation_id``, ``timeout_s``. Not retriable: the request was delivered, and sending it again may
    have it handled twice; a reply that comes later is dropped."""


class TooManyRequestsError(ClientError):
    """``Producer.request`` refused at once: ``max_pending`` requests of this producer already wait for replies
    (its ``max_pending_requests``). Retriable, once some have been answered or timed out."""

    retriable = True
