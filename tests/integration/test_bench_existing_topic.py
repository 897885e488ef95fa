"""``raftmq bench produce`` / ``consume`` with ``--topic`` naming a topic that exists: measured as it is. The bench
created it again whatever it was, through UPDATE_AND_CREATE_TOPIC with ``--queues`` queues, read-write and
unordered: a read-only topic took the bench's messages, and the messages in queues past ``--queues`` were left to
no consumer (found by review)."""

from __future__ import annotations

import pytest

from client import open_admin
from raftmq.bench.common import BenchError
from raftmq.bench.produce import ensure_topic
from tests.integration.broker.helpers import start_leading_node


async def test_an_existing_topic_is_left_as_it_is(nursery, tmp_path):
    namesrv, _addr = await start_leading_node(nursery, tmp_path)
    async with open_admin(namesrv) as admin:
        await admin.create_topic("Kept", read_queue_nums=16, write_queue_nums=16, order=True)
        await ensure_topic(namesrv, "Kept", 8)
        (queues,) = (await admin.get_route("Kept")).queue_datas
        assert (queues.read_queue_nums, queues.write_queue_nums, queues.perm) == (16, 16, 6)
        # A topic the bench creates gets --queues.
        await ensure_topic(namesrv, "Fresh", 8)
        (queues,) = (await admin.get_route("Fresh")).queue_datas
        assert (queues.read_queue_nums, queues.write_queue_nums) == (8, 8)


async def test_an_existing_topic_that_takes_no_sends_is_refused_not_made_writable(nursery, tmp_path):
    namesrv, _addr = await start_leading_node(nursery, tmp_path)
    async with open_admin(namesrv) as admin:
        await admin.create_topic("ReadOnly", read_queue_nums=4, write_queue_nums=4, perm=4)
        with pytest.raises(BenchError, match="exists and takes no sends"):
            await ensure_topic(namesrv, "ReadOnly", 8)
        (queues,) = (await admin.get_route("ReadOnly")).queue_datas
        assert queues.perm == 4
