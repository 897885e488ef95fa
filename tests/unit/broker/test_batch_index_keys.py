"""What the send path counts of a batch before the leader builds its entry, against what the state machine builds.

A batch whose DLedger entry cannot fit ``max_entry_bytes``, or that holds too many index keys, is refused from its
bytes alone (``broker/processor/send_message.py``): the leader used to build the entry (0.5 s for 960,064 keys, on
the thread that ticks Raft) before it learnt so. The counts must be the build's own: ``batch_index_keys`` the index
entries ``prepare_batch`` makes (one per non-empty UNIQ_KEY and per non-empty key of KEYS), ``least_entry_bytes``
the entry's bytes when it crosses no segment end, and half of ``scan_producer_batch``'s properties bytes a bound on
the keys.
"""

from __future__ import annotations

import pytest

from broker.commit_log_machine import least_entry_bytes
from broker.service_rounds import entry_size
from broker.store import MessageStore
from remoting.message import MessageInput, batch_index_keys, encode_batch, scan_producer_batch
from tests.unit.store.helpers import small_config

HOST = ("10.0.0.7", 10911)
TOPIC = "IndexKeysT"

# Property blocks whose index keys the store counts in its own way: empty pieces of KEYS, names that end in KEYS
# or UNIQ_KEY, an empty UNIQ_KEY, the pairs in either order, and keys of every length.
BLOCKS = [
    {},
    {"TAGS": "t"},
    {"UNIQ_KEY": "U-1"},
    {"UNIQ_KEY": ""},
    {"KEYS": ""},
    {"KEYS": " "},
    {"KEYS": "a"},
    {"KEYS": "a b c"},
    {"KEYS": " a  b c "},
    {"KEYS": "   "},
    {"KEYS": "order-1 order-2", "UNIQ_KEY": "U-2", "TAGS": "t"},
    {"TAGS": "t", "UNIQ_KEY": "U-3", "KEYS": "x"},
    {"MYKEYS": "a b c", "XUNIQ_KEY": "u"},
    {"MYKEYS": "a b c", "KEYS": "d e", "XUNIQ_KEY": "u", "UNIQ_KEY": "v"},
    {"KEYS": "k " * 700, "UNIQ_KEY": "U-4"},
    {"KEYS": " ".join("k%d" % i for i in range(300))},
]


@pytest.fixture
def store(tmp_path):
    with MessageStore.open(small_config(tmp_path / "store")) as s:
        yield s


@pytest.mark.parametrize("properties", BLOCKS, ids=[repr(b)[:40] for b in BLOCKS])
@pytest.mark.parametrize("count", [1, 3])
def test_the_counts_from_the_bytes_are_the_built_entry_s(store, properties, count):
    batch = encode_batch([MessageInput(TOPIC, 0, b"body-%d" % i, properties) for i in range(count)], HOST)
    built = entry_size(store, batch)  # prepare_batch's own build, plus the entry header
    assert batch_index_keys(batch) == built.index_entries
    assert least_entry_bytes(len(batch), count, len(TOPIC), built.index_entries) == built.entry_bytes
    n, _, properties_bytes = scan_producer_batch(batch, topic=TOPIC.encode(), queue_id=0)
    assert n == count and properties_bytes // 2 >= built.index_entries


def test_the_most_keys_one_message_holds_are_bounded_by_half_its_properties(store):
    # One-character keys fill 32 KiB of properties with the most keys a message can hold.
    keys = " ".join("k" for _ in range(16_381))
    batch = encode_batch([MessageInput(TOPIC, 0, b"b", {"KEYS": keys})], HOST)
    assert batch_index_keys(batch) == entry_size(store, batch).index_entries == 16_381
    assert scan_producer_batch(batch)[2] // 2 >= 16_381
