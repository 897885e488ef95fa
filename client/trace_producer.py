"""``TracedProducer``: the producer ``open_producer(..., enable_msg_trace=True)`` returns (RocketMQ's
SendMessageTraceHookImpl and EndTransactionTraceHookImpl). Each send method runs as ``Producer``'s and then records
its trace contexts (``client/trace.py`` has the rules: what is recorded, and when not); so do ``request``'s send
(``_send_request``: the Pub of the request message, whatever the reply) and the answer to a transaction check
(``_end_checked``: an EndTransaction from the check, recorded before the answer goes, as RocketMQ's). A plain
``Producer`` has no hook to test, so tracing off costs the send path nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from client.instance import ClientInstance
from client.message import PROPERTY_UNIQ_KEY, Message, MessageExt, MessageQueue, SendResult, SendStatus, new_uniq_key
from client.producer import Producer, ProducerConfig
from client.send_ext import SendExt
from client.trace import TraceDispatcher, TraceMessageType, end_transaction_context, pub_context
from client.transaction import TransactionListener, TransactionSendResult, TransactionState

__all__ = ["TracedProducer"]


def _now_ms() -> int:
    return int(time.time() * 1000)


class TracedProducer(Producer):
    def __init__(self, config: ProducerConfig, instance: ClientInstance,
                 transaction_listener: TransactionListener | None, dispatcher: TraceDispatcher) -> None:
        super().__init__(config, instance, transaction_listener)
        self.trace_dispatcher = dispatcher

    def _traced(self, message: Any) -> bool:
        # A message to the trace topic is a trace itself (RocketMQ skips them too); anything else is refused by the
        # send, before a context would be recorded.
        return isinstance(message, Message) and message.topic != self.trace_dispatcher.trace_topic

    def _pub(self, message: Message, msg_id: str, offset_msg_id: str, success: bool, started_ms: int,
             started: float, msg_type: TraceMessageType | None = None) -> None:
        cost_ms = int((time.monotonic() - started) * 1000)
        self.trace_dispatcher.append(pub_context(self.config.producer_group, self.config.client_ip, message, msg_id,
                                                 offset_msg_id, success, started_ms, cost_ms, msg_type))

    async def send(self, message: Message, *, queue: MessageQueue | None = None, sharding_key: str | None = None,
                   timeout_s: float | None = None) -> SendResult:
        started_ms, started = _now_ms(), time.monotonic()
        result = await super().send(message, queue=queue, sharding_key=sharding_key, timeout_s=timeout_s)
        if self._traced(message):
            self._pub(message, result.msg_id, result.offset_msg_id, result.send_status is SendStatus.SEND_OK,
                      started_ms, started)
        return result

    async def send_batch(self, messages: Sequence[Message], *, queue: MessageQueue | None = None,
                         timeout_s: float | None = None) -> SendResult:
        started_ms, started = _now_ms(), time.monotonic()
        result = await super().send_batch(messages, queue=queue, timeout_s=timeout_s)
        # One Pub per message, as each has its own id; the brokers' offset ids come comma-joined, in order.
        offset_ids = result.offset_msg_id.split(",")
        ok = result.send_status is SendStatus.SEND_OK
        for i, (message, msg_id) in enumerate(zip(messages, result.msg_ids)):
            if self._traced(message):
                self._pub(message, msg_id, offset_ids[i] if i < len(offset_ids) else "", ok, started_ms, started)
        return result

    async def send_oneway(self, message: Message, *, queue: MessageQueue | None = None) -> None:
        if not self._traced(message):
            await super().send_oneway(message, queue=queue)
            return
        self._check(message)  # before the copy below, which would refuse a bad message in other words
        msg_id = message.properties.get(PROPERTY_UNIQ_KEY)
        if not msg_id:
            # Nothing comes back to say the id the send made: it is given here, on a copy (the caller's message is
            # left as it was: sent again, it must get an id of its own).
            msg_id = new_uniq_key()
            message = dataclasses.replace(message, properties={**message.properties, PROPERTY_UNIQ_KEY: msg_id})
        started_ms, started = _now_ms(), time.monotonic()
        await super().send_oneway(message, queue=queue)
        self._pub(message, msg_id, "", True, started_ms, started)

    async def send_in_transaction(self, message: Message, arg: Any = None, *,
                                  timeout_s: float | None = None) -> TransactionSendResult:
        # The Pub's cost is the whole call's, the listener's execute included: the half's own send is not seen here.
        started_ms, started = _now_ms(), time.monotonic()
        result = await super().send_in_transaction(message, arg, timeout_s=timeout_s)
        if self._traced(message):
            self._pub(message, result.msg_id, result.offset_msg_id, result.send_status is SendStatus.SEND_OK,
                      started_ms, started, TraceMessageType.TRANS_HALF)
            self.trace_dispatcher.append(end_transaction_context(
                self.config.producer_group, message, result.msg_id, result.offset_msg_id, result.transaction_id,
                result.local_transaction_state.value))
        return result

    async def _send_request(self, message: Message, ext: SendExt, body: bytes, uniq: str, queue: MessageQueue | None,
                            timeout_s: float) -> SendResult:
        # Timed here, around the send alone: the wait for the reply that follows is no part of the Pub's cost.
        started_ms, started = _now_ms(), time.monotonic()
        result = await super()._send_request(message, ext, body, uniq, queue, timeout_s)
        if self._traced(message):
            self._pub(message, result.msg_id, result.offset_msg_id, result.send_status is SendStatus.SEND_OK,
                      started_ms, started)
        return result

    async def _end_checked(self, broker_name: str, half_offset: int, message: MessageExt,
                           state: TransactionState) -> None:
        # The check's message is the half as its consumers will see it (real topic); its ids are the half's, and its
        # msg id is the transaction id the answer names.
        if message.topic != self.trace_dispatcher.trace_topic:
            self.trace_dispatcher.append(end_transaction_context(
                self.config.producer_group, message, message.msg_id, message.offset_msg_id, message.msg_id,
                state.value, from_check=True))
        await super()._end_checked(broker_name, half_offset, message, state)
