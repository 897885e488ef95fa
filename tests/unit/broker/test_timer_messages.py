"""Timer messages (RocketMQ 5's deliver time) on the delay levels: the level a message hops to, the broker's reading
and refusals of the timer properties, and the client's ``Message`` fields."""

from __future__ import annotations

import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.config import BrokerConfig
from broker.delay_level import DEFAULT_MESSAGE_DELAY_LEVEL, parse_delay_levels, timer_level
from broker.processor.base import RequestRejected
from broker.schedule import ScheduleMessageService, schedule_properties, timer_deliver_ms, timer_property
from client.message import Message
from remoting.codes import ResponseCode
from remoting.message import MessageFormatError

DEFAULT_LEVELS = parse_delay_levels(DEFAULT_MESSAGE_DELAY_LEVEL)
# timer_max_delay_sec's default, RocketMQ's timerMaxDelaySec: 3 days.
TIMER_MAX_DELAY_MS = BrokerConfig.__dataclass_fields__["timer_max_delay_sec"].default * 1000
NOW = 1_700_000_000_000


def _hops(levels: tuple[int, ...], remaining_ms: int) -> tuple[int, int]:
    """(hops, ms late) of a message due in ``remaining_ms``, each level waited exactly."""
    waited = hops = 0
    while waited < remaining_ms:
        waited += levels[timer_level(levels, remaining_ms - waited) - 1]
        hops += 1
    return hops, waited - remaining_ms


def test_a_timer_message_waits_in_the_longest_level_not_past_its_time_else_the_shortest():
    assert [timer_level(DEFAULT_LEVELS, ms) for ms in (1000, 2500, 4999, 5000, 7000, 12_000, 59_999)] == \
        [1, 1, 1, 2, 2, 3, 4]
    assert timer_level(DEFAULT_LEVELS, 2 * 3_600_000) == timer_level(DEFAULT_LEVELS, 3 * 86_400_000) == 18
    # Less left than the shortest level: that level, the least it can arrive late (never early).
    assert timer_level(DEFAULT_LEVELS, 1) == timer_level(DEFAULT_LEVELS, 999) == 1
    # Levels in any order, duplicates to the first.
    assert [timer_level((5000, 1000, 1000, 300), ms) for ms in (100, 300, 999, 1000, 4999, 6000)] == \
        [4, 4, 4, 2, 2, 1]
    with pytest.raises(ValueError, match="at least one"):
        timer_level((), 5)


def test_the_hops_of_the_messages_the_end_to_end_test_sends_and_of_the_longest_allowed_wait():
    # 2.5 s: 1 s, 1 s, then 1 s for the half second left; 7 s: 5 s, 1 s, 1 s; 12 s: 10 s, 1 s, 1 s.
    assert _hops(DEFAULT_LEVELS, 2500) == (3, 500)
    assert _hops(DEFAULT_LEVELS, 7000) == (3, 0)
    assert _hops(DEFAULT_LEVELS, 12_000) == (3, 0)
    # 3 days: 36 hops of 2 h, as the docs say.
    assert _hops(DEFAULT_LEVELS, TIMER_MAX_DELAY_MS) == (36, 0)
    hops, late = _hops(DEFAULT_LEVELS, TIMER_MAX_DELAY_MS - 1)
    assert 36 <= hops <= 36 + 20 and late == 1


@st.composite
def _levels_and_wait(draw) -> tuple[tuple[int, ...], int]:
    # Levels as configs have them (each at most 10 times the one before, here shuffled), and waits up to 40 of
    # the longest: so a walk takes at most a few hundred hops.
    levels = [draw(st.integers(min_value=1, max_value=2000))]
    for _ in range(draw(st.integers(min_value=0, max_value=17))):
        levels.append(levels[-1] * draw(st.integers(min_value=1, max_value=10)))
    levels = draw(st.permutations(levels))
    return tuple(levels), draw(st.integers(min_value=1, max_value=40 * max(levels)))


@given(_levels_and_wait())
def test_hops_never_deliver_early_and_at_most_the_shortest_level_late(levels_and_wait):
    levels, remaining_ms = levels_and_wait
    hops, late = _hops(levels, remaining_ms)
    assert 0 <= late < min(levels)


def test_the_timer_properties_are_read_as_rocketmq_reads_them_and_bad_values_are_named():
    assert timer_deliver_ms({"a": "b"}, NOW) is None and timer_property({"DELAY": "3"}) is None
    assert timer_deliver_ms({"TIMER_DELIVER_MS": "1700000005000"}, NOW) == NOW + 5000
    assert timer_deliver_ms({"TIMER_DELAY_MS": "2500"}, NOW) == NOW + 2500
    assert timer_deliver_ms({"TIMER_DELAY_SEC": "7"}, NOW) == NOW + 7000
    # RocketMQ's order: seconds, then ms, then the absolute time.
    both = {"TIMER_DELIVER_MS": "5", "TIMER_DELAY_MS": "100", "TIMER_DELAY_SEC": "2"}
    assert timer_property(both) == "TIMER_DELAY_SEC" and timer_deliver_ms(both, NOW) == NOW + 2000
    for name in ("TIMER_DELIVER_MS", "TIMER_DELAY_MS", "TIMER_DELAY_SEC"):
        for bad in ("", "-1", "1.5", "12a", " 1", "\u0661", "1" * 19, 5):
            with pytest.raises(ValueError, match=f"property '{name}' must be .*got {bad!r}"):
                timer_deliver_ms({name: bad}, NOW)


def _service(levels: str = DEFAULT_MESSAGE_DELAY_LEVEL,
             max_delay_s: int = TIMER_MAX_DELAY_MS // 1000) -> ScheduleMessageService:
    # The send side only reads the node's config.
    node = types.SimpleNamespace(config=types.SimpleNamespace(timer_max_delay_sec=max_delay_s))
    return ScheduleMessageService(node, parse_delay_levels(levels))  # type: ignore[arg-type]


def test_a_timer_message_is_parked_in_its_first_level_with_its_time_absolute_and_its_destination():
    service = _service()
    props = {"KEYS": "k", "UNIQ_KEY": "U1", "TIMER_DELIVER_MS": str(NOW + 12_000)}
    topic, queue_id, stored = service.redirect_timer("T", 3, props, NOW)
    assert (topic, queue_id) == ("SCHEDULE_TOPIC_XXXX", 2)  # level 3, 10 s
    assert stored == {**props, "DELAY": "3", "REAL_TOPIC": "T", "REAL_QID": "3"}
    # A relative time becomes the absolute one, read on the broker's clock at receipt.
    topic, queue_id, stored = service.redirect_timer("T", 0, {"TIMER_DELAY_SEC": "7", "n": "1"}, NOW)
    assert (topic, queue_id) == ("SCHEDULE_TOPIC_XXXX", 1)
    assert stored == {"n": "1", "TIMER_DELIVER_MS": str(NOW + 7000), "DELAY": "2", "REAL_TOPIC": "T", "REAL_QID": "0"}
    topic, queue_id, stored = service.redirect_timer("T", 0, {"TIMER_DELAY_MS": "300"}, NOW)
    assert (topic, queue_id, stored["DELAY"]) == ("SCHEDULE_TOPIC_XXXX", 0, "1")  # less than 1 s: the 1 s level
    # Up to the limit, exactly.
    topic, _, stored = service.redirect_timer("T", 0, {"TIMER_DELIVER_MS": str(NOW + TIMER_MAX_DELAY_MS)}, NOW)
    assert topic == "SCHEDULE_TOPIC_XXXX" and stored["DELAY"] == "18"


def test_a_timer_message_whose_time_has_come_is_stored_at_once_as_a_normal_message():
    service = _service()
    past = {"TIMER_DELIVER_MS": str(NOW - 60_000), "k": "v"}
    assert service.redirect_timer("T", 2, past, NOW) == ("T", 2, past)
    assert service.redirect_timer("T", 2, {"TIMER_DELIVER_MS": str(NOW)}, NOW)[:2] == ("T", 2)
    assert service.redirect_timer("T", 2, {"TIMER_DELAY_MS": "0"}, NOW) == ("T", 2, {"TIMER_DELIVER_MS": str(NOW)})


def test_timer_messages_too_far_ahead_or_malformed_are_refused_with_the_limit_or_the_property():
    service = _service()
    with pytest.raises(RequestRejected) as e:
        service.redirect_timer("T", 0, {"TIMER_DELIVER_MS": str(NOW + TIMER_MAX_DELAY_MS + 1)}, NOW)
    assert e.value.code == ResponseCode.MESSAGE_ILLEGAL
    assert "'TIMER_DELIVER_MS'" in e.value.remark and "259200000 ms" in e.value.remark
    assert "timerMaxDelaySec" in e.value.remark
    with pytest.raises(RequestRejected) as e:
        service.redirect_timer("T", 0, {"TIMER_DELAY_SEC": "259201"}, NOW)
    assert e.value.code == ResponseCode.MESSAGE_ILLEGAL and "'TIMER_DELAY_SEC'" in e.value.remark
    with pytest.raises(RequestRejected) as e:
        service.redirect_timer("T", 0, {"TIMER_DELAY_MS": "soon"}, NOW)
    assert e.value.code == ResponseCode.INVALID_REQUEST and e.value.ext == {"field": "properties"}
    assert "'TIMER_DELAY_MS'" in e.value.remark and "'soon'" in e.value.remark
    # The node's timer_max_delay_sec, read at each send (UPDATE_BROKER_CONFIG may change it).
    service = _service(max_delay_s=60)
    assert service.redirect_timer("T", 0, {"TIMER_DELAY_SEC": "60"}, NOW)[0] == "SCHEDULE_TOPIC_XXXX"
    with pytest.raises(RequestRejected) as e:
        service.redirect_timer("T", 0, {"TIMER_DELAY_SEC": "61"}, NOW)
    assert e.value.code == ResponseCode.MESSAGE_ILLEGAL and "60000 ms (timer_max_delay_sec 60" in e.value.remark


def test_a_delay_level_wins_over_a_timer_and_drops_it_and_level_0_leaves_the_timer():
    service = _service()
    topic, queue_id, stored = service.redirect("T", 1, {"DELAY": "2", "TIMER_DELIVER_MS": str(NOW + 60_000),
                                                        "TIMER_DELAY_SEC": "9", "k": "v"})
    assert (topic, queue_id) == ("SCHEDULE_TOPIC_XXXX", 1)
    assert stored == {"DELAY": "2", "k": "v", "REAL_TOPIC": "T", "REAL_QID": "1"}
    topic, queue_id, stored = service.redirect("T", 1, {"DELAY": "0", "TIMER_DELAY_SEC": "12"})
    assert (topic, queue_id, stored["DELAY"]) == ("SCHEDULE_TOPIC_XXXX", 2, "3") and "TIMER_DELIVER_MS" in stored
    # A send-back of a delivered timer message waits its level only.
    assert "TIMER_DELIVER_MS" not in schedule_properties("%RETRY%g", 0, {"TIMER_DELIVER_MS": "5"}, 3)


def test_the_client_message_carries_a_delivery_time_as_rocketmqs_property():
    m = Message("T", b"x", deliver_time_ms=NOW + 5000)
    assert m.properties == {"TIMER_DELIVER_MS": str(NOW + 5000)} and m.deliver_time_ms == NOW + 5000
    assert m.delay_ms is None and m.wire_properties()["TIMER_DELIVER_MS"] == str(NOW + 5000)
    shared = {"color": "red"}
    a = Message("T", b"x", properties=shared, delay_ms=2500)
    b = Message("T", b"x", properties=shared, delay_ms=7000)
    assert (a.delay_ms, b.delay_ms, shared) == (2500, 7000, {"color": "red"})  # the dict given is not changed
    a.delay_ms = None
    assert a.properties == {"color": "red"} and a.delay_ms is None
    a.deliver_time_ms = 0  # the epoch: already past, no delay
    assert a.properties["TIMER_DELIVER_MS"] == "0"
    # A RocketMQ user's TIMER_DELAY_SEC property is taken as such.
    assert Message("T", b"x", properties={"TIMER_DELAY_SEC": "30"}).properties == {"TIMER_DELAY_SEC": "30"}


def test_the_client_refuses_bad_times_two_times_a_time_with_a_level_and_a_time_in_a_batch():
    for kwargs, needle in (({"deliver_time_ms": -1}, "deliver_time_ms must be None or an integer within 0.."),
                           ({"delay_ms": "5000"}, "delay_ms must be None or an integer"),
                           ({"delay_ms": True}, "delay_ms must be None or an integer"),
                           ({"delay_ms": 10 ** 18}, "delay_ms must be None or an integer"),
                           ({"delay_ms": 1, "deliver_time_ms": 2}, "one delivery time"),
                           ({"delay_ms": 1, "delay_level": 2}, "exclude each other"),
                           ({"properties": {"TIMER_DELIVER_MS": "tomorrow"}}, "'TIMER_DELIVER_MS'] must be a decimal"),
                           ({"properties": {"TIMER_DELAY_SEC": "1", "TIMER_DELAY_MS": "1"}}, "one delivery time")):
        with pytest.raises(ValueError, match=needle):
            Message("T", b"x", **kwargs)
    with pytest.raises(TypeError, match="must map str to str, got None"):
        Message("T", b"x", properties=None, delay_ms=5)  # type: ignore[arg-type]
    m = Message("T", b"x", delay_level=3)
    m.delay_ms = 5  # the setter checks the value; the message, checked again at send, the combination
    with pytest.raises(ValueError, match="exclude each other"):
        m.validate()
    with pytest.raises(MessageFormatError, match="TIMER_DELAY_MS.*sent alone, not in a batch"):
        Message("T", b"x", delay_ms=5).batch_item()
    assert Message("T", b"x", properties={"a": "b"}).batch_item()[1]  # others batch as before
