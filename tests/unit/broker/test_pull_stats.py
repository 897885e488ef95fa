from __future__ import annotations

from broker.pull_stats import PullStats


def test_consume_tps_is_the_last_minute_of_pulls_over_the_time_it_spans():
    now = [1000.0]
    stats = PullStats(clock=lambda: now[0])
    assert stats.tps("g", "T") == 0.0
    stats.add("g", "T", 50, 5000)
    now[0] += 0.5
    assert stats.tps("g", "T") == 50.0  # a group that just started: over at least one second
    for _ in range(12):  # 120 messages a second, one add per second, for 12 s
        now[0] += 1.0
        stats.add("g", "T", 120, 12000)
    assert abs(stats.tps("g", "T") - (50 + 12 * 120) / 12.5) < 1e-9
    stats.add("g", "U", 7, 700)
    assert stats.tps("g", "U") == 7.0 and stats.tps("h", "T") == 0.0
    now[0] += 55.0  # the buckets that began less than a minute ago still count, older ones not
    assert 0 < stats.tps("g", "T") < 120
    now[0] += 80.0
    assert stats.tps("g", "T") == 0.0
    stats.prune()
    assert stats.tps("g", "T") == 0.0 and not stats._buckets
    # The totals behind the metrics' counters outlive the window and the prune: a counter never goes back.
    assert stats.totals() == {("g", "T"): (50 + 12 * 120, (50 + 12 * 120) * 100), ("g", "U"): (7, 700)}


def test_a_steady_rate_reads_steady_as_buckets_leave_the_minute():
    # A bucket that began 60 s ago leaves the window whole; divided by a full minute, what was left read up to 1/6
    # low (8.35 for 10 msgs/s), in a 10-second saw-tooth.
    now = [0.0]
    stats = PullStats(clock=lambda: now[0])
    readings = []
    for tick in range(1, 1500):  # one message every 0.1 s for 150 s
        now[0] = tick / 10
        stats.add("g", "T", 1, 100)
        if tick >= 600:
            readings.append(stats.tps("g", "T"))
    assert min(readings) > 9.8 and max(readings) < 10.2, (min(readings), max(readings))
