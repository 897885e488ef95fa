"""A cluster of several broker groups for cluster tests: name servers and 3-node groups as real processes.

``MultiGroupCluster`` starts ``namesrvs`` name servers (each on a port it picks itself, read from its ready line)
and the groups named in ``groups`` (3 nodes each, on ports free at run time), every node registering with every
name server, all under one cluster name. Every process is started through the ``spawn`` fixture, so it is
stopped by PID when the test ends, pass or fail. Nodes and whole groups can be SIGKILLed and started again on
their data; starts run in threads, so a group's three nodes start side by side (a node's start is mostly
Python's imports, seconds on the shared machine).
"""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

import trio

from client import open_admin
from raftmq.ports import free_port
from remoting.errors import RaftMQError
from tests.procs import ServerProcess, raftmq_argv

__all__ = ["MultiGroupCluster", "NODE_IDS", "start_multigroup"]

NODE_IDS = ("n1", "n2", "n3")
CLUSTER_NAME = "DefaultCluster"


class MultiGroupCluster:
    def __init__(self, spawn, data_dir: Path, groups: tuple[str, ...] = ("broker-a", "broker-b"),
                 namesrvs: int = 2) -> None:
        self._spawn = spawn
        self._logs = data_dir / "logs"
        self._starts = 0
        self._lock = threading.Lock()
        self.groups = groups
        self._logs.mkdir(parents=True, exist_ok=True)
        self.namesrv_procs = [spawn(raftmq_argv("namesrv", "--listen", "127.0.0.1:0"),
                                    log_path=self._logs / f"namesrv-{i}.log") for i in range(namesrvs)]
        self.namesrv_addrs = [p.fields["listen"] for p in self.namesrv_procs]
        self.namesrv = ";".join(self.namesrv_addrs)
        self.paths: dict[str, dict[str, Path]] = {}
        self.addr_of: dict[tuple[str, str], str] = {}  # (group, node id) -> service address
        for group in groups:
            self.paths[group] = self._write_configs(data_dir, group)
        self.nodes: dict[tuple[str, str], ServerProcess] = {}
        self.start_nodes([(g, nid) for g in groups for nid in NODE_IDS])

    def _write_configs(self, data_dir: Path, group: str) -> dict[str, Path]:
        secret = secrets.token_urlsafe(24)
        service = {nid: f"127.0.0.1:{free_port()}" for nid in NODE_IDS}
        raft = {nid: f"127.0.0.1:{free_port()}" for nid in NODE_IDS}
        members = ", ".join(f'{{ id = "{nid}", raft_address = "{raft[nid]}", service_address = "{service[nid]}" }}'
                            for nid in NODE_IDS)
        namesrv_addrs = ", ".join(f'"{a}"' for a in self.namesrv_addrs)
        paths = {}
        for nid in NODE_IDS:
            node_dir = (data_dir / group / nid).resolve()
            node_dir.mkdir(parents=True, exist_ok=True)
            path = data_dir / f"{group}-{nid}.toml"
            path.write_text(f'cluster_name = "{CLUSTER_NAME}"\nnamesrv_addrs = [{namesrv_addrs}]\n\n'
                            f'[store]\nstore_dir = "{node_dir / "store"}"\n\n'
                            f'[dledger]\ngroup = "{group}"\nself_id = "{nid}"\nsecret = "{secret}"\n'
                            f'data_dir = "{node_dir / "dledger"}"\nmembers = [{members}]\n')
            path.chmod(0o600)
            paths[nid] = path
            self.addr_of[(group, nid)] = service[nid]
        return paths

    # -- processes (blocking: call through trio.to_thread) ---------------------------------------------------------
    def start_nodes(self, keys: list[tuple[str, str]]) -> None:
        """Start the nodes ``(group, node id)`` on their data, side by side, and wait for every ready line."""
        errors: list[BaseException] = []

        def one(key: tuple[str, str]) -> None:
            group, nid = key
            with self._lock:
                self._starts += 1
                log_path = self._logs / f"{group}-{nid}-{self._starts}.log"
            try:
                proc = self._spawn(raftmq_argv("broker", "--config", str(self.paths[group][nid])),
                                   ready_timeout_s=90, log_path=log_path)
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(e)
                return
            with self._lock:
                self.nodes[key] = proc

        threads = [threading.Thread(target=one, args=(key,)) for key in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def restart_namesrv(self, index: int) -> ServerProcess:
        """Start name server ``index`` again on its address (after a kill: it knows nothing until nodes register)."""
        proc = self._spawn(raftmq_argv("namesrv", "--listen", self.namesrv_addrs[index]),
                           log_path=self._logs / f"namesrv-{index}-again.log")
        self.namesrv_procs[index] = proc
        return proc

    def kill_group(self, group: str) -> None:
        """SIGKILL every node of ``group``, as a lost rack."""
        for nid in NODE_IDS:
            self.nodes[(group, nid)].kill()

    def start_group(self, group: str) -> None:
        self.start_nodes([(group, nid) for nid in NODE_IDS])

    def node_at(self, addr: str) -> tuple[str, str]:
        return next(key for key, a in self.addr_of.items() if a == addr)

    def group_of(self, addr: str) -> str:
        return self.node_at(addr)[0]

    # -- state, through the name servers ---------------------------------------------------------------------------
    async def masters(self, groups: tuple[str, ...] | None = None, timeout_s: float = 30.0) -> dict[str, str]:
        """Each group's master as the name servers route it, once every one of ``groups`` (default: all) has one
        and all three of its nodes registered."""
        wanted = groups or self.groups
        async with open_admin(self.namesrv) as admin:
            with trio.fail_after(timeout_s):
                while True:
                    try:
                        info = await admin.cluster_info()
                        if all(info.master_addr(g) and len(set(info.broker_addrs.get(g, {}).values())) == 3
                               for g in wanted):
                            return {g: info.master_addr(g) for g in wanted}
                    except RaftMQError:
                        pass
                    await trio.sleep(0.1)

    async def create_topic(self, topic: str, queues: int, timeout_s: float = 30.0, **options) -> None:
        """Create ``topic`` with ``queues`` read and write queues on every group, retried until every group's
        leader took it and the name servers route it on all of them."""
        async with open_admin(self.namesrv) as admin:
            with trio.fail_after(timeout_s):
                while True:
                    try:
                        route = await admin.create_topic(topic, read_queue_nums=queues, write_queue_nums=queues,
                                                         **options)
                        if route is not None and {q.broker_name for q in route.queue_datas} >= set(self.groups):
                            return
                    except RaftMQError:
                        pass
                    await trio.sleep(0.2)


async def start_multigroup(spawn, tmp_path: Path, **options) -> MultiGroupCluster:
    cluster = await trio.to_thread.run_sync(lambda: MultiGroupCluster(spawn, tmp_path / "cluster", **options))
    await cluster.masters()
    return cluster
