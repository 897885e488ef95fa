"""DLedgerGroup.append_nowait: the callback form of append the broker's send path uses (no task per record)."""

from __future__ import annotations

import functools
from contextlib import AsyncExitStack

import pytest
import trio

from dledger import AppendTimeoutError, GroupBusyError, NotLeaderError, open_dledger_group
from tests.integration.dledger.helpers import (leader_alone, leader_cut_off, make_configs, open_groups, open_log,
                                               ready_leader, wait_ends)

pytestmark = pytest.mark.timeout(60)


async def test_callback_gets_index_and_result_once_committed(tmp_path):
    configs = make_configs(tmp_path)
    logs = [open_log(tmp_path, c.self_id) for c in configs]
    async with AsyncExitStack() as stack:
        groups = [await stack.enter_async_context(open_dledger_group(c, log)) for c, log in zip(configs, logs)]
        leader = await ready_leader(groups)
        done: list[tuple[int, int, object, object]] = []
        all_done = trio.Event()

        def on_done(i, pending):
            done.append((i, pending.index, pending.result, pending.error))
            if len(done) == 200:
                all_done.set()

        for i in range(200):
            leader.append_nowait(b"record-%05d" % i, lambda p, i=i: on_done(i, p))
        with trio.fail_after(10):
            await all_done.wait()
        assert sorted(i for i, *_ in done) == list(range(200))
        assert all(error is None and index > 0 for _, index, _, error in done)
        # Compared with the task form: same kind of result for the same kind of record.
        awaited = await leader.append(b"record-awaited")
        assert type(awaited.result) is type(done[0][2])
        follower = next(g for g in groups if g is not leader)
        with pytest.raises(NotLeaderError):
            follower.append_nowait(b"x", lambda p: None)
    for log in logs:
        log.close()


async def test_callback_reports_a_timeout_without_a_majority(tmp_path):
    async with trio.open_nursery() as nursery:
        leader, logs = await leader_alone(nursery, tmp_path)
        errors: list[BaseException | None] = []
        finished = trio.Event()

        def on_done(pending):
            errors.append(pending.error)
            finished.set()

        leader.append_nowait(b"no-majority", on_done, timeout_s=0.3)
        with trio.fail_after(3):
            await finished.wait()
        await trio.sleep(0.2)
        assert len(errors) == 1 and isinstance(errors[0], AppendTimeoutError)
        nursery.cancel_scope.cancel()
    for log in logs.values():
        log.close()


async def test_records_left_unproposed_past_max_queue_wait_are_answered_busy_and_never_proposed(tmp_path):
    """RocketMQ's waitTimeMillsInSendQueue: with the one in-flight slot held by an entry that cannot commit, the
    records behind it (one taken by the batcher, the rest still queued) are answered GroupBusyError once they have
    waited max_queue_wait_ms, long before their own timeout, and none of them reaches the Raft log; the
    proposed one still ends as an unknown outcome (AppendTimeoutError)."""
    async with trio.open_nursery() as nursery:
        leader, logs = await leader_alone(nursery, tmp_path, max_in_flight_batches=1, max_queue_wait_ms=300)
        member = leader.member
        outcomes: dict[str, tuple[BaseException | None, float]] = {}

        def on_done(name, pending):
            outcomes[name] = (pending.error, trio.current_time())

        started = trio.current_time()
        leader.append_nowait(b"in-flight", functools.partial(on_done, "in-flight"), timeout_s=2.5)
        assert leader.statistics().in_flight_batches == 1
        last_index = member._SyncObj__getCurrentLogIndex()
        leader.append_nowait(b"taken-by-the-batcher", functools.partial(on_done, "taken"), timeout_s=10)
        # The batcher takes it and waits for the slot. Polled rather than one fixed sleep: a loaded machine may
        # run the batcher late, and it must hold this record before the next ones are queued.
        with trio.fail_after(0.25):
            while leader.statistics().pending_records:
                await trio.sleep(0.005)
        for i in range(3):
            leader.append_nowait(b"queued-%d" % i, functools.partial(on_done, f"queued-{i}"), timeout_s=10)
        assert leader.statistics().pending_records == 3
        with trio.fail_after(3):
            while len(outcomes) < 4:
                await trio.sleep(0.01)
        assert set(outcomes) == {"taken", "queued-0", "queued-1", "queued-2"}
        for name, (error, at) in outcomes.items():
            assert isinstance(error, GroupBusyError) and error.retriable, (name, error)
            assert "max_queue_wait_ms" in str(error) and "not stored" in str(error)
            # Queue times are stamped with a clock the expiry task refreshes every 50 ms, so a record may be
            # stamped up to 50 ms early, and more when the task itself ran late (0.246 s once, in a fresh-clone
            # CI run: 54 ms). The lower bound still tells the 300 ms wait from none at all; the upper bound tells
            # it from the in-flight entry's timeout (2.5 s), with room for a loaded machine.
            assert 0.15 <= at - started < 2.0, (name, at - started)
        stats = leader.statistics()
        assert stats.busy_records == 4 and stats.pending_records == 0 and stats.in_flight_batches == 1
        assert member._SyncObj__getCurrentLogIndex() == last_index, "a record answered busy was proposed"
        with trio.fail_after(5):
            while "in-flight" not in outcomes:
                await trio.sleep(0.05)
        assert isinstance(outcomes["in-flight"][0], AppendTimeoutError)
        nursery.cancel_scope.cancel()
    for log in logs.values():
        log.close()


async def test_a_batch_waiting_for_a_slot_takes_the_records_queued_meanwhile(tmp_path):
    """The batcher holds a batch while the one slot is taken (the leader lost its followers); records queued after
    that join the held batch, so all of them commit in one entry once a follower is back, instead of the first
    in one entry and the rest in the next."""
    async with trio.open_nursery() as nursery:
        leader, runners, logs = await leader_cut_off(nursery, tmp_path, max_in_flight_batches=1,
                                                     leader_fallback_timeout_ms=8000, connection_timeout_ms=8000,
                                                     max_queue_wait_ms=8000)
        followers = [k for k in runners if k != leader.config.self_id]
        done: dict[str, object] = {}

        def on_done(name, pending):
            done[name] = pending

        leader.append_nowait(b"in-flight", functools.partial(on_done, "in-flight"), timeout_s=8)
        assert leader.statistics().in_flight_batches == 1
        leader.append_nowait(b"held", functools.partial(on_done, "held"), timeout_s=8)
        with trio.fail_after(2):
            while leader.statistics().pending_records:  # the batcher took it and waits for the slot
                await trio.sleep(0.005)
        for i in range(3):
            leader.append_nowait(b"queued-%d" % i, functools.partial(on_done, f"queued-{i}"), timeout_s=8)
        assert leader.statistics().pending_records == 3
        await runners[followers[0]].start()
        with trio.fail_after(6):
            while len(done) < 5:
                await trio.sleep(0.01)
        assert all(p.error is None for p in done.values()), {k: p.error for k, p in done.items()}
        assert done["in-flight"].index < done["held"].index
        assert {done[f"queued-{i}"].index for i in range(3)} == {done["held"].index}
        assert leader.statistics().pending_records == 0
        nursery.cancel_scope.cancel()
    for log in logs.values():
        log.close()


async def test_idle_group_proposes_at_once_and_answers_before_telling_followers(tmp_path):
    configs = make_configs(tmp_path, commit_notice_delay_ms=20)
    logs = [open_log(tmp_path, c.self_id) for c in configs]
    async with AsyncExitStack() as stack:
        groups = [await stack.enter_async_context(open_dledger_group(c, log)) for c, log in zip(configs, logs)]
        leader = await ready_leader(groups)
        followers = [g for g in groups if g is not leader]
        await leader.append(b"warm-up")
        await trio.sleep(0.05)  # the batcher is back to waiting for records
        seen = []
        answered = trio.Event()

        def on_done(pending):
            m = leader.member
            seen.append((pending.error, pending.index, m.raftCommitIndex, m.commit_notice_due,
                         [f.member.raftCommitIndex for f in followers]))
            answered.set()

        leader.append_nowait(b"one-at-a-time", on_done)
        # Proposed inside append_nowait: no task had to run for the entry to be in flight.
        assert leader.statistics().in_flight_batches == 1 and leader.statistics().pending_records == 0
        with trio.fail_after(5):
            await answered.wait()
        error, index, leader_commit, notice_due, follower_commits = seen[0]
        assert error is None and index == leader_commit
        # The caller was answered before the followers were sent the new commit index...
        assert notice_due and all(c < leader_commit for c in follower_commits)
        # ...which follows within commit_notice_delay_ms, and they apply the entry.
        with trio.fail_after(5):
            while any(f.member.raftCommitIndex < leader_commit for f in followers):
                await trio.sleep(0.005)
        await wait_ends(logs, leader.statistics().end_offset, timeout_s=5)
        assert not leader.member.commit_notice_due
        # The followers applied it and owe nobody a notice (their tick loops are not woken for one).
        assert not any(f.member.commit_notice_due for f in followers)
    for log in logs:
        log.close()


async def test_no_inline_tick_while_a_follower_is_sent_old_entries(tmp_path):
    """An idle group's append_nowait proposes and ticks right away (one-at-a-time latency), but not while a
    connected follower is still being sent older entries: that tick sends it a frame of them each round, and the
    broker's send path, which calls append_nowait while reading a connection, held the reader for the whole tick
    (0.4-0.5 s a send while a restarted follower caught up; sends of 2 s timed out in the cluster tests)."""
    async with AsyncExitStack() as stack:
        configs, logs, groups = await open_groups(stack, tmp_path)
        leader = await ready_leader(groups)
        await leader.append(b"first")
        inline = []  # per append_nowait call: whether it proposed (and ticked) before returning
        propose_now = leader._propose_now
        calling = []

        def spying_propose(batch):
            if calling:
                inline.append(member.followers_current())
            return propose_now(batch)

        def append_nowait(record, on_done):
            calling.append(True)
            try:
                leader.append_nowait(record, on_done)
            finally:
                calling.clear()

        member = leader.member
        leader._propose_now = spying_propose
        done = trio.Event()
        append_nowait(b"idle", lambda p: done.set())
        with trio.fail_after(5):
            await done.wait()
        assert inline == [True]  # the usual case: proposed and sent at once
        await trio.sleep(0.05)  # the batcher idle again, nothing in flight
        follower = next(iter(member._SyncObj__connectedNodes & member._SyncObj__otherNodes))
        member._SyncObj__raftNextIndex[follower] = 1  # as if it had just come back: everything is to be sent
        assert not member.followers_current()
        done = trio.Event()
        append_nowait(b"while-catching-up", lambda p: done.set())
        with trio.fail_after(5):
            await done.wait()
        assert inline == [True], inline  # left to the tick task
        del leader._propose_now
    for log in logs:
        log.close()
