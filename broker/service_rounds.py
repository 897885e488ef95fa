"""What the leader's background services that store messages again (delayed delivery, transaction checks, POP
revive; ``broker/schedule.py``, ``broker/transaction.py``, ``broker/pop.py``) share about their rounds: how many
bytes of a DLedger entry a message makes, measured by the state machine's own build (a message's record is what
the send limit bounds, but each key costs 12 bytes of index on top), how much one append may hold, and how a round
that failed in a way nobody foresaw is logged. The send path never builds an entry to judge a send: it takes the
least size from the batch's bytes (``broker.commit_log_machine.least_entry_bytes``), and the group's sizes once the
group refused one."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from broker.commit_log_machine import encode_payload
from dledger.entry import ENTRY_HEADER
from remoting.message import MessageInput, batch_count, encode_batch

if TYPE_CHECKING:
    from broker.node import BrokerNode
    from broker.store import MessageStore

__all__ = ["ENTRY_SLACK_BYTES", "EntrySize", "entry_size", "entry_limit", "entry_room", "alone_entry_bytes",
           "log_unexpected_round_failure"]

# Kept below max_entry_bytes by a round of two or more messages sized with ``alone_entry_bytes``: their entry may
# cross a segment end where the lone builds did not, 24 bytes a crossing (a blank's header, one more piece). A
# message going alone is judged against max_entry_bytes itself (``entry_limit``), as the send path judged it when
# it stored the message: its build is exact at the end it was measured at, and should sends move the end across a
# segment meanwhile, the group refuses the entry (nothing stored) and the round is tried again, measured anew. Held
# to this slack too, a message the send path had stored was dropped, sent to the DLQ or discarded for 64 bytes.
ENTRY_SLACK_BYTES = 64


class EntrySize(NamedTuple):
    """What one encoded batch makes of a DLedger entry, prepared alone by the broker's state machine."""

    entry_bytes: int  # as ``encode_entry`` holds it to ``max_entry_bytes``
    index_entries: int  # IndexFile entries: one per UNIQ_KEY and per key of KEYS, 12 bytes each in the entry


def entry_size(store: MessageStore, batch: bytes) -> EntrySize:
    """``batch`` (encoded and valid) measured by the state machine's own build, not estimated: what
    ``CommitLogMachine.prepare_batch`` makes of it at the commit log's end (records, ConsumeQueue units, index
    entries), plus the entry header. A message's record is what the send limit bounds, but its keys cost 12
    bytes each on top (up to 6 times what they take in KEYS), so only this tells whether an append fits one entry.
    It builds the batch once more: for broker services' rounds, never on the send path."""
    built = store.prepare_append([(batch, batch_count(batch))], store.max_phy_offset, 0, {})
    return EntrySize(ENTRY_HEADER.size + len(encode_payload(built)), len(built.hint.index))


def entry_limit(node: BrokerNode) -> int:
    """The entry bytes a message appended alone may make (``alone_entry_bytes``): ``max_entry_bytes``, the limit
    the send path's entries are held to. Past it, the message can never be appended (as it now is)."""
    assert node.config.dledger is not None
    return node.config.dledger.max_entry_bytes


def entry_room(node: BrokerNode) -> int:
    """The entry bytes one append of a broker service may fill with two or more messages: a sum of their
    ``alone_entry_bytes`` up to this fits. The first message of an append is judged by ``entry_limit``."""
    return entry_limit(node) - ENTRY_SLACK_BYTES


def log_unexpected_round_failure(logger: logging.Logger, what: str, failures: int) -> None:
    """In the ``except Exception`` of a leader's background round (delivery, transaction checks, POP revive): a
    defect must not stop the broker (the task runs in the node's nursery, and every next leader would meet the same
    messages), so the round is logged, its traceback the first time only, and tried again backed off."""
    logger.log(logging.ERROR if failures == 1 else logging.WARNING, "%s round failed unexpectedly failures=%d",
               what, failures, exc_info=failures == 1)


def alone_entry_bytes(node: BrokerNode, message: MessageInput, *more: MessageInput) -> int:
    """The entry bytes ``message`` (with ``more``: the messages together) takes appended alone (``entry_size``);
    raises ``MessageFormatError`` as ``encode_batch`` does for a message that cannot be stored at all. A broker
    service that stores messages again (delivery, transaction checks, POP revive) sizes each append by the sum of
    these, never by record bytes."""
    batch = encode_batch([message, *more], node.store_host, max_message_size=node.max_message_size)
    return entry_size(node.store, batch).entry_bytes
