from __future__ import annotations

import os

import pytest

from raftmq import ports
from tests.procs import spawner


def pytest_configure(config: pytest.Config) -> None:
    # `make test` runs the suite in pytest-xdist workers. Each takes a slice of the free-port range of its own,
    # inherited by every process its tests start: two workers picking ports at the same moment could otherwise
    # be given the same one between one's check and its bind.
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count:
        # Twice as many slices as workers: one that replaces a crashed worker is numbered on (gw2 of 2) and takes
        # a slice no live worker has, for the first n replacements.
        slices = 2 * int(count)
        index = int(worker.removeprefix("gw")) % slices
        low, high = ports.port_range()
        size = (high - low + 1) // slices
        os.environ[ports.PORT_RANGE_ENV] = f"{low + index * size}-{low + (index + 1) * size - 1}"


def pytest_itemcollected(item: pytest.Item) -> None:
    # The load tests time what a loaded cluster does (failover gaps, catch-up): under `--dist loadgroup` they run
    # one after another in one worker, so no two of them share the 2 cores; the other worker runs the rest beside
    # them. Marked as each test is collected, before any pytest_collection_modifyitems: xdist reads the groups in
    # its own.
    if item.get_closest_marker("load") is not None and item.config.pluginmanager.hasplugin("xdist"):
        item.add_marker(pytest.mark.xdist_group("load"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    # xdist groups a test by rewriting its node id; where that stops working (a pytest it does not know), the
    # load tests would run two at a time without a word. Each fails instead, saying why.
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") \
            and "@" not in item.nodeid:
        pytest.fail("--dist loadgroup did not group this load test with the others: this pytest and pytest-xdist "
                    "do not work together (see pyproject.toml); run with TEST_WORKERS=0")


@pytest.fixture
def spawn(tmp_path):
    """``spawn(argv, **kw)`` starts a ``ServerProcess``; every process it started is stopped at teardown,
    pass or fail."""
    with spawner(tmp_path) as spawn_one:
        yield spawn_one


@pytest.fixture
def figure(request: pytest.FixtureRequest):
    """``figure(text)`` reports a measured figure (a failover gap, what a fault cost): the run lists every one
    at its end, under "figures", pass or fail. Printing would not do: output is captured, and under
    pytest-xdist a worker's is lost even with capturing off."""

    def _figure(text: str) -> None:
        request.node.user_properties.append(("figure", text.strip()))

    return _figure


def pytest_terminal_summary(terminalreporter) -> None:
    seen: dict[str, list[str]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, text in getattr(report, "user_properties", ()):
                if key == "figure" and text not in seen.setdefault(report.nodeid, []):
                    seen[report.nodeid].append(text)
    if seen:
        terminalreporter.section("figures")
        for nodeid in sorted(seen):
            terminalreporter.line(nodeid.removesuffix("@load"))  # the group xdist appends
            for text in seen[nodeid]:
                terminalreporter.line(f"    {text}")
