"""Real processes: a name server and the 3-node group broker-a (``raftmq broker``), and ``raftmq dev``.

Checks what only real processes show: registration names the Raft leader as master; followers refuse writes with
NOT_LEADER and the leader's address, and serve pulls from their own byte-identical store; after SIGKILL of the
leader a new leader is registered as master and takes writes, with every acknowledged message still readable;
the killed node restarts and serves the same bytes. ``raftmq dev`` comes up and stops every child by PID.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

import cbor2
import pytest
import trio

from client import open_admin
from raftmq.commands.dev import GROUP, NODE_IDS, plan_ports, write_broker_configs
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.message import MessageInput, encode_batch
from remoting.errors import RaftMQError
from remoting.transport import open_remoting_client
from tests.procs import ServerProcess, raftmq_argv

pytestmark = pytest.mark.cluster

TOPIC = "ClusterTopic"
MAX_MESSAGE_SIZE = 4 * 1024 * 1024  # store.max_message_size (RocketMQ's default), the broker's limit


@pytest.fixture
def start(spawn):
    """``spawn`` that also closes each process's output pipe at teardown (``ServerProcess.stop`` leaves it
    open, a ResourceWarning under ``-W error`` when collected)."""
    started: list[ServerProcess] = []

    def _start(argv, **kw) -> ServerProcess:
        proc = spawn(argv, **kw)
        started.append(proc)
        return proc

    yield _start
    for proc in started:
        proc.stop(timeout_s=10)
        if proc.proc.stdout is not None:
            proc.proc.stdout.close()


async def _consumer_offset(client, addr, key):
    """The group's offset of one queue in ``addr``'s own table (GET_CONSUME_STATS: any node answers it)."""
    r = await _call(client, addr, RequestCode.GET_CONSUME_STATS,
                    {"consumer_group": key["consumer_group"], "topic": key["topic"]})
    rows = cbor2.loads(r.body)["offsets"] if r.code == ResponseCode.SUCCESS else []
    return next((row["consumer_offset"] for row in rows if row["queue_id"] == key["queue_id"]), None)


async def _call(client, addr, code, ext=None, body=b"", timeout_s=3.0):
    return await client.invoke(addr, make_request(code, ext=ext or {}, body=body), timeout_s=timeout_s)


async def _master(client, namesrv: str, not_addr: str | None = None, timeout_s: float = 20.0) -> str:
    with trio.fail_after(timeout_s):
        while True:
            try:
                r = await _call(client, namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": TOPIC})
                if r.code == ResponseCode.SUCCESS:
                    addr = cbor2.loads(r.body)["broker_datas"][0]["broker_addrs"].get("0")
                    if addr and addr != not_addr:
                        return addr
            except RaftMQError:
                pass
            await trio.sleep(0.02)


async def _send(client, addr, body: bytes):
    return await _call(client, addr, RequestCode.SEND_MESSAGE,
                       {"producer_group": "pg", "topic": TOPIC, "queue_id": 0}, body)


async def _pull_all(client, addr) -> bytes:
    r = await _call(client, addr, RequestCode.PULL_MESSAGE,
                    {"consumer_group": "cg", "topic": TOPIC, "queue_id": 0, "queue_offset": 0,
                     "max_msg_nums": 1024})
    return r.body if r.code == ResponseCode.SUCCESS else b""


async def _wait_pull(client, addr, expected: bytes, timeout_s: float = 15.0) -> None:
    last = None
    with trio.move_on_after(timeout_s):
        while True:
            try:
                last = await _call(client, addr, RequestCode.PULL_MESSAGE,
                                   {"consumer_group": "cg", "topic": TOPIC, "queue_id": 0, "queue_offset": 0,
                                    "max_msg_nums": 1024})
                if last.code == ResponseCode.SUCCESS and last.body == expected:
                    return
            except RaftMQError as e:
                last = e
            await trio.sleep(0.05)
    detail = last if isinstance(last, Exception) or last is None else (
        f"code {last.code} remark {last.remark!r} ext {last.ext} body {len(last.body)} bytes")
    raise AssertionError(f"{addr} did not serve the expected {len(expected)} bytes within {timeout_s} s; "
                         f"last answer: {detail}")


async def _bad_input_is_refused(client, leader: str) -> None:
    """The five bad inputs of the issue, against a real leader process: each its code and remark."""
    r = await _send(client, leader, b"x" * (MAX_MESSAGE_SIZE + 1))
    assert r.code == ResponseCode.MESSAGE_ILLEGAL and "exceeds max_message_size" in r.remark
    r = await _call(client, leader, RequestCode.SEND_MESSAGE, {"topic": "no/such topic"}, b"x")
    assert r.code == ResponseCode.INVALID_REQUEST and "illegal characters" in r.remark
    r = await _call(client, leader, 31337)
    assert r.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED and "31337" in r.remark
    r = await _call(client, leader, RequestCode.PULL_MESSAGE,
                    {"consumer_group": "cg", "topic": TOPIC, "queue_id": 0, "queue_offset": 10 ** 9})
    assert r.code == ResponseCode.PULL_OFFSET_MOVED and "beyond max_offset" in r.remark
    r = await _call(client, leader, RequestCode.SEND_BATCH_MESSAGE, {"topic": TOPIC, "queue_id": 0},
                    b"RMB1" + b"\x00" * 20)
    assert r.code == ResponseCode.INVALID_REQUEST and "not a valid message batch" in r.remark


async def test_registration_follower_reads_and_leader_failover(start, tmp_path, figure):
    state = plan_ports(tmp_path, 0)
    paths = dict(zip(NODE_IDS, write_broker_configs(tmp_path, state)))
    namesrv = f"127.0.0.1:{state['ports']['namesrv']}"
    procs: dict[str, ServerProcess] = {}

    def start_all() -> None:
        start(raftmq_argv("namesrv", "--listen", namesrv))
        for nid in NODE_IDS:
            procs[nid] = start(raftmq_argv("broker", "--config", str(paths[nid])), ready_timeout_s=60)

    await trio.to_thread.run_sync(start_all)
    addr_of = {nid: p.fields["listen"] for nid, p in procs.items()}
    async with open_remoting_client() as client:
        # The first send goes to whichever node; a follower redirects with the leader's address.
        with trio.fail_after(20):
            while True:
                r = await _send(client, addr_of["n1"], b"m0")
                if r.code == ResponseCode.SUCCESS:
                    leader = addr_of["n1"]
                    break
                if r.code == ResponseCode.NOT_LEADER and r.ext.get("leader_addr"):
                    leader = r.ext["leader_addr"]
                    r = await _send(client, leader, b"m0")
                    if r.code == ResponseCode.SUCCESS:
                        break
                await trio.sleep(0.05)
        assert await _master(client, namesrv) == leader
        for i in range(1, 20):
            assert (await _send(client, leader, f"m{i}".encode())).code == ResponseCode.SUCCESS
        await _bad_input_is_refused(client, leader)
        follower = next(a for a in addr_of.values() if a != leader)
        r = await _send(client, follower, b"nope")
        assert r.code == ResponseCode.NOT_LEADER and r.ext["leader_addr"] == leader
        with trio.fail_after(10):  # acknowledged, then dispatched into the ConsumeQueue (see below)
            while b"m19" not in (expected := await _pull_all(client, leader)):
                await trio.sleep(0.02)
        assert expected.count(b"m1") >= 1
        for addr in addr_of.values():
            await _wait_pull(client, addr, expected)  # byte-identical records on every node

        # A committed consumer offset is replicated (batched, every 200 ms) and survives the leader.
        key = {"consumer_group": "cg", "topic": TOPIC, "queue_id": 0}
        r = await _call(client, leader, RequestCode.UPDATE_CONSUMER_OFFSET, {**key, "commit_offset": 7})
        assert r.code == ResponseCode.SUCCESS
        # A follower's table (consumers ask only the leader, whose table is complete) shows it once replicated.
        with trio.fail_after(10):
            while await _consumer_offset(client, follower, key) != 7:
                await trio.sleep(0.05)

        # Consumer progress counts the pulls each node served, the followers' too: 30 more pulls of the 20
        # messages from one follower, against the few the leader served above.
        for _ in range(30):
            assert await _pull_all(client, follower) == expected
        async with open_admin(namesrv) as admin:
            total = (await admin.consume_stats("cg", topic=TOPIC)).consume_tps
        r = await _call(client, leader, RequestCode.GET_CONSUME_STATS, {"consumer_group": "cg", "topic": TOPIC})
        by_leader = cbor2.loads(r.body)["consume_tps"]
        assert 0 < by_leader and total > 3 * by_leader, (total, by_leader)

        # SIGKILL the leader: a new master is registered, takes writes, and still has every acknowledged message.
        old = next(nid for nid, a in addr_of.items() if a == leader)
        killed_at = time.monotonic()
        procs[old].kill()
        new_leader = await _master(client, namesrv, not_addr=leader, timeout_s=20)
        registered_s = time.monotonic() - killed_at
        with trio.fail_after(20):
            while (await _send(client, new_leader, b"after")).code != ResponseCode.SUCCESS:
                await trio.sleep(0.05)
        first_ack_s = time.monotonic() - killed_at
        figure(f"failover: new master registered after {registered_s:.2f}s, first ack after {first_ack_s:.2f}s")
        # An acknowledged message is in the commit log; the ConsumeQueue that pulls read is built just after
        # (RocketMQ's reput), so the answer can overtake it: wait until the "after" message is pullable.
        with trio.fail_after(10):
            while b"after" not in (survivors := await _pull_all(client, new_leader)):
                await trio.sleep(0.02)
        assert survivors.startswith(expected)
        r = await _call(client, new_leader, RequestCode.QUERY_CONSUMER_OFFSET, key)
        assert r.code == ResponseCode.SUCCESS and r.ext["offset"] == 7

        # The killed node restarts on its data and catches up to the same bytes.
        procs[old] = await trio.to_thread.run_sync(
            lambda: start(raftmq_argv("broker", "--config", str(paths[old])), ready_timeout_s=60))
        await _wait_pull(client, procs[old].fields["listen"], survivors, timeout_s=30)

        # Leadership moved back to the restarted node on request (what a rolling restart does first): the name
        # server names it master at once (registration on role change) and it takes writes.
        restarted = procs[old].fields["listen"]
        r = await _call(client, new_leader, RequestCode.TRANSFER_LEADERSHIP, {"group": GROUP, "to": old})
        assert r.code == ResponseCode.SUCCESS and r.ext["leader_id"] == old, r.remark
        assert await _master(client, namesrv, not_addr=new_leader, timeout_s=10) == restarted
        assert (await _send(client, restarted, b"after-transfer")).code == ResponseCode.SUCCESS
        r = await _call(client, new_leader, RequestCode.TRANSFER_LEADERSHIP, {"group": GROUP, "to": old})
        assert r.code == ResponseCode.NOT_LEADER, r.remark


async def _find_leader(client, addrs) -> str:
    with trio.fail_after(20):
        while True:
            for addr in addrs:
                try:
                    r = await _send(client, addr, b"m0")
                except RaftMQError:
                    continue
                if r.code == ResponseCode.SUCCESS:
                    return addr
            await trio.sleep(0.05)


async def test_four_mib_message_is_replicated_and_pulled_from_a_follower(start, tmp_path, figure):
    state = plan_ports(tmp_path, 0)
    paths = dict(zip(NODE_IDS, write_broker_configs(tmp_path, state)))
    namesrv = f"127.0.0.1:{state['ports']['namesrv']}"

    def start_all() -> list[str]:
        start(raftmq_argv("namesrv", "--listen", namesrv))
        return [start(raftmq_argv("broker", "--config", str(paths[nid])), ready_timeout_s=60).fields["listen"]
                for nid in NODE_IDS]

    addrs = await trio.to_thread.run_sync(start_all)
    async with open_remoting_client() as client:
        leader = await _find_leader(client, addrs)
        body = os.urandom(MAX_MESSAGE_SIZE - 1024)  # a 4 MiB message, minus a small margin for nothing at all
        started = time.monotonic()
        r = await _call(client, leader, RequestCode.SEND_MESSAGE,
                        {"producer_group": "pg", "topic": TOPIC, "queue_id": 0}, body, timeout_s=15)
        figure(f"4 MiB send acknowledged after {(time.monotonic() - started) * 1000:.0f} ms")
        assert r.code == ResponseCode.SUCCESS, r.remark
        exact = os.urandom(MAX_MESSAGE_SIZE)
        assert (await _send(client, leader, exact)).code == ResponseCode.SUCCESS  # the limit itself is allowed

        # One byte over: refused before replication, the remark names the limit and where it comes from.
        r = await _send(client, leader, b"x" * (MAX_MESSAGE_SIZE + 1))
        assert r.code == ResponseCode.MESSAGE_ILLEGAL
        assert r.remark == (f"message body of {MAX_MESSAGE_SIZE + 1} bytes exceeds max_message_size "
                            f"{MAX_MESSAGE_SIZE} bytes (set by store.max_message_size)")
        # A batch is held to the same limit as a whole (each message is within it here).
        halves = [MessageInput(topic=TOPIC, queue_id=0, body=b"b" * (MAX_MESSAGE_SIZE // 2)) for _ in range(2)]
        batch = encode_batch(halves, ("127.0.0.1", 0), max_message_size=MAX_MESSAGE_SIZE)
        r = await _call(client, leader, RequestCode.SEND_BATCH_MESSAGE, {"topic": TOPIC, "queue_id": 0}, batch)
        assert r.code == ResponseCode.MESSAGE_ILLEGAL and "batch body of" in r.remark and r.ext.get("field") == "body"
        assert f"exceeds max_message_size {MAX_MESSAGE_SIZE} bytes" in r.remark
        batch = encode_batch(halves[:1] + [MessageInput(topic=TOPIC, queue_id=0, body=b"c" * 1000)],
                             ("127.0.0.1", 0), max_message_size=MAX_MESSAGE_SIZE)
        r = await _call(client, leader, RequestCode.SEND_BATCH_MESSAGE, {"topic": TOPIC, "queue_id": 0}, batch,
                        timeout_s=15)
        assert r.code == ResponseCode.SUCCESS, r.remark

        # Every follower serves the big messages from its own store, one per pull.
        for follower in (a for a in addrs if a != leader):
            assert body in await _pull_one(client, follower, 1) and exact in await _pull_one(client, follower, 2)


async def _pull_one(client, addr: str, queue_offset: int) -> bytes:
    """The pull body at ``queue_offset`` once ``addr`` has it (a follower applies after the leader answered);
    ``max_transfer_bytes`` (1 MiB) is below one message, so exactly one whole message comes back."""
    with trio.fail_after(20):
        while True:
            r = await _call(client, addr, RequestCode.PULL_MESSAGE,
                            {"consumer_group": "cg", "topic": TOPIC, "queue_id": 0, "queue_offset": queue_offset,
                             "max_msg_nums": 32}, timeout_s=10)
            if r.code == ResponseCode.SUCCESS:
                assert r.ext.get("next_begin_offset", queue_offset + 1) == queue_offset + 1
                return r.body
            await trio.sleep(0.05)


def test_dev_starts_and_stops_every_child(start, tmp_path):
    dev = start(raftmq_argv("dev", "--base-port", "0", "--data-dir", str(tmp_path / "dev")), ready_timeout_s=90)
    pids = [int(p) for p in dev.fields["pids"].split(",")]
    assert len(pids) == 4 and len(dev.fields["brokers"].split(",")) == 3
    assert (tmp_path / "dev" / "secret").stat().st_mode & 0o077 == 0
    dev.wait_output("stop it: Ctrl-C")
    assert dev.stop(timeout_s=30) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    stopped = [line for line in dev.output if " stopped " in line]
    assert len(stopped) == 4 and all(line.rstrip().endswith("rc=0") for line in stopped), stopped


@contextlib.contextmanager
def _adopting_orphans():
    """This process as a child subreaper (prctl PR_SET_CHILD_SUBREAPER) for the block: the children of a killed
    child are reparented here instead of to init, so their exit status can be waited for."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


_PR_SET_CHILD_SUBREAPER = 36


def test_dev_children_stop_by_themselves_when_dev_is_killed(start, tmp_path):
    """``raftmq dev`` killed outright (SIGKILL: no chance to stop its children, which run in sessions of their own)
    must not leave its name server and nodes running: each sees that its supervisor is gone
    (``RAFTMQ_EXIT_WITH_PARENT``, raftmq/runner.py) and shuts down cleanly, exit status 0. Without it, all four
    were still running 20 s later, holding their ports and data directory."""
    with _adopting_orphans():
        dev = start(raftmq_argv("dev", "--base-port", "0", "--data-dir", str(tmp_path / "dev")), ready_timeout_s=90)
        pids = [int(p) for p in dev.fields["pids"].split(",")]
        dev.kill()
        status: dict[int, int] = {}
        deadline = time.monotonic() + 20
        try:
            while len(status) < len(pids) and time.monotonic() < deadline:
                for pid in pids:
                    if pid not in status:
                        done, raw = os.waitpid(pid, os.WNOHANG)  # ours now: dev's orphans were adopted here
                        if done:
                            status[pid] = os.waitstatus_to_exitcode(raw)
                time.sleep(0.1)
        finally:
            left = [pid for pid in pids if pid not in status]
            for pid in left:  # started for this test, through dev
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    assert not left, f"children of the killed raftmq dev still running 20 s later: {left}"
    assert all(code == 0 for code in status.values()), f"exit statuses of dev's children: {status}"


def test_dev_reports_a_child_that_cannot_start(tmp_path):
    import socket
    import subprocess

    with socket.socket() as busy:
        # --base-port B also uses B+1035.. and B+11035..: pick a B low enough for those to be valid ports.
        for port in range(31000, 40000, 7):
            try:
                busy.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        busy.listen()
        r = subprocess.run(raftmq_argv("dev", "--base-port", str(port), "--data-dir", str(tmp_path / "dev")),
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "raftmq dev: error: namesrv" in r.stderr and "exited with rc=" in r.stderr
    assert "Address already in use" in r.stderr


def test_a_broker_whose_raft_port_is_taken_exits_2_naming_it(tmp_path):
    """``raftmq broker`` that cannot bind its Raft port: one line naming the node and the port, exit 2 (was a
    trio exception-group traceback, exit 1), and nothing before it from pysyncobj (was its own ERROR "failed to
    perform initialization" with a traceback, above our line)."""
    import socket
    import subprocess

    data_dir = tmp_path / "dev"
    data_dir.mkdir()
    state = plan_ports(data_dir, 0)
    config = write_broker_configs(data_dir, state)[0]
    raft = f"127.0.0.1:{state['ports']['raft'][0]}"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", state["ports"]["raft"][0]))
        busy.listen()
        r = subprocess.run(raftmq_argv("broker", "--config", str(config)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert (f"raftmq: error: broker {GROUP} node 1 (listen 127.0.0.1:{state['ports']['service'][0]}, raft {raft}) "
            f"could not start: could not bind the Raft port {raft}") in r.stderr
    assert "Traceback" not in r.stderr and "failed to perform initialization" not in r.stderr, r.stderr
    assert "ready" not in r.stdout


def test_a_second_broker_on_a_running_nodes_directories_is_refused_before_it_opens_them(tmp_path):
    """Nothing stopped a second ``raftmq broker`` with a running node's config from opening that node's store and
    Raft journal: it recovered them (cutting a "torn" tail, rewriting the checkpoint) under the live process, and
    only failed later on the taken Raft port. Now each directory is locked first (remoting.dirlock)."""
    import subprocess

    data_dir = tmp_path / "dev"
    data_dir.mkdir()
    state = plan_ports(data_dir, 0)
    config = write_broker_configs(data_dir, state)[0]
    first = ServerProcess(raftmq_argv("broker", "--config", str(config)))
    try:
        r = subprocess.run(raftmq_argv("broker", "--config", str(config)), capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2, r.stderr
        assert f"is in use by another process (pid {first.pid})" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "ready" not in r.stdout
        assert first.alive
    finally:
        first.stop()
    # Its lock goes with the process, even a killed one: the same config starts again.
    again = ServerProcess(raftmq_argv("broker", "--config", str(config)))
    again.kill()
    again.stop()  # reaps it and closes its output
    again = ServerProcess(raftmq_argv("broker", "--config", str(config)))
    assert again.stop() == 0
