"""encode_single_batch and encode_uniform_batch write exactly the bytes encode_batch writes (the broker's single-send
fast path and the producer's send_batch)."""

import socket

from hypothesis import given
from hypothesis import strategies as st

from remoting.message import (MessageInput, check_topic, encode_batch, encode_properties, encode_single_batch,
                              encode_uniform_batch)

_I32 = st.integers(-(2 ** 31), 2 ** 31 - 1)
_props = st.dictionaries(st.text(alphabet="abcXYZ_é", min_size=1, max_size=8),
                         st.text(alphabet="abc 123é", max_size=12), max_size=4)


@given(topic=st.text(alphabet="abcXYZ09_-%|", min_size=1, max_size=127), queue_id=st.integers(0, 2 ** 31 - 1),
       body=st.binary(max_size=300), properties=_props, flag=_I32, sys_flag=_I32,
       born_timestamp=st.integers(0, 2 ** 63 - 1), born_port=st.integers(0, 65535),
       reconsume_times=st.integers(0, 2 ** 31 - 1), store_port=st.integers(0, 65535))
def test_same_bytes_as_encode_batch(topic: str, queue_id: int, body: bytes, properties: dict[str, str], flag: int,
                                    sys_flag: int, born_timestamp: int, born_port: int, reconsume_times: int,
                                    store_port: int) -> None:
    message = MessageInput(topic=topic, queue_id=queue_id, body=body, properties=properties, flag=flag,
                           sys_flag=sys_flag, born_timestamp=born_timestamp, born_host=("10.1.2.3", born_port),
                           reconsume_times=reconsume_times)
    expected = encode_batch([message], ("192.168.0.7", store_port))
    props = encode_properties(properties) if properties else b""
    got = encode_single_batch(check_topic(topic), queue_id, body, props, flag, sys_flag, born_timestamp,
                              socket.inet_aton("10.1.2.3"), born_port, reconsume_times,
                              socket.inet_aton("192.168.0.7"), store_port)
    assert got == expected


@given(topic=st.text(alphabet="abcXYZ09_-%|", min_size=1, max_size=127), queue_id=st.integers(0, 2 ** 31 - 1),
       messages=st.lists(st.tuples(st.binary(max_size=200), _props, _I32), min_size=1, max_size=6),
       born_timestamp=st.integers(0, 2 ** 63 - 1), port=st.integers(0, 65535))
def test_uniform_batch_same_bytes_as_encode_batch(topic: str, queue_id: int,
                                                  messages: list[tuple[bytes, dict[str, str], int]],
                                                  born_timestamp: int, port: int) -> None:
    """A producer's send_batch encoding (checked once, one pack per message) equals the checked encoder's."""
    host = ("10.1.2.3", port)
    expected = encode_batch([MessageInput(topic=topic, queue_id=queue_id, body=body, properties=props, flag=flag,
                                          born_timestamp=born_timestamp, born_host=host)
                             for body, props, flag in messages], host)
    items = [(body, encode_properties(props) if props else b"", flag) for body, props, flag in messages]
    packed = (socket.inet_aton(host[0]), port)
    assert encode_uniform_batch(check_topic(topic), queue_id, items, born_timestamp, packed, packed) == expected
