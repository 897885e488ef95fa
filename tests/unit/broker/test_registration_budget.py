"""The registration body's size, kept by the topic table without encoding it, and the frame room around the body."""

from __future__ import annotations

import logging

import hypothesis.strategies as st
from hypothesis import given

from broker.registration import (REGISTRATION_HEADROOM_BYTES, RegistrationService, RegistrationSnapshot,
                                 registration_body_budget)
from broker.topic_config import (MAX_QUEUE_NUMS, PERM_READ, SYS_FLAG_MAX, TOPIC_MAX_LENGTH, TopicConfig,
                                 TopicConfigTable, registration_entry_size)
from remoting.codec import encode, make_request
from remoting.codes import RequestCode
from remoting.config import NAME_MAX_LENGTH

_configs = st.builds(
    TopicConfig,
    topic_name=st.text("abcXYZ019_-%|", min_size=1, max_size=TOPIC_MAX_LENGTH),
    read_queue_nums=st.integers(1, MAX_QUEUE_NUMS), write_queue_nums=st.integers(1, MAX_QUEUE_NUMS),
    perm=st.integers(0, 15), topic_sys_flag=st.integers(0, SYS_FLAG_MAX), order=st.booleans())


def _snapshot(table: TopicConfigTable, permission: int = 6) -> RegistrationSnapshot:
    topics, _problems = table.registration_topics()
    return RegistrationSnapshot("DefaultCluster", "broker-a", 1, "127.0.0.1:10911", "LEADER", 1,
                                table.data_version, topics, 120_000, broker_permission=permission)


@given(st.lists(_configs, max_size=40), st.lists(st.integers(0, 39), max_size=10), st.sampled_from([2, 4, 6]))
def test_the_table_knows_its_registration_body_size_through_creates_updates_and_deletes(configs, drops, permission):
    table = TopicConfigTable()
    for config in configs:
        predicted = table.registration_body_bytes_with(config)
        table.apply_update(config)
        assert table.registration_body_bytes == predicted == len(_snapshot(table, permission).body())
    for i in drops:
        if i < len(configs):
            table.apply_delete(configs[i].topic_name)
            assert table.registration_body_bytes == len(_snapshot(table, permission).body())
    restored = TopicConfigTable()
    restored.restore(table.snapshot())
    assert restored.registration_body_bytes == len(_snapshot(restored, permission).body())


def test_a_topic_left_out_of_registrations_counts_no_bytes_and_each_entry_counts_its_own():
    # Stored by an older version (a name a name server refuses): not registered, so not in the size either.
    table = TopicConfigTable()
    table.apply_stored(1, {"Bad\n": {"topic_name": "Bad\n"}, "Good": {"topic_name": "Good"}}, ())
    assert list(table.registration_topics()[0]) == ["Good"]
    assert table.registration_body_bytes == len(_snapshot(table).body())
    assert table.registration_body_bytes_with(TopicConfig("Bad\n")) == table.registration_body_bytes
    fixed = table.registration_body_bytes_with(TopicConfig("Bad\n".strip()))
    assert fixed == table.registration_body_bytes + registration_entry_size(TopicConfig("Bad"))
    # Counts in the thousands cross the CBOR map head's sizes (1, 2, 3 bytes).
    for n in (23, 24, 255, 256, 70_000):
        big = TopicConfigTable(TopicConfig(f"T{i}") for i in range(n))
        assert big.registration_body_bytes == len(_snapshot(big).body()), n


def test_the_rest_of_a_registration_frame_fits_the_headroom():
    # Every ext field at its largest: names of the longest legal length, a long address, 64-bit integers.
    name = "n" * NAME_MAX_LENGTH
    snap = RegistrationSnapshot(name, name, 2 ** 63 - 1, "255.255.255.255:65535", "CANDIDATE", 2 ** 63 - 1,
                                2 ** 63 - 1, {}, 86_400_000, broker_permission=PERM_READ)
    ext = snap.ext()
    ext["registration_sequence"] = 2 ** 63 - 1
    body = b"x" * 1000
    request = make_request(RequestCode.REGISTER_BROKER, ext=ext, body=body)
    request.opaque = 2 ** 31 - 1
    frame = encode(request)
    assert len(frame) - len(body) <= REGISTRATION_HEADROOM_BYTES // 2, len(frame) - len(body)
    assert registration_body_budget(16 << 20) == (16 << 20) - REGISTRATION_HEADROOM_BYTES


class _Refusing:
    async def invoke(self, addr, request, timeout_s=3.0):
        raise AssertionError("not called")

    def connections(self) -> dict:
        return {}


def test_a_body_past_the_budget_is_warned_of_once_as_it_goes_past(caplog):
    table = TopicConfigTable(TopicConfig(f"T{i}") for i in range(10))
    budget = table.registration_body_bytes
    service = RegistrationService(_Refusing(), ("127.0.0.1:9876",), lambda: _snapshot(table), interval_ms=30_000,
                                  timeout_ms=3_000, max_body_bytes=budget)
    with caplog.at_level(logging.INFO, logger="broker.registration"):
        assert len(service._body_of(_snapshot(table))) == budget
        table.apply_update(TopicConfig("Over"))
        service._body_of(_snapshot(table))
        table.apply_update(TopicConfig("Over2"))
        service._body_of(_snapshot(table))
        table.apply_delete("Over")
        table.apply_delete("Over2")
        service._body_of(_snapshot(table))
    messages = [r.getMessage() for r in caplog.records]
    over = [m for m in messages if "over its budget" in m]
    assert len(over) == 1 and f"budget of {budget}" in over[0] and "still sent" in over[0], messages
    assert any("within its budget" in m for m in messages), messages
