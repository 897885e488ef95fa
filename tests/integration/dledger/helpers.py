"""In-process 3-member groups on 127.0.0.1 for the dledger integration tests."""

from __future__ import annotations

from pathlib import Path

from dledger import ByteLog, DLedgerConfig, MemberAddress
from tests.procs import free_port

SECRET = "integration-test-secret-0123456789"


def make_configs(tmp_path: Path, n: int = 3, **overrides) -> list[DLedgerConfig]:
    members = tuple(MemberAddress(id=f"n{i}", raft_address=f"127.0.0.1:{free_port()}",
                                  service_address=f"127.0.0.1:{free_port()}") for i in range(n))
    base = dict(election_timeout_min_ms=200, election_timeout_max_ms=500, heartbeat_interval_ms=40,
                connection_timeout_ms=1000, leader_fallback_timeout_ms=1000)
    base.update(overrides)
    return [DLedgerConfig(group="g", self_id=m.id, members=members, secret=SECRET, data_dir=tmp_path / m.id,
                          **base) for m in members]


def open_log(tmp_path: Path, member_id: str) -> ByteLog:
    return ByteLog(tmp_path / member_id / "byte.log", segment_size_bytes=1 << 16)


async def open_groups(stack, tmp_path: Path, **overrides):
    """A started 3-member group entered on ``stack`` (an ``AsyncExitStack``): ``(configs, logs, groups)``; the
    caller closes the logs after the stack."""
    from dledger import open_dledger_group

    configs = make_configs(tmp_path, **overrides)
    logs = [open_log(tmp_path, c.self_id) for c in configs]
    groups = [await stack.enter_async_context(open_dledger_group(c, log)) for c, log in zip(configs, logs)]
    return configs, logs, groups


async def ready_leader(groups):
    """The one leader among ``groups`` once it may propose (10 s at most)."""
    import trio

    with trio.fail_after(10):
        while True:
            leaders = [g for g in groups if g.is_leader]
            if len(leaders) == 1:
                await leaders[0].wait_ready_leader()
                return leaders[0]
            await trio.sleep(0.02)


async def wait_ends(logs, end: int, timeout_s: float = 20.0) -> None:
    """Wait until every log ends at ``end``."""
    import trio

    with trio.fail_after(timeout_s):
        while any(log.end_offset != end for log in logs):
            await trio.sleep(0.02)


async def leader_alone(nursery, tmp_path: Path, **overrides):
    """A group whose leader committed one record and then lost both followers: ``(leader, logs by id)``."""
    leader, _runners, logs = await leader_cut_off(nursery, tmp_path, **overrides)
    return leader, logs


async def leader_cut_off(nursery, tmp_path: Path, **overrides):
    """``leader_alone`` with the members' runners too, ``(leader, runners by id, logs by id)``: a test can start a
    follower again to give the leader back its majority."""
    overrides = {"leader_fallback_timeout_ms": 5000, "connection_timeout_ms": 5000, **overrides}
    configs = {c.self_id: c for c in make_configs(tmp_path, **overrides)}
    logs = {k: open_log(tmp_path, k) for k in configs}
    runners = {k: MemberRunner(nursery, c, logs[k]) for k, c in configs.items()}
    groups = {k: await r.start() for k, r in runners.items()}
    leader = await ready_leader(list(groups.values()))
    await leader.append(b"with-majority")
    for k, runner in runners.items():
        if k != leader.config.self_id:
            await runner.stop()
    return leader, runners, logs


class MemberRunner:
    """Runs one member in its own task so it can be stopped and restarted alone (nurseries must nest)."""

    def __init__(self, nursery, config, state_machine, **kw) -> None:
        self.nursery, self.config, self.state_machine, self.kw = nursery, config, state_machine, kw
        self.group = None
        self._scope = None
        self._stopped = None

    async def start(self):
        import trio

        from dledger import open_dledger_group

        self._stopped = trio.Event()

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            try:
                with trio.CancelScope() as scope:
                    self._scope = scope
                    async with open_dledger_group(self.config, self.state_machine, **self.kw) as group:
                        task_status.started(group)
                        await trio.sleep_forever()
            finally:
                self._stopped.set()

        self.group = await self.nursery.start(run)
        return self.group

    async def stop(self):
        self._scope.cancel()
        await self._stopped.wait()
