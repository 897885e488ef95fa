"""raftmq.bench.common.machine_speed: the reference timings every bench report carries."""

from __future__ import annotations

import pytest

from raftmq.bench.common import machine_speed


@pytest.mark.parametrize("rounds", [1, 2, 15])
def test_machine_speed_gives_both_timings_in_microseconds(rounds):
    speed = machine_speed(rounds=rounds)
    assert set(speed) == {"copy_480k_us", "python_loop_us"}
    # A 480 KiB copy and a 1,000-step loop: microseconds, not seconds and not nothing.
    assert all(0 < value < 100_000 for value in speed.values()), speed


@pytest.mark.parametrize("rounds", [0, -1, 1.5, True, "3"])
def test_machine_speed_refuses_a_bad_round_count(rounds):
    with pytest.raises(ValueError, match="rounds must be a positive integer"):
        machine_speed(rounds=rounds)
