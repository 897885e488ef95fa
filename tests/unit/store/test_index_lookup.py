"""IndexFile.lookup's walk of a key's chain: newest first, and no further back than the window (with a slack for a
store clock set back), so a key many records carry is not walked whole for an old window."""

from __future__ import annotations

from broker.store import index_file
from broker.store.index_file import CLOCK_BACK_SLACK_MS, IndexService, key_hash

HOUR_MS = 3_600_000
T0 = 1_700_000_000_000


class _CountingEntry:
    """INDEX_ENTRY, counting the entries a lookup reads."""

    def __init__(self, real):
        self.real = real
        self.size = real.size
        self.reads = 0

    def unpack_from(self, buffer, offset):
        self.reads += 1
        return self.real.unpack_from(buffer, offset)


def _service(tmp_path, batches):
    service = IndexService(tmp_path / "index", slots=8, max_entries=10_000)
    service.load(0)
    phy = 0
    for store_timestamp, count in batches:
        entries = [(key_hash("T", "order-1"), phy + i * 100) for i in range(count)]
        service.current(phy).put_many(entries, 0, store_timestamp)
        phy += count * 100
    service.write_headers()
    return service


def test_a_lookup_stops_at_the_first_entry_older_than_its_window(tmp_path, monkeypatch):
    # 1,000 records of one key an hour ago, 1,000 now.
    service = _service(tmp_path, [(T0, 1000), (T0 + HOUR_MS, 1000)])
    counting = _CountingEntry(index_file.INDEX_ENTRY)
    monkeypatch.setattr(index_file, "INDEX_ENTRY", counting)
    recent = list(service.query("T", "order-1", T0 + HOUR_MS, T0 + HOUR_MS + 999))
    assert len(recent) == 1000 and recent == sorted(recent, reverse=True)
    # The first old entry ends the walk: it read the 1,000 recent ones and one more, not the whole chain.
    assert counting.reads == 1001
    counting.reads = 0
    old = list(service.query("T", "order-1", T0, T0 + 999))
    assert len(old) == 1000 and counting.reads == 2000  # an old window still walks past the newer entries
    service.close()


def test_a_clock_set_back_by_less_than_the_slack_loses_no_entry(tmp_path):
    # A new leader's clock 30 s behind the last one's: its records are newer in the log and older in time, and the
    # walk goes on past them to the window's.
    behind = CLOCK_BACK_SLACK_MS // 2
    service = _service(tmp_path, [(T0, 10), (T0 + HOUR_MS, 10), (T0 + HOUR_MS - behind, 10)])
    window = list(service.query("T", "order-1", T0 + HOUR_MS, T0 + HOUR_MS + 999))
    assert window == [1900 - 100 * i for i in range(10)]  # the ten stored in the window, none of the first hour's
    service.close()
