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
