"""A signal that comes while ``run_until_signalled``'s ``main`` is still starting: held until the start is done (a
server), or, with ``stop_while_starting`` (``raftmq dev``), the start is cancelled at once: SIGINT ends as a Ctrl-C
(KeyboardInterrupt, the CLI's 130), SIGTERM with 0."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import trio

from raftmq.runner import run_until_signalled


@pytest.fixture(autouse=True)
def _restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def _slow_start(seen: list[str]):
    async def main(nursery: trio.Nursery) -> None:
        os.kill(os.getpid(), seen.pop())
        try:
            await trio.sleep(1)  # a start still going when the signal comes
            seen.append("started")
        except trio.Cancelled:
            seen.append("start cancelled")
            raise
    return main


def test_with_stop_while_starting_sigint_cancels_the_start_and_ends_as_a_ctrl_c():
    seen = [signal.SIGINT]
    with pytest.raises(KeyboardInterrupt):
        run_until_signalled(_slow_start(seen), stop_while_starting=True)
    assert seen == ["start cancelled"]


def test_with_stop_while_starting_sigterm_cancels_the_start_and_returns_0():
    seen = [signal.SIGTERM]
    assert run_until_signalled(_slow_start(seen), stop_while_starting=True) == 0
    assert seen == ["start cancelled"]


def test_without_it_the_signal_waits_for_the_start_to_finish():
    seen = [signal.SIGTERM]
    assert run_until_signalled(_slow_start(seen)) == 0
    assert seen == ["started"]
