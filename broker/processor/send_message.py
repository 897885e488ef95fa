"""SEND_MESSAGE / SEND_MESSAGE_V2 / SEND_BATCH_MESSAGE: validate, then append through the group commit.

Order of checks (each with its own response code, so a client knows whether to retry, refresh its route or give
up): leadership (NOT_LEADER + ``leader_addr``), the node's ``broker_permission`` (NO_PERMISSION: the group was taken
out of write traffic, ``raftmq admin update-broker-config``), topic name (INVALID_REQUEST naming ``topic``), reserved
topic (NO_PERMISSION), topic existence or auto-creation (TOPIC_NOT_EXIST), write permission (NO_PERMISSION), queue id
(INVALID_REQUEST naming ``queue_id``), message size and properties (MESSAGE_ILLEGAL: a block ``encode_properties``
would not write), batch structure
(INVALID_REQUEST naming ``body``), a batch's index keys (MESSAGE_ILLEGAL: its DLedger entry cannot fit
``max_entry_bytes``, or it holds more than ``MAX_BATCH_INDEX_KEYS``). Only then is the message encoded (single send)
or taken as is (a batch body already is the batch layout of ``remoting/message.py``; the broker rewrites only the
8-byte store host) and handed to the group's batcher, which answers after the Raft commit and the local apply.

The response carries ``msg_id`` (comma-separated for a batch, as RocketMQ's MessageBatch), ``queue_id`` and
``queue_offset`` (of the first message of a batch).
"""

from __future__ import annotations

import functools
import logging
import socket
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import cbor2

from broker.commit_log_machine import least_entry_bytes
from broker.processor.base import (I32, I64, RequestRejected, answer_from_task, error_response, get_bool, get_group,
                                   get_int, get_str, invalid, topic_not_writable, unexpected_response)
from broker.topic_config import TopicConfigError, check_sendable_topic, validate_topic_name
from dledger import DLedgerError, NotLeaderError
from dledger.errors import PreparedEntryTooLargeError
from remoting.codec import EncodedExt, Frame, make_response
from remoting.codes import RequestCode, ResponseCode
from broker.schedule import timer_property
from broker.transaction import prepared_sys_flag
from remoting.message import (BATCH_HEAD, BATCH_MAGIC, ENTRY_HEAD, PROPERTY_DELAY, PROPERTY_TIMER_DELAY_MS,
                              PROPERTY_TIMER_DELAY_SEC, PROPERTY_TIMER_DELIVER_MS, PROPERTY_TRANSACTION_PREPARED,
                              CheckedBatch, MessageFormatError, MessageInput, batch_count, batch_index_keys,
                              check_topic, encode_batch, encode_properties, encode_single_batch,
                              scan_producer_batch)

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

_QUEUE_ID = struct.Struct(">i")

# The most IndexFile keys (a UNIQ_KEY, each key of KEYS) one send may hold. The leader builds a send's DLedger entry
# (a CRC32C hash and 12 bytes a key) on the trio thread that also ticks Raft, so keys are time its followers do not
# hear from it: measured on a 2-core machine, 32,722 keys took 21-23 ms to build and 4 ms to apply, well within
# the smallest election timeout (election_timeout_min_ms 400 by default; a heartbeat is due every 50 ms); 64
# messages of 15,000 keys (960,064: 1.9 MB of batch, a 13.4 MB entry) took 0.53 s, and each such send cost the
# group 2-4 elections. The most a batch of max_batch_messages' greatest setting (65,536, each with its UNIQ_KEY) holds
# plus twice the most one message holds (16,381 keys of one character in 32 KiB of properties): every legal batch
# count passes, any message alone too, and the worst build is ~65 ms (32,768 refused batches of 40,000 plain
# messages that max_batch_messages allowed).
MAX_BATCH_INDEX_KEYS = 65_536 + 32_768


class SendMessageProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node
        self._round_robin = 0
        self._store_host: Any = None
        self._store_bytes: tuple[bytes, int] | None = None
        self._sync_flush = node.config.store.flush_disk_type == "SYNC_FLUSH"
        self._timeout_s = node.config.send_timeout_ms / 1000
        assert node.config.dledger is not None  # BrokerConfig requires it
        self._max_entry_bytes = node.config.dledger.max_entry_bytes

    async def process(self, request: Frame, conn: Any) -> Frame | None:
        node = self.node
        if not node.is_leader():
            raise node.not_leader()
        ext = request.ext
        if not node.writable:
            raise node.write_forbidden(ext.get("topic"))
        topic = get_str(ext, "topic")
        get_group(ext, "producer_group", default="DEFAULT_PRODUCER")
        # Hot path: the table judged each stored name as it came in (reserved or illegal ones are not sendable),
        # so only a name it does not hold as sendable pays the checks.
        config = node.topics.sendable(topic)
        if config is None:
            try:
                validate_topic_name(topic)
                check_sendable_topic(topic)
            except TopicConfigError as e:
                if "reserved" in str(e):
                    raise RequestRejected(ResponseCode.NO_PERMISSION, str(e)) from None
                raise RequestRejected(ResponseCode.INVALID_REQUEST, str(e), ext={"field": "topic"}) from None
            # Read only here, off the hot path: a producer sending on a stand-in route says how many queues per
            # group it expects the topic it creates to have (the node creates at most its own default).
            queue_nums = ext.get("default_topic_queue_nums")
            if queue_nums is not None:
                queue_nums = get_int(ext, "default_topic_queue_nums", lo=1, hi=I32[1])
            config = await node.topic_for_send(topic, queue_nums)
        if not config.writable:
            raise topic_not_writable(node, topic, config)
        queue_id = get_int(ext, "queue_id", default=-1, lo=-1, hi=I32[1])
        if queue_id < 0:
            queue_id = self._round_robin % config.write_queue_nums
            self._round_robin += 1
        elif queue_id >= config.write_queue_nums:
            if ext.get("default_topic_queue_nums") is not None:
                get_int(ext, "default_topic_queue_nums", lo=1, hi=I32[1])  # its presence re-maps: a real one only
            if ext.get("default_topic_queue_nums") is None:
                raise invalid("queue_id", f"must be below topic {topic!r}'s write_queue_nums "
                                          f"{config.write_queue_nums}, got {queue_id}")
            # Sent on a stand-in route, whose queues were the producer's guess (more than this node created): stored
            # in a queue the topic has, which the answer names, instead of refused until the producer's refresh.
            queue_id %= config.write_queue_nums
        max_size = node.max_message_size
        is_batch = request.code == RequestCode.SEND_BATCH_MESSAGE or get_bool(ext, "batch")
        if is_batch:
            batch = self._check_batch(request.body, topic, queue_id, max_size)
        else:
            batch = self._encode_single(request, topic, queue_id, max_size, conn)
        if getattr(conn, "nursery", None) is None:
            return await self._append(request, batch)
        # The connection's reader goes on with the next request while this batch waits for its Raft commit, so
        # one connection keeps many sends in flight (and the group commit fills up). Usually no task at all: the
        # group calls back on commit and the answer goes straight onto the connection's write queue (a task per
        # send cost ~20 % of the leader's CPU). SYNC_FLUSH, which must also wait for the disk, uses a task.
        if self._sync_flush or not hasattr(conn, "send_response_nowait"):
            conn.nursery.start_soon(self._append_and_answer, request, batch, conn)
            return None
        node.group.append_nowait(batch, functools.partial(self._appended, request, batch, conn),
                                 timeout_s=self._timeout_s)
        return None

    def _appended(self, request: Frame, batch: bytes, conn: Any, pending: Any) -> None:
        # Called by the group (trio thread, no task) once the batch is committed and applied, or failed.
        node = self.node
        error = pending.error
        try:
            if error is None:
                messages = node.machine_messages(pending.result)
                node.put_requests += 1
                node.put_messages += len(messages)
                response = self._success(request, messages)
            elif isinstance(error, NotLeaderError) and node.group.is_leader:
                # Elected, but the new term's no-op is not applied yet: the task path waits for it (append_messages).
                if not conn.closed:
                    conn.nursery.start_soon(self._append_and_answer, request, batch, conn)
                return
            elif isinstance(error, PreparedEntryTooLargeError):
                response = error_response(node, request, self._entry_too_large(batch, error))
            elif isinstance(error, DLedgerError):
                response = error_response(node, request, error)
            else:
                raise error
        except RequestRejected as e:
            response = error_response(node, request, e)
        except Exception:
            response = unexpected_response(request)
        if response is None or request.is_oneway:
            return
        if not conn.send_response_nowait(response):
            log.debug("send answer not delivered: connection closed remote=%s", conn.remote_address)

    async def _append_and_answer(self, request: Frame, batch: bytes, conn: Any) -> None:
        await answer_from_task(self.node, request, conn, functools.partial(self._append, request, batch))

    async def _append(self, request: Frame, batch: bytes) -> Frame:
        try:
            return self._success(request, await self.node.append_messages(batch))
        except PreparedEntryTooLargeError as e:
            raise self._entry_too_large(batch, e) from None

    def _entry_too_large(self, batch: bytes, error: PreparedEntryTooLargeError) -> RequestRejected:
        """MESSAGE_ILLEGAL (not retriable: the same bytes never fit) for a send within ``max_message_size`` whose
        entry the group refused once built: a single send (its keys are not counted before), or a batch whose
        entry crossed a segment end it was not judged with (``_check_index_keys``). The sizes are the group's;
        the index keys are counted in the batch's properties, not built again."""
        return RequestRejected(ResponseCode.MESSAGE_ILLEGAL, _entry_remark(
            batch_count(batch), len(batch), str(error.entry_size), error.max_size, batch_index_keys(batch)),
            ext=_BATCH_FIELD)

    def _success(self, request: Frame, results: Any) -> Frame:
        # The per-topic figures of the metrics: one dict lookup per request, whatever the batch holds. The topic is
        # the one the producer named (a delayed message's, not the schedule topic it waits in).
        topic = request.ext["topic"]
        counts = self.node.put_by_topic.get(topic)
        if counts is None:
            counts = self.node.put_by_topic[topic] = [0, 0]
        counts[0] += len(results)
        counts[1] += len(request.body)
        first = results[0]
        msg_id = first.msg_id if len(results) == 1 else ",".join(r.msg_id for r in results)
        return make_response(request, ResponseCode.SUCCESS, ext=send_result_ext(msg_id, first.queue_id,
                                                                                first.queue_offset))

    def _encode_single(self, request: Frame, topic: str, queue_id: int, max_size: int, conn: Any) -> bytes:
        ext = request.ext
        body = request.body
        if len(body) > max_size:
            raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL, self._too_large("message body", len(body), max_size))
        properties = ext.get("properties")
        if properties is None:
            properties = {}
        elif type(properties) is not dict and not isinstance(properties, Mapping):
            raise invalid("properties", f"must be a map of strings, got {type(properties).__name__}")
        half = False
        if properties:
            # The lookups a message with properties pays: a half message waits in the transaction half queue for
            # its END_TRANSACTION, a delayed one in its level's schedule queue, a timer one in the level it hops
            # through first (broker/schedule.py).
            if PROPERTY_TRANSACTION_PREPARED in properties:
                if (timer := timer_property(properties)) is not None:
                    raise invalid("properties", f"a transactional message ({PROPERTY_TRANSACTION_PREPARED}) may not "
                                                f"be delayed ({timer})")
                topic, queue_id, properties = self.node.transactions.half_destination(topic, queue_id, properties)
                half = True
            elif PROPERTY_DELAY in properties:
                topic, queue_id, properties = self.node.schedule.redirect(topic, queue_id, properties)
            elif (PROPERTY_TIMER_DELIVER_MS in properties or PROPERTY_TIMER_DELAY_MS in properties
                  or PROPERTY_TIMER_DELAY_SEC in properties):
                topic, queue_id, properties = self.node.schedule.redirect_timer(topic, queue_id, properties)
        flag = get_int(ext, "flag", default=0, lo=I32[0], hi=I32[1])
        sys_flag = get_int(ext, "sys_flag", default=0, lo=I32[0], hi=I32[1])
        if half:
            sys_flag = prepared_sys_flag(sys_flag)
        born_timestamp = get_int(ext, "born_timestamp", default=0, lo=0, hi=I64[1])
        reconsume_times = get_int(ext, "reconsume_times", default=0, lo=0, hi=I32[1])
        remote = getattr(conn, "remote_address", None)
        born = _born_host_bytes(remote)
        store_host = self.node.store_host
        if store_host != self._store_host:
            self._store_host = store_host
            self._store_bytes = _host_bytes_or_none(store_host)
        store = self._store_bytes
        try:
            if born is not None and store is not None and type(body) is bytes:
                # The usual case: every field checked here or above, written straight into the batch layout.
                props = encode_properties(properties) if properties else b""
                return CheckedBatch(encode_single_batch(check_topic(topic), queue_id, body, props, flag, sys_flag,
                                                        born_timestamp, born[0], born[1], reconsume_times, store[0],
                                                        store[1]), 1)
            # encode_batch checks every property (types, separators, total size) and names the bad one.
            message = MessageInput(
                topic=topic, queue_id=queue_id, body=body, properties=properties, flag=flag, sys_flag=sys_flag,
                born_timestamp=born_timestamp, born_host=_born_host(remote), reconsume_times=reconsume_times)
            return encode_batch([message], store_host, max_message_size=max_size)
        except MessageFormatError as e:
            raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL, str(e)) from None

    def _too_large(self, what: str, size: int, max_size: int) -> str:
        return (f"{what} of {size} bytes exceeds max_message_size {max_size} bytes "
                f"(set by {self.node.config.max_message_size_reason})")

    def _check_batch(self, body: bytes, topic: str, queue_id: int, max_size: int) -> bytes:
        # The whole batch is one dledger record: like RocketMQ's producer, its body is held to the message limit.
        if len(body) > max_size:
            raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL, self._too_large("batch body", len(body), max_size),
                                  ext={"field": "body"})
        # Every message of a batch goes to the topic and queue named in the header, as in RocketMQ: one pass
        # checks the structure and the topic, and tells whether the queue ids need rewriting (a client that
        # picked the queue already wrote it into every message).
        try:
            count, in_queue, properties_bytes = scan_producer_batch(body, max_message_size=max_size,
                                                                    topic=topic.encode("ascii"), queue_id=queue_id)
        except MessageFormatError as e:
            if e.field == "body" and "exceeds" in str(e):
                raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL, str(e)) from None
            if e.field in ("properties", "topic", "delay", "transaction"):
                raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL, str(e)) from None
            # A field a single send refuses as INVALID_REQUEST is refused so in a batch too, naming the message.
            if e.field in ("batch_topic", "born_timestamp", "reconsume_times"):
                raise invalid("body", str(e)) from None
            raise invalid("body", f"is not a valid message batch: {e}") from None
        if count > self.node.config.max_batch_messages:
            raise invalid("body", f"holds {count} messages; at most {self.node.config.max_batch_messages} "
                                  f"are accepted in one batch")
        # Half the properties' bytes bounds the index keys (scan_producer_batch): the usual batch is judged by that
        # bound, only one that could hold many keys has them counted.
        keys_most = properties_bytes // 2
        if (keys_most > MAX_BATCH_INDEX_KEYS
                or least_entry_bytes(len(body), count, len(topic), keys_most) > self._max_entry_bytes):
            self._check_index_keys(body, topic, count)
        ip, port = self.node.store_host
        head = BATCH_HEAD.pack(BATCH_MAGIC, count, socket.inet_aton(ip), port)
        out = bytearray(body)
        out[:BATCH_HEAD.size] = head
        if not in_queue:
            pos = BATCH_HEAD.size
            for _ in range(count):
                _QUEUE_ID.pack_into(out, pos + 4, queue_id)
                pos += ENTRY_HEAD.unpack_from(out, pos)[0]
        return CheckedBatch(out, count)

    def _check_index_keys(self, body: bytes, topic: str, count: int) -> None:
        """Refuse (MESSAGE_ILLEGAL, not retriable) a batch whose DLedger entry cannot fit ``max_entry_bytes``, or
        that holds more than ``MAX_BATCH_INDEX_KEYS`` index keys, before the leader builds anything: the group
        learnt an entry was too large only once it had built it, on the thread that ticks Raft (0.5 s for 960,064
        keys, and as long again to name them in the refusal), and its followers elected another leader meanwhile.
        The entry is judged by its least size (``least_entry_bytes``: as if it crossed no segment end), so what
        could fit goes on to the group, which refuses the rest (``_entry_too_large``)."""
        keys = batch_index_keys(body)
        least = least_entry_bytes(len(body), count, len(topic), keys)
        if least > self._max_entry_bytes:
            raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL, _entry_remark(
                count, len(body), f"at least {least}", self._max_entry_bytes, keys), ext=_BATCH_FIELD)
        if keys > MAX_BATCH_INDEX_KEYS:
            raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL, (
                f"the batch of {count} messages ({len(body)} bytes) holds {keys} index keys (one per UNIQ_KEY and "
                f"per key of KEYS), more than the {MAX_BATCH_INDEX_KEYS} one send may hold (the leader builds each "
                f"into the DLedger entry on the thread that keeps its Raft group); send fewer messages at once, or "
                f"fewer keys"), ext=_BATCH_FIELD)


# Ext ``field`` of the refusals that are the batch's as a whole (its DLedger entry, its index keys): a client that
# packed single sends into it (client/accumulator.py) sends them again in smaller batches, which may pass.
# MESSAGE_ILLEGAL of one message's problem names no field; ``body`` is the whole body past max_message_size.
_BATCH_FIELD = {"field": "batch"}


def _entry_remark(count: int, size: int, entry: str, max_entry_bytes: int, index_keys: int) -> str:
    what = f"the batch of {count} messages" if count > 1 else "the message"
    return (f"{what} ({size} bytes) makes a DLedger entry of {entry} bytes, more than the {max_entry_bytes} one "
            f"entry holds (dledger.append_entries_batch_size_bytes): besides the records, its {index_keys} index "
            f"entries (one per UNIQ_KEY and per key of KEYS) take 12 bytes each; send fewer messages at once, or "
            f"fewer keys")


# A send's answer, as cbor2.dumps writes {"msg_id", "queue_id", "queue_offset", "region_id", "trace_on"}: the keys
# and the two fixed values encoded once (a test compares the bytes). ~0.5 µs less per send than building the map and
# having the codec check and encode it.
_RESULT_HEAD = b"\xa5" + cbor2.dumps("msg_id")
_KEY_QUEUE_ID = cbor2.dumps("queue_id")
_KEY_QUEUE_OFFSET = cbor2.dumps("queue_offset")
_RESULT_TAIL = cbor2.dumps("region_id") + cbor2.dumps("DefaultRegion") + cbor2.dumps("trace_on") + cbor2.dumps(False)


def send_result_ext(msg_id: str, queue_id: int, queue_offset: int) -> EncodedExt:
    dumps = cbor2.dumps
    return EncodedExt(b"".join((_RESULT_HEAD, dumps(msg_id), _KEY_QUEUE_ID, dumps(queue_id), _KEY_QUEUE_OFFSET,
                                dumps(queue_offset), _RESULT_TAIL)))


@functools.lru_cache(maxsize=4096)
def _born_host(remote: Any) -> tuple[str, int]:
    if isinstance(remote, tuple) and len(remote) >= 2:
        try:
            socket.inet_aton(remote[0])
            return str(remote[0]), int(remote[1])
        except (OSError, ValueError, TypeError):
            pass
    if isinstance(remote, str) and ":" in remote:
        host, _, port = remote.rpartition(":")
        try:
            socket.inet_aton(host)
            return host, int(port)
        except (OSError, ValueError):
            pass
    return "127.0.0.1", 0


@functools.lru_cache(maxsize=4096)
def _born_host_bytes(remote: Any) -> tuple[bytes, int] | None:
    return _host_bytes_or_none(_born_host(remote))


def _host_bytes_or_none(host: Any) -> tuple[bytes, int] | None:
    """(4-byte IP, port) of a valid ``(ip, port)``; None sends the caller to ``encode_batch``, which explains."""
    try:
        ip, port = host
        if type(port) is not int or not 0 <= port <= 65535:
            return None
        return socket.inet_pton(socket.AF_INET, ip), port
    except (OSError, TypeError, ValueError):
        return None
