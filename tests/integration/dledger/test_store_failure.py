"""A member whose state machine cannot apply a committed entry (a full disk) stops with ``MemberStoreError``: it
applies nothing after that entry and does not retry it on every tick. The other two go on committing, and the
member started again on its data catches up. A moment without file descriptors is waited out instead."""

from __future__ import annotations

import errno

import trio

from dledger import ByteLog, MemberStoreError, open_dledger_group
from remoting.errors import FatalServerError
from tests.integration.dledger.helpers import MemberRunner, make_configs, open_log, ready_leader, wait_ends


class FillingLog(ByteLog):
    """A ByteLog whose disk is full while ``full`` is set, and whose next ``out_of_descriptors`` applies find no
    free file descriptor."""

    full = False
    out_of_descriptors = 0
    failed_applies = 0

    def apply_batch(self, payload, store_timestamp, expected_start_offset):
        if self.full:
            self.failed_applies += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        if self.out_of_descriptors:
            self.out_of_descriptors -= 1
            self.failed_applies += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return super().apply_batch(payload, store_timestamp, expected_start_offset)


async def test_a_member_that_cannot_apply_an_entry_stops_and_the_others_go_on(tmp_path):
    configs = make_configs(tmp_path)
    victim_config = configs[2]
    victim_log = FillingLog(tmp_path / victim_config.self_id / "byte.log", segment_size_bytes=1 << 16)
    logs = {c.self_id: open_log(tmp_path, c.self_id) for c in configs[:2]} | {victim_config.self_id: victim_log}
    errors: list[BaseException] = []
    victim_done = trio.Event()

    async def run_victim(task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with open_dledger_group(victim_config, victim_log) as group:
                task_status.started(group)
                await trio.sleep_forever()
        except BaseExceptionGroup as group_error:
            errors.append(group_error)
        finally:
            victim_done.set()

    async with trio.open_nursery() as nursery:
        runners = [MemberRunner(nursery, c, logs[c.self_id]) for c in configs[:2]]
        groups = [await r.start() for r in runners]
        victim = await nursery.start(run_victim)
        leader = await ready_leader([*groups, victim])
        if leader is victim:
            await victim.transfer_leadership(configs[0].self_id)
            leader = await ready_leader(groups)
        await leader.append(b"before")
        await wait_ends(logs.values(), logs[leader.config.self_id].end_offset)

        victim_log.out_of_descriptors = 3  # a moment without descriptors: waited out, not a reason to stop
        await leader.append(b"applied on the fourth try")
        await wait_ends(logs.values(), logs[leader.config.self_id].end_offset)
        assert victim_log.failed_applies == 3 and not victim_done.is_set()

        victim_log.failed_applies = 0
        victim_log.full = True
        result = await leader.append(b"committed by the other two")
        with trio.fail_after(10):
            await victim_done.wait()
        await trio.sleep(0.5)  # many ticks' worth: a member that retried would have tried again
        assert victim_log.failed_applies == 1
        fatal, rest = errors[0].split(MemberStoreError)
        assert rest is None and fatal is not None
        error = fatal.exceptions[0]
        assert isinstance(error, FatalServerError) and isinstance(error.error, OSError)
        assert f"apply committed entry {result.index}" in str(error) and "No space left on device" in str(error)

        await leader.append(b"after")  # a majority is left
        end = logs[leader.config.self_id].end_offset

        victim_log.close()
        restarted_log = open_log(tmp_path, victim_config.self_id)
        logs[victim_config.self_id] = restarted_log
        await MemberRunner(nursery, victim_config, restarted_log).start()
        await wait_ends(logs.values(), end)
        assert restarted_log.read_raw(0, end) == logs[leader.config.self_id].read_raw(0, end)
        nursery.cancel_scope.cancel()
    for log in logs.values():
        log.close()
