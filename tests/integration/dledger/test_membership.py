"""Membership change one member at a time: remove a follower, keep committing with two, add it back."""

from __future__ import annotations

import pytest
import trio

import dledger
from dledger import MembershipChangeError
from tests.integration.dledger.helpers import MemberRunner, make_configs, open_log, ready_leader

pytestmark = pytest.mark.timeout(60)


def test_public_api_is_pinned():
    assert set(dledger.__all__) >= {"open_dledger_group", "DLedgerGroup", "DLedgerConfig", "MemberAddress",
                                    "StateMachine", "BatchResult", "ApplyStatus", "AppendResult", "Role",
                                    "RoleChange", "DLedgerStatistics", "ByteLog", "NotLeaderError"}
    for name in dledger.__all__:
        assert hasattr(dledger, name), name


async def test_add_a_fourth_member_then_remove_it(tmp_path):
    four = make_configs(tmp_path, n=4)
    first_three = tuple(m for m in four[0].members if m.id != "n3")
    configs = {c.self_id: c.replace(members=first_three) for c in four[:3]}
    newcomer_cfg = four[3]  # knows all four members
    newcomer = newcomer_cfg.self_member
    logs = {c.self_id: open_log(tmp_path, c.self_id) for c in four}
    async with trio.open_nursery() as nursery:
        runners = {k: MemberRunner(nursery, c, logs[k]) for k, c in configs.items()}
        groups = {k: await r.start() for k, r in runners.items()}
        leader = await ready_leader(list(groups.values()))
        await leader.append(b"before-join")
        with pytest.raises(MembershipChangeError):
            await leader.remove_member(leader.config.self_id)
        await leader.add_member(newcomer)
        runner4 = MemberRunner(nursery, newcomer_cfg, logs["n3"])
        g4 = await runner4.start()
        await leader.append(b"after-join")
        end = leader.statistics().end_offset
        with trio.fail_after(10):
            while logs["n3"].end_offset != end:
                await trio.sleep(0.05)
        assert leader.member_address("n3") == newcomer
        assert g4.metadata("dledger.members")["n3"] == [newcomer.raft_address, newcomer.service_address]
        await leader.remove_member("n3")
        await runner4.stop()
        await leader.append(b"after-leave")
        assert leader.member_address("n3") is None
        nursery.cancel_scope.cancel()
    assert logs["n3"].path.read_bytes() == logs["n0"].path.read_bytes()[:logs["n3"].end_offset]
    for log in logs.values():
        log.close()
