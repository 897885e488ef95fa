"""raftmq's wire protocol: the sans-IO frame codec, the code tables, the error hierarchy and the trio transport.

``remoting`` imports nothing else of raftmq; every other package talks to the network through it.
"""

from remoting.codec import (
    DEFAULT_MAX_FRAME_SIZE,
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    NEED_DATA,
    Frame,
    FrameDecoder,
    encode,
    make_request,
    make_response,
)
from remoting.codes import NON_ERROR_CODES, RequestCode, ResponseCode
from remoting.errors import (
    BrokerError,
    ConnectError,
    ConnectionClosedError,
    FrameTooLargeError,
    InvalidRequestError,
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
from remoting.transport import (
    ClientConnection,
    RemotingClient,
    RemotingConnection,
    ServerConnection,
    open_connection,
    open_remoting_client,
    serve_remoting,
)

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE", "FLAG_ONEWAY", "FLAG_RESPONSE", "NEED_DATA", "NON_ERROR_CODES",
    "BrokerError", "ClientConnection", "ConnectError", "ConnectionClosedError", "Frame", "FrameDecoder",
    "FrameTooLargeError", "InvalidRequestError", "MessageIllegalError", "NotLeaderError", "ProtocolError",
    "RaftMQError", "RemotingClient", "RemotingConnection", "RemotingError", "RequestCode",
    "RequestTimeoutError", "ResponseCode", "ServerConnection", "ServiceNotAvailableError", "SystemBusyError",
    "TopicNotExistError", "encode", "for_code", "make_request", "make_response", "open_connection",
    "open_remoting_client", "serve_remoting",
]
