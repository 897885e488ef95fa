"""The raftmq client: producer, push and pull consumers, admin (design §5).

    async with open_producer(namesrv="127.0.0.1:9876") as producer:
        result = await producer.send(Message("TopicTest", b"hello", tags="TagA"))

Transactional messages: ``open_producer(..., transaction_listener=...)`` and ``send_in_transaction``
(``client/transaction.py``).

RocketMQ 5's simple consumer (receive, then ack or change each message's invisible time, on the brokers' POP):
``open_simple_consumer`` (``client/simple_consumer.py``).

Message trace: ``enable_msg_trace=True`` on a producer, push consumer or lite pull consumer,
``AdminClient.query_msg_trace`` (``client/trace.py``).

A push consumer's handler says how a message went by returning (None or ``ConsumeStatus``) or raising
(``ReconsumeLater``, RocketMQ's RECONSUME_LATER with its delay level or suspend time): ``client/push_consumer.py``.
"""

from client.admin import (
    AdminClient,
    BrokerConfigUpdate,
    ClusterInfo,
    ConsumerConnection,
    ConsumeStats,
    DelayLevelProgress,
    GroupDeletion,
    OffsetReset,
    ProducerConnection,
    QueueConsumeStats,
    SubscriptionGroup,
    SubscriptionGroupUpdate,
    TopicPermUpdate,
    TopicQueueStatus,
    open_admin,
)
from client.errors import (
    BrokerError,
    ClientClosedError,
    ClientError,
    ConfigError,
    ConnectError,
    ConnectionClosedError,
    MessageTooLargeError,
    NoRouteError,
    NotLeaderError,
    RaftMQError,
    RemotingError,
    ReplyTimeoutError,
    RequestTimeoutError,
    SendFailedError,
    SubscriptionRefusedError,
    TooManyRequestsError,
)
from client.filter import MessageSelector, Subscription, parse_subscription, tags_code
from client.message import (
    Message,
    MessageExt,
    MessageQueue,
    PullResult,
    PullStatus,
    SendResult,
    SendStatus,
    create_reply_message,
)
from client.producer import Producer, ProducerConfig, open_producer
from client.pull_consumer import PullConsumer, PullConsumerConfig, open_pull_consumer
from client.listener import ConsumeStatus, ReconsumeLater
from client.lite_pull_consumer import LitePullConsumer, LitePullConsumerConfig, open_lite_pull_consumer
from client.simple_consumer import ReceivedMessage, SimpleConsumer, SimpleConsumerConfig, open_simple_consumer
from client.push_consumer import PushConsumer, PushConsumerConfig, open_push_consumer
from client.rebalance import (allocate_average, allocate_average_by_circle, allocate_by_config,
                              allocate_consistent_hash)
from client.trace import TraceContext, TraceType
from client.transaction import TransactionListener, TransactionSendResult, TransactionState

__all__ = [
    "open_producer", "Producer", "ProducerConfig",
    "open_push_consumer", "PushConsumer", "PushConsumerConfig", "ConsumeStatus", "ReconsumeLater",
    "open_pull_consumer", "PullConsumer", "PullConsumerConfig",
    "open_lite_pull_consumer", "LitePullConsumer", "LitePullConsumerConfig",
    "open_simple_consumer", "SimpleConsumer", "SimpleConsumerConfig", "ReceivedMessage",
    "open_admin", "AdminClient", "ClusterInfo", "ConsumeStats", "ConsumerConnection", "OffsetReset",
    "QueueConsumeStats", "TopicQueueStatus", "DelayLevelProgress", "TopicPermUpdate", "ProducerConnection",
    "GroupDeletion", "BrokerConfigUpdate", "SubscriptionGroup", "SubscriptionGroupUpdate",
    "Message", "MessageExt", "MessageQueue", "SendResult", "SendStatus", "PullResult", "PullStatus",
    "create_reply_message",
    "Subscription", "MessageSelector", "parse_subscription", "tags_code",
    "allocate_average", "allocate_average_by_circle", "allocate_consistent_hash", "allocate_by_config",
    "TransactionListener", "TransactionSendResult", "TransactionState",
    "TraceContext", "TraceType",
    "RaftMQError", "RemotingError", "ConnectError", "ConnectionClosedError", "RequestTimeoutError", "BrokerError",
    "NotLeaderError", "ClientError", "NoRouteError", "ClientClosedError", "MessageTooLargeError",
    "SendFailedError", "ConfigError", "SubscriptionRefusedError", "ReplyTimeoutError", "TooManyRequestsError",
]
