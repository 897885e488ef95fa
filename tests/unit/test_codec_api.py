"""Pins the public API of the ``remoting`` package (conventions: ``__all__`` re-exports, a test pins it)."""

from __future__ import annotations

import remoting
from remoting import transport


def test_remoting_public_api():
    assert sorted(remoting.__all__) == sorted([
        "DEFAULT_MAX_FRAME_SIZE", "FLAG_ONEWAY", "FLAG_RESPONSE", "NEED_DATA", "NON_ERROR_CODES",
        "BrokerError", "ClientConnection", "ConnectError", "ConnectionClosedError", "Frame", "FrameDecoder",
        "FrameTooLargeError", "InvalidRequestError", "MessageIllegalError", "NotLeaderError", "ProtocolError",
        "RaftMQError", "RemotingClient", "RemotingConnection", "RemotingError", "RequestCode",
        "RequestTimeoutError", "ResponseCode", "ServerConnection", "ServiceNotAvailableError", "SystemBusyError",
        "TopicNotExistError", "encode", "for_code", "make_request", "make_response", "open_connection",
        "open_remoting_client", "serve_remoting",
    ])
    for name in remoting.__all__:
        assert getattr(remoting, name) is not None


def test_transport_public_api():
    assert sorted(transport.__all__) == sorted([
        "ClientConnection", "ConnectionStatistics", "RemotingClient", "RemotingConnection", "RequestHandler",
        "ServerConnection", "background_nursery", "corked", "open_connection", "open_listeners", "open_remoting_client",
        "serve_remoting",
    ])
