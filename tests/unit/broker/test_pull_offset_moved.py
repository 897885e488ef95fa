"""When PULL_MESSAGE may tell a consumer to move its offset: only a leader whose queues hold every acknowledged
message. A leader just elected has not applied (or dispatched) what the old one acknowledged; telling a consumer
beyond its queues' end to go back to 0 delivered the whole queue again (thousands of duplicates per failover once
the push consumer followed the correction)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from broker.filter import parse_tag_expression
from broker.processor.pull_message import PullMessageProcessor
from broker.store.results import GetMessageResult, GetMessageStatus
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode


def _node(result: GetMessageResult, *, leader: bool, complete: bool) -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(max_transfer_count=32, max_transfer_bytes=1 << 20, broker_name="broker-a"),
        store=SimpleNamespace(get_messages=lambda *a, **k: result),
        is_leader=lambda: leader, queues_complete=lambda: complete, broker_id=2)


def _pull(node: SimpleNamespace, offset: int):
    args = {"consumer_group": "cg", "topic": "T", "queue_id": 0, "queue_offset": offset, "max_msg_nums": 32,
            "sys_flag": 0, "commit_offset": -1, "suspend_timeout_millis": 0, "tag_filter": parse_tag_expression("*")}
    request = make_request(RequestCode.PULL_MESSAGE, {})
    response, _ = PullMessageProcessor(node)._pull(request, args, allow_suspend=False)  # type: ignore[arg-type]
    return response


BEYOND = GetMessageResult(GetMessageStatus.OFFSET_OVERFLOW_BADLY, 0, 0, 100)
EMPTY = GetMessageResult(GetMessageStatus.NO_MATCHED_LOGIC_QUEUE, 0, 0, 0)
TOO_SMALL = GetMessageResult(GetMessageStatus.OFFSET_TOO_SMALL, 50, 50, 100)


@pytest.mark.parametrize("result", [BEYOND, EMPTY], ids=["beyond-max", "no-queue-yet"])
def test_a_leader_whose_queues_are_incomplete_does_not_move_an_offset_beyond_the_end(result):
    r = _pull(_node(result, leader=True, complete=False), 5000)
    assert r.code == ResponseCode.PULL_RETRY_IMMEDIATELY, r.remark
    assert r.ext["next_begin_offset"] == 5000 and "still applying or dispatching" in r.remark

    # Once complete, the same answer is RocketMQ's correction: back to min_offset while it is 0.
    r = _pull(_node(result, leader=True, complete=True), 5000)
    assert r.code == ResponseCode.PULL_OFFSET_MOVED and r.ext["next_begin_offset"] == 0, r.remark


def test_an_offset_below_the_min_is_moved_by_any_leader_and_by_no_follower():
    r = _pull(_node(TOO_SMALL, leader=True, complete=False), 3)
    assert r.code == ResponseCode.PULL_OFFSET_MOVED and r.ext["next_begin_offset"] == 50
    r = _pull(_node(TOO_SMALL, leader=False, complete=False), 3)
    assert r.code == ResponseCode.PULL_RETRY_IMMEDIATELY and r.ext["suggest_which_broker_id"] == 0
