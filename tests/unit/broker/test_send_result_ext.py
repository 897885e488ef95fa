"""The send answer's ext is spliced from parts encoded once (``send_result_ext``); it must be the very bytes
``cbor2.dumps`` writes for the map, and a frame carrying it must decode to that map."""

import cbor2
from hypothesis import given
from hypothesis import strategies as st

from broker.processor.send_message import send_result_ext
from remoting.codec import FrameDecoder, encode, make_request, make_response

_MSG_IDS = st.one_of(st.text(alphabet="0123456789ABCDEF", min_size=32, max_size=32),
                     st.lists(st.text(alphabet="0123456789ABCDEF", min_size=32, max_size=32), min_size=2,
                              max_size=40).map(",".join))


@given(_MSG_IDS, st.integers(0, 2 ** 31 - 1), st.integers(0, 2 ** 63 - 1))
def test_send_result_ext_is_what_cbor2_writes_for_the_map(msg_id, queue_id, queue_offset):
    fields = {"msg_id": msg_id, "queue_id": queue_id, "queue_offset": queue_offset, "region_id": "DefaultRegion",
              "trace_on": False}
    ext = send_result_ext(msg_id, queue_id, queue_offset)
    assert ext.cbor == cbor2.dumps(fields)
    assert dict(ext) == fields
    request = make_request(10, ext={"topic": "T"})
    request.opaque = 7
    decoder = FrameDecoder()
    decoder.feed(encode(make_response(request, 0, ext=ext)))
    frame = decoder.next_frame()
    assert frame.ext == fields and frame.opaque == 7
