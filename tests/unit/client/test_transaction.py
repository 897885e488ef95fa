"""The pure parts of the transactional producer: the END_TRANSACTION ext and reading a broker's check."""

from __future__ import annotations

import pytest

from client import SendResult, SendStatus, TransactionSendResult, TransactionState
from client.filter import parse_subscription
from client.message import MessageQueue
from client.transaction import end_transaction_ext, read_check_request
from remoting.message import MessageInput, create_msg_id, encode_batch, encode_record, record_size


def _half_record(properties: dict[str, str], phy_offset: int = 4096) -> bytes:
    message = MessageInput("RMQ_SYS_TRANS_HALF_TOPIC", 0, b"order-7", properties, sys_flag=0x4,
                           born_timestamp=42, born_host=("127.0.0.1", 5))
    encode_batch([message], ("127.0.0.1", 1))  # the same checks the broker ran
    props = "".join(f"{k}\x01{v}\x02" for k, v in properties.items()).encode()
    buf = bytearray(record_size(len(message.body), len(message.topic), len(props)))
    encode_record(buf, 0, message, queue_offset=3, phy_offset=phy_offset, store_timestamp=43,
                  store_host=("127.0.0.1", 10911))
    return bytes(buf)


def test_end_transaction_ext_names_the_half_and_the_state_as_rocketmqs_flags():
    msg_id = create_msg_id(("127.0.0.1", 10911), 4096)
    for state, flag in ((TransactionState.COMMIT, 8), (TransactionState.ROLLBACK, 12), (TransactionState.UNKNOWN, 0)):
        ext = end_transaction_ext("g", "U-1", msg_id, 3, state, from_check=True)
        assert ext == {"producer_group": "g", "tran_state_table_offset": 3, "commit_log_offset": 4096,
                       "commit_or_rollback": flag, "from_transaction_check": True, "msg_id": msg_id,
                       "transaction_id": "U-1"}


def test_a_check_request_reads_as_the_message_its_consumers_would_get():
    props = {"TRAN_MSG": "true", "PGROUP": "g", "UNIQ_KEY": "U-7", "KEYS": "o-7", "REAL_TOPIC": "Orders",
             "REAL_QID": "2", "TRANSACTION_CHECK_TIMES": "1"}
    ext = {"producer_group": "g", "broker_name": "broker-a", "tran_state_table_offset": 3}
    group, broker_name, offset, msg = read_check_request(ext, _half_record(props))
    assert (group, broker_name, offset) == ("g", "broker-a", 3)
    assert (msg.topic, msg.queue_id, msg.body, msg.msg_id, msg.keys) == ("Orders", 2, b"order-7", "U-7", ["o-7"])
    assert msg.offset_msg_id == create_msg_id(("127.0.0.1", 10911), 4096) and msg.broker_name == "broker-a"
    bad = [({**ext, "producer_group": None}, props, "producer_group"),
           ({**ext, "producer_group": "a b"}, props, "producer_group"),
           ({**ext, "broker_name": ""}, props, "broker_name"),
           ({**ext, "tran_state_table_offset": -1}, props, "tran_state_table_offset"),
           ({**ext, "tran_state_table_offset": "3"}, props, "tran_state_table_offset"),
           (ext, {k: v for k, v in props.items() if k != "REAL_TOPIC"}, "real topic"),
           (ext, {**props, "REAL_QID": "x"}, "real topic")]
    for bad_ext, bad_props, needle in bad:
        with pytest.raises(ValueError, match=needle):
            read_check_request(bad_ext, _half_record(bad_props))
    with pytest.raises(ValueError, match="not a half message record"):
        read_check_request(ext, b"\x00" * 10)
    # A record no id can name: the check is dropped here, where the answer built for it raised MessageFormatError
    # in the producer's task group and stopped the producer.
    with pytest.raises(ValueError, match="cannot be named.*offset -1"):
        read_check_request(ext, _half_record(props, phy_offset=-1))


def test_a_transaction_send_result_is_a_send_result_with_the_local_state():
    mq = MessageQueue("Orders", "broker-a", 1)
    result = TransactionSendResult(SendStatus.SEND_OK, "U-1", "ABC", mq, 5, ("U-1",), TransactionState.COMMIT, "U-1")
    assert isinstance(result, SendResult) and result.local_transaction_state is TransactionState.COMMIT
    assert result.transaction_id == result.msg_id


def test_the_transaction_topics_cannot_be_subscribed_to():
    for topic in ("RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC"):
        with pytest.raises(ValueError, match="transaction records"):
            parse_subscription(topic, "*")
    assert parse_subscription("TRANS_CHECK_MAX_TIME_TOPIC", "*").topic == "TRANS_CHECK_MAX_TIME_TOPIC"
