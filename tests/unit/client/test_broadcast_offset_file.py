"""A BROADCASTING member's offset file: one member's alone, across processes too, and refused at open when an
entry could not be consumed from.

Found by review: two members of one group in two processes of a host, both with the default instance_name, kept
their offsets in one file, each write replacing it with the writer's offsets; a member that never consumed anything,
restarted, resumed from the other's offsets and skipped every message it had not handled. And an offset of -5 in
the file was taken, then killed the consumer at its first pull with a ValueError naming no file."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

import client.push_consumer
from client import MessageQueue, open_push_consumer
from client.errors import ConfigError
from client.message import I32_MAX, I64_MAX
from client.offset_store import LocalFileOffsetStore
from remoting.dirlock import DirectoryInUseError
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MQ = MessageQueue("T", "broker-a", 0)

# A member in a process of its own, against the in-memory cluster (no sockets): prints "open" once its consumer is
# open, then consumes until killed.
MEMBER = """
import sys, trio
import client.push_consumer
from client import open_push_consumer
from tests.unit.client.fake_cluster import FakeGroup, FakeRemoting, fake_remoting_ctx
fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"])])
client.push_consumer.open_remoting = lambda config, handler=None: fake_remoting_ctx(fake)

async def handler(msg):
    pass

async def main():
    async with open_push_consumer("ns:9876", topic="T", consumer_group="bc", handler=handler,
                                  message_model="BROADCASTING", offset_store_dir=sys.argv[1]):
        print("open", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


@pytest.fixture
def cluster(monkeypatch):
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"])])
    monkeypatch.setattr(client.push_consumer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


async def handler(msg) -> None:
    pass


async def test_a_member_in_another_process_is_refused_the_file_until_it_is_killed(cluster, tmp_path):
    opts = dict(topic="T", consumer_group="bc", handler=handler, message_model="BROADCASTING",
                offset_store_dir=str(tmp_path))
    member = subprocess.Popen([sys.executable, "-c", MEMBER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert member.stdout.readline().strip() == "open"
        held = re.escape(f"offset file '{tmp_path / 'bc@DEFAULT.json'}' is held by another consumer "
                         f"(process {member.pid}, lock file 'bc@DEFAULT.json.lock'): each BROADCASTING member of group "
                         f"'bc' on a host needs a file of its own, give each member its own instance_name (now "
                         f"'DEFAULT') or offset_store_dir")
        with pytest.raises(ConfigError, match=f"^{held}$"):
            async with open_push_consumer(NAMESRV, **opts):
                pass
        async with open_push_consumer(NAMESRV, instance_name="other", **opts):  # a file of its own
            pass
    finally:
        member.send_signal(signal.SIGKILL)
        member.wait(10)
        member.stdout.close()
    # Killed, the member held nothing any more: its restart (here, another process's member of the same name) opens.
    async with open_push_consumer(NAMESRV, **opts) as consumer:
        consumer._offsets.update(MQ, 3)
    assert await LocalFileOffsetStore(tmp_path / "bc@DEFAULT.json").read_from_store(MQ) == 3


async def test_the_file_is_held_while_the_consumer_opens_and_let_go_when_opening_fails(cluster, tmp_path, monkeypatch):
    path = tmp_path / "bc@DEFAULT.json"
    seen = []

    def failing_remoting(config, handler=None):
        with pytest.raises(DirectoryInUseError, match=f"is held by another consumer \\(process {os.getpid()}, "):
            LocalFileOffsetStore(path).lock()
        seen.append("held")
        raise OSError("no network")

    monkeypatch.setattr(client.push_consumer, "open_remoting", failing_remoting)
    with pytest.raises(OSError, match="no network"):
        async with open_push_consumer(NAMESRV, topic="T", consumer_group="bc", handler=handler,
                                      message_model="BROADCASTING", offset_store_dir=str(tmp_path)):
            pass
    assert seen == ["held"]
    store = LocalFileOffsetStore(path)
    store.lock()
    store.close()


async def test_a_store_loads_the_file_again_once_it_holds_it(tmp_path):
    """What the last holder wrote as it closed, after the next one first read the file, is what the next resumes
    from; and close() lets the file go."""
    path = tmp_path / "bc@DEFAULT.json"
    first = LocalFileOffsetStore(path)
    first.lock()
    second = LocalFileOffsetStore(path)
    with pytest.raises(DirectoryInUseError, match=re.escape(f"offset file '{path}' is held by another consumer "
                                                            f"(process {os.getpid()}, lock file "
                                                            f"'bc@DEFAULT.json.lock')")):
        second.lock()
    first.update(MQ, 5)
    assert await first.persist_all() == 0
    first.close()
    first.close()  # idempotent
    assert await second.read_from_store(MQ) is None
    second.lock()
    assert await second.read_from_store(MQ) == 5
    second.close()


GOOD = {"topic": "T", "broker_name": "broker-a", "queue_id": 0, "offset": 5}


@pytest.mark.parametrize("content, error", [
    # Taken, then the first pull raised "offset must be an integer within 0..9223372036854775807, got -5" inside the
    # consumer's task and the consumer died.
    ({"offsets": [{**GOOD, "offset": -5}]}, "entry MessageQueue(topic='T', broker_name='broker-a', queue_id=0): "
                                            "offset must be an integer within 0..9223372036854775807, got -5"),
    ({"offsets": [{**GOOD, "offset": I64_MAX + 1}]}, f"offset must be an integer within 0..{I64_MAX}, "
                                                     f"got {I64_MAX + 1}"),
    ({"offsets": [{**GOOD, "offset": True}]}, "offset must be an integer within 0..9223372036854775807, got True"),
    # int() took these: "5" and 5.9 became 5.
    ({"offsets": [{**GOOD, "offset": "5"}]}, "offset must be an integer within 0..9223372036854775807, got '5'"),
    ({"offsets": [{**GOOD, "offset": 5.9}]}, "offset must be an integer within 0..9223372036854775807, got 5.9"),
    ({"offsets": [{**GOOD, "queue_id": -1}]}, "entry MessageQueue(topic='T', broker_name='broker-a', queue_id=-1): "
                                              f"queue_id must be an integer within 0..{I32_MAX}, got -1"),
    ({"offsets": [{**GOOD, "queue_id": I32_MAX + 1}]}, f"queue_id must be an integer within 0..{I32_MAX}, "
                                                       f"got {I32_MAX + 1}"),
    ({"offsets": [{**GOOD, "queue_id": False}]}, f"queue_id must be an integer within 0..{I32_MAX}, got False"),
    ({"offsets": [{**GOOD, "queue_id": "0"}]}, f"queue_id must be an integer within 0..{I32_MAX}, got '0'"),
    ({"offsets": [{**GOOD, "topic": "a b"}]}, "topic 'a b' contains characters outside"),
    ({"offsets": [{**GOOD, "topic": 7}]}, "topic must be a non-empty string, got 7"),
    ({"offsets": [{**GOOD, "broker_name": ""}]}, "broker_name must be a non-empty string, got ''"),
    ({"offsets": [{k: v for k, v in GOOD.items() if k != "offset"}]}, "an entry has no 'offset'"),
    ({"offsets": ["T"]}, "entry 'T' must be an object"),
    ({"offsets": {"T": 5}}, 'it must be an object whose "offsets" is a list'),
    ([GOOD], 'it must be an object whose "offsets" is a list'),
])
def test_an_entry_the_consumer_could_not_use_is_refused_naming_the_file(tmp_path, content, error):
    path = tmp_path / "bc@DEFAULT.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=f"^offset file '{re.escape(str(path))}' is malformed: .*{re.escape(error)}"):
        LocalFileOffsetStore(path)


async def test_the_bounds_themselves_are_taken(tmp_path):
    path = tmp_path / "bc@DEFAULT.json"
    path.write_text(json.dumps({"offsets": [{**GOOD, "offset": 0}, {**GOOD, "queue_id": I32_MAX, "offset": I64_MAX}]}))
    store = LocalFileOffsetStore(path)
    assert await store.read_from_store(MQ) == 0
    assert await store.read_from_store(MessageQueue("T", "broker-a", I32_MAX)) == I64_MAX


async def test_a_negative_offset_fails_the_open_naming_the_directory_and_the_file(cluster, tmp_path):
    path = tmp_path / "bc@DEFAULT.json"
    path.write_text(json.dumps({"offsets": [{**GOOD, "offset": -5}]}))
    expected = (f"offset_store_dir '{tmp_path}' cannot keep the offsets: offset file '{path}' is malformed: entry "
                f"MessageQueue(topic='T', broker_name='broker-a', queue_id=0): offset must be an integer within "
                f"0..9223372036854775807, got -5")
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        async with open_push_consumer(NAMESRV, topic="T", consumer_group="bc", handler=handler,
                                      message_model="BROADCASTING", offset_store_dir=str(tmp_path)):
            pass
