"""Request and response codes: RocketMQ's numbers where RocketMQ has the code, ours from 1000.

Keeping RocketMQ's numbers lets anyone who knows RocketMQ read a frame dump, and keeps room for the codes
later issues need without renumbering. ``docs/protocol.md`` mirrors these tables.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["NON_ERROR_CODES", "RequestCode", "ResponseCode"]


class RequestCode(IntEnum):
    # Broker: messages
    SEND_MESSAGE = 10
    PULL_MESSAGE = 11
    QUERY_MESSAGE = 12
    QUERY_BROKER_OFFSET = 13
    QUERY_CONSUMER_OFFSET = 14
    UPDATE_CONSUMER_OFFSET = 15
    UPDATE_AND_CREATE_TOPIC = 17
    GET_ALL_TOPIC_CONFIG = 21
    UPDATE_BROKER_CONFIG = 25
    GET_BROKER_CONFIG = 26
    GET_BROKER_RUNTIME_INFO = 28
    SEARCH_OFFSET_BY_TIMESTAMP = 29
    GET_MAX_OFFSET = 30
    GET_MIN_OFFSET = 31
    GET_EARLIEST_MSG_STORETIME = 32
    VIEW_MESSAGE_BY_ID = 33
    HEART_BEAT = 34
    UNREGISTER_CLIENT = 35
    CONSUMER_SEND_MSG_BACK = 36
    END_TRANSACTION = 37
    GET_CONSUMER_LIST_BY_GROUP = 38
    CHECK_TRANSACTION_STATE = 39
    NOTIFY_CONSUMER_IDS_CHANGED = 40
    LOCK_BATCH_MQ = 41
    UNLOCK_BATCH_MQ = 42
    GET_ALL_CONSUMER_OFFSET = 43
    GET_ALL_DELAY_OFFSET = 45
    CHECK_CLIENT_CONFIG = 46
    # Name server
    PUT_KV_CONFIG = 100
    GET_KV_CONFIG = 101
    DELETE_KV_CONFIG = 102
    REGISTER_BROKER = 103
    UNREGISTER_BROKER = 104
    GET_ROUTEINFO_BY_TOPIC = 105
    GET_BROKER_CLUSTER_INFO = 106
    # Admin
    UPDATE_AND_CREATE_SUBSCRIPTIONGROUP = 200
    GET_ALL_SUBSCRIPTIONGROUP_CONFIG = 201
    GET_TOPIC_STATS_INFO = 202
    GET_CONSUMER_CONNECTION_LIST = 203
    GET_PRODUCER_CONNECTION_LIST = 204
    WIPE_WRITE_PERM_OF_BROKER = 205
    GET_ALL_TOPIC_LIST_FROM_NAMESERVER = 206
    DELETE_SUBSCRIPTIONGROUP = 207
    GET_CONSUME_STATS = 208
    DELETE_TOPIC_IN_BROKER = 215
    DELETE_TOPIC_IN_NAMESRV = 216
    RESET_CONSUMER_CLIENT_OFFSET = 220
    INVOKE_BROKER_TO_RESET_OFFSET = 222
    GET_TOPICS_BY_CLUSTER = 224
    QUERY_TOPIC_CONSUME_BY_WHO = 300
    GET_CONSUMER_RUNNING_INFO = 307
    """Admin → broker → one online consumer (over the connection it heartbeats on): its running info."""
    CONSUME_MESSAGE_DIRECTLY = 309
    SEND_MESSAGE_V2 = 310
    CLONE_GROUP_OFFSET = 314
    """Copy one consumer group's committed offsets of a topic to another group (mqadmin cloneGroupOffset)."""
    SEND_BATCH_MESSAGE = 320
    QUERY_DATA_VERSION = 322
    SEND_REPLY_MESSAGE = 324
    """A reply to a request message (RocketMQ 4.6's request-reply): stored, then pushed to the requester."""
    SEND_REPLY_MESSAGE_V2 = 325
    PUSH_REPLY_MESSAGE_TO_CLIENT = 326
    """Broker → requesting producer: the stored reply record, matched to its request by CORRELATION_ID."""
    # RocketMQ 5's POP consumption (broker/processor/pop_message.py)
    POP_MESSAGE = 200050
    """Take up to max_msg_nums visible messages of a topic for a consumer group, invisible for invisible_time_ms."""
    ACK_MESSAGE = 200051
    """Acknowledge one popped message by its receipt handle: it is never delivered again."""
    CHANGE_MESSAGE_INVISIBLETIME = 200053
    """Make one popped message invisible for another invisible_time_ms from now; answers its new receipt handle."""
    BATCH_ACK_MESSAGE = 200151
    """Acknowledge many popped messages of one consumer group by their receipt handles, in one replicated write;
    answers each handle's outcome."""
    # raftmq's own
    ECHO = 1000
    """Answered with SUCCESS and the request's body and ext by ``raftmq bench rpc``'s echo server (only there)."""
    FETCH_COMMIT_LOG = 1001
    """A follower copying commit-log bytes it missed from a peer (design §4)."""
    GET_RAFT_STATUS = 1002
    """A node's Raft role, term, leader and committed index."""
    TRANSFER_LEADERSHIP = 1003
    """Ask a group's leader to hand leadership to a named member (DLedger's LEADERSHIP_TRANSFER)."""


class ResponseCode(IntEnum):
    SUCCESS = 0
    SYSTEM_ERROR = 1
    SYSTEM_BUSY = 2
    REQUEST_CODE_NOT_SUPPORTED = 3
    TRANSACTION_FAILED = 4
    FLUSH_DISK_TIMEOUT = 10
    SLAVE_NOT_AVAILABLE = 11
    FLUSH_SLAVE_TIMEOUT = 12
    MESSAGE_ILLEGAL = 13
    SERVICE_NOT_AVAILABLE = 14
    VERSION_NOT_SUPPORTED = 15
    NO_PERMISSION = 16
    TOPIC_NOT_EXIST = 17
    TOPIC_EXIST_ALREADY = 18
    PULL_NOT_FOUND = 19
    PULL_RETRY_IMMEDIATELY = 20
    PULL_OFFSET_MOVED = 21
    QUERY_NOT_FOUND = 22
    SUBSCRIPTION_PARSE_FAILED = 23
    SUBSCRIPTION_NOT_EXIST = 24
    SUBSCRIPTION_NOT_LATEST = 25
    SUBSCRIPTION_GROUP_NOT_EXIST = 26
    FILTER_DATA_NOT_EXIST = 27
    FILTER_DATA_NOT_LATEST = 28
    TRANSACTION_SHOULD_COMMIT = 200
    TRANSACTION_SHOULD_ROLLBACK = 201
    TRANSACTION_STATE_UNKNOW = 202  # RocketMQ's spelling, kept so the name matches its docs
    TRANSACTION_STATE_GROUP_WRONG = 203
    NO_BUYER_ID = 204
    NOT_IN_CURRENT_UNIT = 205
    CONSUMER_NOT_ONLINE = 206
    CONSUME_MSG_TIMEOUT = 207
    NO_MESSAGE = 208
    # raftmq's own
    NOT_LEADER = 1000
    """This node is not its group's Raft leader; ext ``leader_addr`` names the leader when known."""
    INVALID_REQUEST = 1001
    """A request field is missing or malformed; the remark names the field and ext ``field`` holds its name."""


# Codes that report a normal outcome rather than a failure: a pull that found nothing, the answer of a
# transaction check. Clients branch on them; they do not raise.
NON_ERROR_CODES = frozenset({
    ResponseCode.SUCCESS,
    ResponseCode.PULL_NOT_FOUND,
    ResponseCode.PULL_RETRY_IMMEDIATELY,
    ResponseCode.PULL_OFFSET_MOVED,
    ResponseCode.TRANSACTION_SHOULD_COMMIT,
    ResponseCode.TRANSACTION_SHOULD_ROLLBACK,
    ResponseCode.TRANSACTION_STATE_UNKNOW,
})
