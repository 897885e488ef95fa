"""A message's keys read the same on the client as the store indexes them (empty pieces dropped)."""

from __future__ import annotations

import pytest

from client import MessageExt
from remoting.message import split_keys


@pytest.mark.parametrize("raw, keys", [
    (None, []), ("", []), ("order-1", ["order-1"]), ("a b", ["a", "b"]), ("a  b ", ["a", "b"]), ("  ", []),
])
def test_split_keys(raw, keys):
    assert split_keys(raw) == keys


def test_client_message_keys_match_the_index():
    msg = MessageExt(topic="T", body=b"", queue_id=0, queue_offset=0, broker_name="broker-a",
                     properties={"KEYS": "k1  k2"}, phy_offset=0, born_timestamp=0, store_timestamp=0,
                     store_host=("127.0.0.1", 10911))
    assert msg.keys == ["k1", "k2"] == split_keys("k1  k2")
