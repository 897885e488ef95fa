"""The admin client's answers to bad arguments, against a name server and two in-process broker groups."""

from __future__ import annotations

import pytest
import trio

from client import open_admin
from remoting.errors import InvalidRequestError, TopicNotExistError
from tests.integration.broker.helpers import broker_configs, start_broker, start_namesrv


async def start_two_groups(nursery, tmp_path) -> str:
    """A name server and one-node groups broker-a and broker-b, both routed with a master; returns the name
    server's address."""
    namesrv = await start_namesrv(nursery)
    for group in ("broker-a", "broker-b"):
        (config,) = broker_configs(tmp_path / group, namesrv, **{"dledger.group": group})
        await start_broker(nursery, config)
    async with open_admin(namesrv) as admin:
        with trio.fail_after(10):
            while True:
                info = await admin.cluster_info()
                if info.master_addr("broker-a") and info.master_addr("broker-b"):
                    return namesrv
                await trio.sleep(0.05)


async def test_a_refusal_by_every_group_is_raised_as_itself_and_bad_numbers_name_themselves(nursery, tmp_path):
    """A command sent to every group at once raised the groups' refusals in an ExceptionGroup (found by probing
    the admin API with odd values): a caller catching InvalidRequestError missed it. Numbers of the wrong type
    failed on a comparison (TypeError: '<=' not supported)."""
    namesrv = await start_two_groups(nursery, tmp_path)
    async with open_admin(namesrv) as admin:
        with pytest.raises(InvalidRequestError, match="topic 'bad name' contains illegal characters") as info:
            await admin.create_topic("bad name")
        assert info.value.broker_name == "broker-a"
        assert "also from broker group(s) broker-b: " in "".join(getattr(info.value, "__notes__", []))
        with pytest.raises(TopicNotExistError, match="topic 'Nope' does not exist on broker broker-a"):
            await admin.delete_topic("Nope")
        with pytest.raises(InvalidRequestError, match="'consumer_group' 'bad group' contains illegal"):
            await admin.consume_stats("bad group")

        for call, text in [(admin.create_topic("T", read_queue_nums="8"), "read_queue_nums must be an integer "
                                                                           "within 1..1024, got '8'"),
                           (admin.create_topic("T", write_queue_nums=True), "got True"),
                           (admin.reset_offset("g", "T", "x"), "timestamp_ms must be an integer within 0.."),
                           (admin.query_message("T", "k", max_num=2.5), "max_num must be an integer within 1..64"),
                           (admin.query_message("T", "k", begin_ms=-1), "begin_ms must be an integer")]:
            with pytest.raises(ValueError, match=text):
                await call
        route = await admin.create_topic("T", read_queue_nums=2, write_queue_nums=2)
        assert route is not None and {q.broker_name for q in route.queue_datas} == {"broker-a", "broker-b"}


async def test_a_topic_on_some_groups_is_deleted_from_those_and_a_topic_on_none_is_refused(nursery, tmp_path):
    """A topic created on broker-b alone (or while broker-a was down): deleting it from every group failed with
    broker-a's TOPIC_NOT_EXIST, exit 1 from `raftmq admin delete-topic`, though broker-b had deleted it."""
    namesrv = await start_two_groups(nursery, tmp_path)
    async with open_admin(namesrv) as admin:
        route = await admin.create_topic("OnlyB", read_queue_nums=2, write_queue_nums=2, broker_names=["broker-b"])
        assert route is not None and [q.broker_name for q in route.queue_datas] == ["broker-b"]
        assert await admin.delete_topic("OnlyB") == ["broker-b"]
        with pytest.raises(TopicNotExistError, match="no route info"):
            await admin.get_route("OnlyB")
        with pytest.raises(TopicNotExistError, match="'OnlyB' does not exist on broker broker-a") as refused:
            await admin.delete_topic("OnlyB")
        assert "also from broker group(s) broker-b: " in "".join(getattr(refused.value, "__notes__", []))
