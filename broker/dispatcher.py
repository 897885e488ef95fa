"""The remoting handler of a broker node: request code → processor, and errors → response codes in one place.

Processors raise ``RequestRejected`` for anything a client did wrong or must react to; DLedger's errors are
mapped here (NotLeader/LeaderChanged/BatchRejected → NOT_LEADER with the leader hint so the client refreshes its
route and retries, GroupBusy → SYSTEM_BUSY, AppendTimeout → FLUSH_SLAVE_TIMEOUT: the outcome is unknown, as
RocketMQ's replica timeout, RecordTooLarge → MESSAGE_ILLEGAL). Anything else is logged with its traceback and
answered SYSTEM_ERROR; the connection and the node live on.

With ``acl_enable`` every request but DLedger's is judged by the ACL (``broker/acl.py``) before its processor runs,
here and nowhere else; a refusal is NO_PERMISSION (and logged by the checker). The checker reads the store through
``_stored_message`` for the requests that name a message by its commit-log offset: a record never changes once
written (offsets only grow) and an offset with none is refused, so what the processor reads later is what was
judged. Off, the only cost is one test of ``self.acl``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from broker.acl import AclChecker, StoredMessage, acl_file_path, needs_admin
from broker.processor.admin import AdminProcessor
from broker.processor.base import RequestRejected, error_response, reply
from broker.processor.client_manage import ClientManageProcessor
from broker.processor.consumer_manage import ConsumerManageProcessor
from broker.processor.end_transaction import EndTransactionProcessor
from broker.processor.pop_message import PopMessageProcessor
from broker.processor.pull_message import PullMessageProcessor
from broker.processor.query_message import QueryMessageProcessor
from broker.processor.queue_lock import QueueLockProcessor
from broker.processor.reply import ReplyMessageProcessor
from broker.processor.send_back import SendBackProcessor
from broker.processor.send_message import SendMessageProcessor
from dledger import DLedgerError
from dledger.service import DLedgerService
from remoting.codec import Frame
from remoting.codes import RequestCode, ResponseCode

if TYPE_CHECKING:
    from broker.node import BrokerNode

Handler = Callable[[Frame, Any], Awaitable[Frame | None]]


class BrokerDispatcher:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node
        self.dledger = DLedgerService(node.group)
        send = SendMessageProcessor(node)
        pull = PullMessageProcessor(node)
        clients = ClientManageProcessor(node)
        offsets = ConsumerManageProcessor(node)
        admin = AdminProcessor(node)
        query = QueryMessageProcessor(node)
        locks = QueueLockProcessor(node)
        send_back = SendBackProcessor(node)
        end_transaction = EndTransactionProcessor(node)
        pop = PopMessageProcessor(node)
        self.replies = ReplyMessageProcessor(node, send)  # its serve() creates the reply topic (node.py)
        self.handlers: dict[int, Handler] = {
            RequestCode.SEND_MESSAGE: send.process,
            RequestCode.SEND_MESSAGE_V2: send.process,
            RequestCode.SEND_BATCH_MESSAGE: send.process,
            RequestCode.SEND_REPLY_MESSAGE: self.replies.process,
            RequestCode.SEND_REPLY_MESSAGE_V2: self.replies.process,
            RequestCode.PULL_MESSAGE: pull.process,
            RequestCode.CONSUMER_SEND_MSG_BACK: send_back.consumer_send_msg_back,
            RequestCode.END_TRANSACTION: end_transaction.end_transaction,
            RequestCode.POP_MESSAGE: pop.pop_message,
            RequestCode.ACK_MESSAGE: pop.ack_message,
            RequestCode.CHANGE_MESSAGE_INVISIBLETIME: pop.change_invisible_time,
            RequestCode.BATCH_ACK_MESSAGE: pop.batch_ack_message,
            RequestCode.HEART_BEAT: clients.heartbeat,
            RequestCode.UNREGISTER_CLIENT: clients.unregister_client,
            RequestCode.CHECK_CLIENT_CONFIG: clients.check_client_config,
            RequestCode.GET_CONSUMER_LIST_BY_GROUP: clients.get_consumer_list_by_group,
            RequestCode.GET_CONSUMER_CONNECTION_LIST: clients.get_consumer_connection_list,
            RequestCode.GET_PRODUCER_CONNECTION_LIST: clients.get_producer_connection_list,
            RequestCode.QUERY_CONSUMER_OFFSET: offsets.query_consumer_offset,
            RequestCode.UPDATE_CONSUMER_OFFSET: offsets.update_consumer_offset,
            RequestCode.GET_CONSUME_STATS: offsets.get_consume_stats,
            RequestCode.LOCK_BATCH_MQ: locks.lock_batch_mq,
            RequestCode.UNLOCK_BATCH_MQ: locks.unlock_batch_mq,
            RequestCode.INVOKE_BROKER_TO_RESET_OFFSET: offsets.reset_offset,
            RequestCode.DELETE_SUBSCRIPTIONGROUP: offsets.delete_subscription_group,
            RequestCode.CLONE_GROUP_OFFSET: offsets.clone_group_offset,
            RequestCode.GET_CONSUMER_RUNNING_INFO: clients.get_consumer_running_info,
            RequestCode.UPDATE_AND_CREATE_TOPIC: admin.update_and_create_topic,
            RequestCode.DELETE_TOPIC_IN_BROKER: admin.delete_topic,
            RequestCode.GET_ALL_TOPIC_CONFIG: admin.get_all_topic_config,
            RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP: admin.update_and_create_subscription_group,
            RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG: admin.get_all_subscription_group_config,
            RequestCode.GET_TOPIC_STATS_INFO: admin.get_topic_stats_info,
            RequestCode.GET_MAX_OFFSET: admin.get_max_offset,
            RequestCode.GET_MIN_OFFSET: admin.get_min_offset,
            RequestCode.SEARCH_OFFSET_BY_TIMESTAMP: admin.search_offset_by_timestamp,
            RequestCode.GET_EARLIEST_MSG_STORETIME: admin.get_earliest_msg_store_time,
            RequestCode.GET_BROKER_RUNTIME_INFO: admin.get_broker_runtime_info,
            RequestCode.GET_BROKER_CONFIG: admin.get_broker_config,
            RequestCode.UPDATE_BROKER_CONFIG: admin.update_broker_config,
            RequestCode.GET_ALL_DELAY_OFFSET: admin.get_all_delay_offset,
            RequestCode.VIEW_MESSAGE_BY_ID: query.view_message_by_id,
            RequestCode.QUERY_MESSAGE: query.query_message,
        }
        # DLedger's own requests (catch-up copies, Raft status for `raftmq verify`, leadership transfer before a
        # node is restarted) share the broker's port.
        self.handlers.update(dict.fromkeys(DLedgerService.CODES, self.dledger.handle))
        # Read at start: a bad file stops the node with the ConfigError naming the entry at fault.
        self.acl = AclChecker(acl_file_path(node.config), broker_name=node.config.broker_name,
                              stored_message=self._stored_message) if node.config.acl_enable else None

    def _stored_message(self, phy_offset: int) -> StoredMessage | None:
        """The topic and properties of the record at ``phy_offset`` (None if none starts there), for the ACL of the
        requests that name a stored message (END_TRANSACTION, CONSUMER_SEND_MSG_BACK, VIEW_MESSAGE_BY_ID). The bounds
        are the processors' (send-back's, node.read_record's): a record is judged where they would find one."""
        store = self.node.store
        if not store.min_phy_offset <= phy_offset < store.max_phy_offset:
            return None
        try:
            view = store.look_message_by_offset(phy_offset)
        except ValueError:  # MessageFormatError: the bytes there do not decode
            return None
        return (view.topic, view.properties) if view is not None else None

    async def handle(self, request: Frame, conn: Any) -> Frame | None:
        handler = self.handlers.get(request.code)
        if handler is None:
            return reply(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                         f"request code {request.code} is not supported by broker node {self.node.broker_addr}")
        if self.acl is not None and self._judged(request):
            refusal = self.acl.check(request, getattr(conn, "remote_address", ""))
            if refusal is not None:
                # The checker logged it, rate-limited; reply() would log a oneway refusal again, at every one.
                return None if request.is_oneway else reply(request, ResponseCode.NO_PERMISSION, refusal)
        try:
            return await handler(request, conn)
        except (RequestRejected, DLedgerError) as e:
            return error_response(self.node, request, e)

    def _judged(self, request: Frame) -> bool:
        """Whether the ACL judges ``request``: every client request, and a leadership transfer or a log checksum not
        signed by a member (admin requests then: ``broker.acl.needs_admin``). FETCH_COMMIT_LOG is the DLedger
        service's own to refuse (members only, ACL or not), and a plain GET_RAFT_STATUS (role, term, offsets) is a
        status lookup `raftmq chaos` makes unsigned."""
        if request.code not in DLedgerService.CODES:
            return True
        # Of DLedger's requests, needs_admin holds for exactly those two; the others are not the ACL's.
        return needs_admin(request) and not self.dledger.members.verify(request)

    def connection_closed(self, conn: Any) -> None:
        self.node.clients.connection_closed(conn)
