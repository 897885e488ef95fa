"""``raftmq dev``: the embedded default cluster on loopback, for trying raftmq and for benchmarks.

It starts one name server and the 3-node group ``broker-a`` as child processes (the same ``raftmq namesrv`` and
``raftmq broker`` a deployment runs, so what works here works there), with data, generated configs, logs and a
generated cluster secret under ``./.raftmq-dev/``. Ports are fixed by default (name server 9876, brokers
10911/10921/10931, Raft 20911/20921/20931) so clients can be pointed at the same address every time;
``--base-port 0`` picks free ones. A second run reuses the data, the secret and the ports; one started while
another runs on the same ``--data-dir`` is refused before it writes anything (``lock_data_dir``). Every process also
serves Prometheus metrics (``GET /metrics``) on a free port of its host, printed at start (``metrics_listen``
port 0: a scrape config follows the printed addresses, or sets its own in a deployment's config).

With ``--tls-dir DIR`` every process serves TLS only (``tls_mode = "enforcing"``) with the certificates of DIR,
made there when it is empty (``raftmq/commands/dev_tls.py`` names the files), and the brokers dial the name server
and each other over TLS; the client settings to use are printed at start.

Shutdown on Ctrl-C / SIGTERM, while starting too: every child gets SIGTERM by PID (brokers unregister and flush),
then SIGKILL if it lingers ``--stop-timeout`` seconds after it (the brokers at once, then the name server). Stopped
while starting, it exits 130 on Ctrl-C, 0 on SIGTERM. A child that dies on its own is reported and left dead (the
others keep serving: that is a failover, and a good way to watch one).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from raftmq.bench.common import check_range, make_dir
from raftmq.commands.dev_tls import DevTLS, open_tls_dir, refuse_tls_overrides, toml_string
from raftmq.ports import free_port, port_range
from raftmq.runner import PARENT_PID_ENV, announce_ready, run_until_signalled
from remoting.config import ConfigError, apply_overrides, blank_dir_problem, config_from_mapping
from remoting.dirlock import DirectoryInUseError, DirectoryLock

log = logging.getLogger(__name__)

GROUP = "broker-a"
NODE_IDS = ("n1", "n2", "n3")
# The broker config keys that differ from node to node in what ``_broker_toml`` writes (``metrics_listen`` by
# host), or default from them (``listen`` is the member's service_address): one ``--set`` value given to all
# three made them claim one identity, port or directory, and it ended in a bind error from the second node.
PER_NODE_KEYS = ("listen", "metrics_listen", "store.store_dir", "dledger.self_id", "dledger.data_dir",
                 "dledger.members")
# The keys ``_broker_toml`` writes the same in every node and the dev cluster depends on: ``raftmq dev`` prints and
# ``raftmq chaos`` asks the group GROUP (another made chaos wait 30 s for a leader of broker-a), both dial their own
# name server, and the secret is the one kept in the data directory for the next run.
CLUSTER_KEYS = ("namesrv_addrs", "dledger.group", "dledger.secret")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "dev", help="run a name server and a 3-node broker group on loopback (Ctrl-C stops everything)",
        description="Start the embedded default cluster: one name server and the 3-node group broker-a on "
                    "127.0.0.1, data under ./.raftmq-dev/. Prints the addresses, then serves until Ctrl-C.")
    # A str, not a Path: Path("") is "." and an empty --data-dir must be told from an explicit "." to refuse it.
    parser.add_argument("--data-dir", default=".raftmq-dev", help="default ./.raftmq-dev")
    parser.add_argument("--base-port", type=int, default=None,
                        help="name server on BASE, brokers on BASE+1035+10*i, Raft on BASE+11035+10*i "
                             "(default 9876, i.e. 9876/10911/20911; 0 picks free ports)")
    parser.add_argument("--stop-timeout", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="broker config override passed to every node, e.g. --set store.flush_disk_type="
                             '\'"SYNC_FLUSH"\' (not the keys dev sets itself: '
                             + ", ".join(PER_NODE_KEYS + CLUSTER_KEYS) + ")")
    parser.add_argument("--acl-file", metavar="PATH", default=None,
                        help="turn ACL on in every node with this ACL file (TOML, re-read when it changes; "
                             "docs/operations.md, 'Access control (ACL)')")
    parser.add_argument("--tls-dir", metavar="DIR", default=None,
                        help="serve TLS only, name server and brokers, with DIR's ca.pem, server.pem and server.key; "
                             "an empty DIR gets a new CA and server certificate (docs/operations.md, 'TLS')")
    parser.set_defaults(func=run)


def acl_overrides(acl_file: str | None) -> list[str]:
    """The ``--set`` pairs of ``--acl-file PATH`` (none without it), once the file is found to load: a bad one is
    the ConfigError naming its entry now, not three brokers refusing to start."""
    if acl_file is None:
        return []
    from broker.acl import load_acl_file  # the broker stack only when asked

    if not acl_file.strip():
        raise ConfigError(f"--acl-file must name a file, got {acl_file!r}")
    path = Path(acl_file).resolve()  # absolute: each node is given it as it is
    load_acl_file(path)
    return ["acl_enable=true", f"acl_file={toml_string(path)}"]


def check_base_port(base_port: int | None) -> None:
    """Reject a ``--base-port`` that puts a port outside 1..65535, or (``0``) a malformed ``RAFTMQ_PORT_RANGE``,
    before anything is created: ConfigError, which the CLI turns into exit 2 naming the bad value."""
    if base_port == 0:
        try:
            port_range()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return
    ports = _fixed_ports(9876 if base_port is None else base_port)
    for port in [ports["namesrv"], *ports["service"], *ports["raft"]]:
        if not 1 <= port <= 65535:
            raise ConfigError(f"--base-port {base_port} puts a port outside 1..65535 ({port})")


def _fixed_ports(base: int) -> dict[str, Any]:
    return {"namesrv": base, "service": [base + 1035 + 10 * i for i in range(len(NODE_IDS))],
            "raft": [base + 11035 + 10 * i for i in range(len(NODE_IDS))]}


def plan_ports(data_dir: Path, base_port: int | None) -> dict[str, Any]:
    """Ports of this dev cluster: remembered in ``cluster.json`` so a restart finds the same cluster."""
    state_path = data_dir / "cluster.json"
    if state_path.exists() and base_port is None:
        return _read_state(state_path)
    check_base_port(base_port)
    if base_port == 0:
        ports = {"namesrv": free_port(), "service": [free_port() for _ in NODE_IDS],
                 "raft": [free_port() for _ in NODE_IDS]}
    else:
        ports = _fixed_ports(9876 if base_port is None else base_port)
    _refuse_moving_raft_ports(data_dir, state_path, ports["raft"])
    secret_path = data_dir / "secret"
    if secret_path.exists():
        secret = secret_path.read_text().strip()
    else:
        secret = secrets.token_urlsafe(24)
        secret_path.write_text(secret + "\n")
        secret_path.chmod(0o600)
    state = {"ports": ports, "secret_file": str(secret_path)}
    state_path.write_text(json.dumps(state, indent=2) + "\n")
    return state


def _refuse_moving_raft_ports(data_dir: Path, state_path: Path, raft_ports: list[int]) -> None:
    """A ConfigError when ``raft_ports`` would move the Raft ports of a group that has Raft data in ``data_dir``:
    each member's Raft snapshot names the group's members by their Raft addresses, and a member restarted on new
    ones dials the stored ones, so no two ever connected again and no leader was ever elected."""
    held = [nid for nid in NODE_IDS
            if any((data_dir / GROUP / nid / "dledger" / name).exists() for name in ("raft.journal", "raft.snapshot"))]
    if not held or not state_path.exists():
        return
    try:  # the ports alone: a missing secret file is no matter of ports (the start names it after)
        old = json.loads(state_path.read_text())["ports"]["raft"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{state_path} cannot be read ({e}), so whether --base-port would move the Raft ports of "
                          f"the group whose Raft data is in {data_dir} (members {', '.join(held)}) cannot be told: "
                          f"its members know each other by those addresses. Restore {state_path.name}, or remove "
                          f"{data_dir} (make clean-dev) to start over") from None
    if old != raft_ports:
        raise ConfigError(f"--base-port would move the Raft ports of the group whose Raft data is in {data_dir} "
                          f"(members {', '.join(held)}; from {old} to {raft_ports}): its members know each other "
                          f"by those addresses and would never connect again. Run without --base-port to reuse "
                          f"the ports of {state_path}, or remove {data_dir} (make clean-dev) to start over")


def _read_state(state_path: Path) -> dict[str, Any]:
    """``cluster.json`` of an earlier run, checked: one that is damaged or hand-edited (or whose secret file is
    gone) is a ConfigError naming it, not a JSONDecodeError or KeyError traceback from deep in the start."""
    def refuse(problem: str) -> ConfigError:
        return ConfigError(f"{str(state_path)!r} (the ports and secret of an earlier run) {problem}; remove it, or "
                           f"the whole --data-dir, to start over")

    try:
        state = json.loads(state_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise refuse(f"cannot be read as JSON ({e})") from None
    ports = state.get("ports") if isinstance(state, dict) else None
    if not isinstance(ports, dict) or not isinstance(state.get("secret_file"), str):
        raise refuse("needs 'ports' and 'secret_file'")
    lists = [ports.get("service"), ports.get("raft")]
    if (not all(isinstance(x, list) and len(x) == len(NODE_IDS) for x in lists)
            or not all(type(p) is int and 1 <= p <= 65535 for p in [ports.get("namesrv"), *lists[0], *lists[1]])):
        raise refuse(f"'ports' must hold a name server port and {len(NODE_IDS)} service and {len(NODE_IDS)} Raft "
                     f"ports within 1..65535, got {ports!r}")
    if not Path(state["secret_file"]).is_file():
        raise refuse(f"names a secret file that does not exist, {state['secret_file']!r}")
    return state


def write_broker_configs(data_dir: Path, state: dict[str, Any], *, hosts: dict[str, str] | None = None,
                         namesrv_host: str = "127.0.0.1") -> list[Path]:
    """The three nodes' ``broker.toml`` files for the ports and secret of ``state``, every server on 127.0.0.1
    unless ``hosts`` (node id -> IP) and ``namesrv_host`` say otherwise (tests that give each its own host)."""
    secret = Path(state["secret_file"]).read_text().strip()
    paths = []
    for nid in NODE_IDS:
        node_dir = (data_dir / GROUP / nid).resolve()
        node_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / f"{GROUP}-{nid}.toml"
        path.write_text(_broker_toml(nid, node_dir, state["ports"], secret, hosts or {}, namesrv_host),
                        encoding="utf-8")
        path.chmod(0o600)
        paths.append(path)
    return paths


def _broker_toml(nid: str, node_dir: Path, ports: dict[str, Any], secret: str, hosts: dict[str, str],
                 namesrv_host: str) -> str:
    # Every string through toml_string: the directories come from --data-dir, the secret from a file the user may
    # have written, and a bare one with a backslash or a quote put a node's data elsewhere or broke the file.
    q = toml_string
    host = {n: hosts.get(n, "127.0.0.1") for n in NODE_IDS}
    members = ", ".join(
        f"{{ id = {q(n)}, raft_address = {q(host[n] + ':' + str(ports['raft'][i]))}, "
        f"service_address = {q(host[n] + ':' + str(ports['service'][i]))} }}" for i, n in enumerate(NODE_IDS))
    namesrv = q(f"{namesrv_host}:{ports['namesrv']}")
    return (f"# Generated by `raftmq dev`; edited copies are overwritten on the next run.\n"
            f"cluster_name = {q('DefaultCluster')}\n"
            f"namesrv_addrs = [{namesrv}]\n"
            f"metrics_listen = {q(host[nid] + ':0')}\n\n"
            f"[store]\nstore_dir = {q(node_dir / 'store')}\n\n"
            f"[dledger]\ngroup = {q(GROUP)}\nself_id = {q(nid)}\nsecret = {q(secret)}\n"
            f"data_dir = {q(node_dir / 'dledger')}\nmembers = [{members}]\n")


def check_overrides(overrides: Sequence[str], data_dir: Path | None = None) -> None:
    """Refuse a bad ``--set`` before anything is made or started: checked on a config like the ones
    ``write_broker_configs`` writes, so it fails here as it would in every node (ConfigError naming the key,
    exit 2), not as three brokers exiting one after the other. A key of ``PER_NODE_KEYS`` or ``CLUSTER_KEYS`` (or a
    table holding one, or a key under one) is refused too: it is valid in each node's config, and wrong in all three
    at once, or in what dev and chaos expect of the cluster.

    With ACL on (``acl_enable``), the ACL file each node would read (``broker.acl.acl_file_path``: ``acl_file``, else
    ``plain_acl.toml`` in the node's store directory under ``data_dir``) is loaded as the node loads it: a missing or
    bad one is the ConfigError naming the key that turned ACL on or named the file. ``data_dir`` None stands for a
    directory made new, whose store directories hold no ACL file."""
    if not overrides:
        return
    from broker.config import BrokerConfig  # the broker stack only when there is something to check
    from raftmq.commands.broker import parse_overrides

    parsed = parse_overrides(list(overrides))
    for key in parsed:
        for dev_key in PER_NODE_KEYS + CLUSTER_KEYS:
            per_node = dev_key in PER_NODE_KEYS
            if key == dev_key or key.startswith(dev_key + "."):
                what = ("per node (each node its own identity, addresses and directories)" if per_node
                        else f"for the whole cluster (its group {GROUP}, its name server, its secret)")
                raise ConfigError(f"--set {key}: raftmq dev sets this {what}; a different layout needs configs of "
                                  f"its own, run with raftmq broker")
            if dev_key.startswith(key + "."):
                raise ConfigError(f"--set {key}: raftmq dev sets {dev_key} in it "
                                  f"{'per node' if per_node else 'for the whole cluster'}, and this replaces the "
                                  f"whole table; set its other keys one by one ({key}.KEY=VALUE)")
    data = tomllib.loads(_broker_toml(NODE_IDS[0], Path("/raftmq-dev-check") / GROUP / NODE_IDS[0],
                                      _fixed_ports(9876), "0" * 32, {}, "127.0.0.1"))
    apply_overrides(data, parsed)
    config = config_from_mapping(BrokerConfig, data)
    if config.acl_enable:
        _check_acl_file(config, "acl_file" if "acl_file" in parsed else "acl_enable", data_dir)


def _check_acl_file(config: Any, key: str, data_dir: Path | None) -> None:
    """The ACL file every node would read with ``config`` loaded now (``check_overrides``); the broker's own
    ConfigError, prefixed with ``--set KEY``, when one would fail: the nodes started, then exited one by one."""
    from broker.acl import ACL_FILE_NAME, acl_file_path, load_acl_file

    if config.acl_file:
        paths = [acl_file_path(config)]
    elif data_dir is None:
        raise ConfigError(f"--set {key}: ACL is on without acl_file, so each node would read {ACL_FILE_NAME} in its "
                          f"store directory, made new by this run; give the ACL file (raftmq dev: --acl-file PATH)")
    else:
        paths = [(data_dir / GROUP / nid / "store").resolve() / ACL_FILE_NAME for nid in NODE_IDS]
    for path in paths:
        try:
            load_acl_file(path)
        except ConfigError as e:
            raise ConfigError(f"--set {key}: {e}; raftmq dev: --acl-file PATH gives every node one") from None


def check_data_dir(value: str) -> Path:
    """``--data-dir`` as a Path; an empty one (Path("") is the current directory, where the whole cluster then
    landed) is a ConfigError."""
    if problem := blank_dir_problem(value):
        raise ConfigError(f"--data-dir {problem}, got {value!r}")
    return Path(value)


def check_tls_dir_for_ready_line(value: str) -> None:
    """Refuse a ``--tls-dir`` whose absolute path holds whitespace (ConfigError, exit 2), before its files are
    made: the ready line's ``tls_ca_file=`` names ``ca.pem`` in it, and every reader of a ready line
    (``Child``, ``spawn_ready_process``, the tests' process fixtures) splits it at whitespace into ``key=value``
    fields, as it does every other ready line, whose values hold none; the path came out cut short there."""
    path = str(Path(value).resolve())
    if any(c.isspace() for c in path):
        shown = repr(value) if path == value else f"{value!r} ({path!r})"
        raise ConfigError(f"--tls-dir {shown} holds whitespace, which the ready line's space-separated "
                          f"key=value fields cannot carry (tls_ca_file=); use a directory without")


def lock_data_dir(data_dir: Path) -> DirectoryLock:
    """Lock ``data_dir`` for this ``raftmq dev`` (remoting.dirlock: released with the process, however it exits),
    or raise DirectoryInUseError naming the directory and the holder's pid (exit 2) before anything is written.

    A second ``raftmq dev --base-port 0`` on a running one's directory rewrote cluster.json and the three node
    configs with new ports, then failed on the nodes' store locks: the running cluster's files named ports
    nothing listened on, and the next run started on those. The node directories are probed too, for nodes
    that run without a ``raftmq dev`` holding this lock (started by hand from its configs, by ``raftmq chaos``
    on this directory, or left by a ``raftmq dev`` from before this lock)."""
    try:
        lock = DirectoryLock(data_dir, "--data-dir", "dev.lock")
    except OSError as e:  # a read-only directory: a traceback from the first file written, as before the lock
        raise ConfigError(f"--data-dir {str(data_dir)!r} cannot be written: {e.strerror or e}") from None
    # The locks each node's store and Raft member take (broker/store/message_store.py, dledger/member.py), taken
    # and let go at once; a directory not made yet holds no running node.
    node_locks = [(data_dir / GROUP / nid / sub, what, file) for nid in NODE_IDS
                  for sub, what, file in (("store", "store_dir", "lock"),
                                          ("dledger", "the Raft data directory", "raft.lock"))]
    try:
        for path, what, file in node_locks:
            if path.is_dir():
                DirectoryLock(path, what, file).release()
    except DirectoryInUseError as e:
        lock.release()
        raise DirectoryInUseError(f"--data-dir {str(data_dir)!r} holds a running node: {e}") from None
    except BaseException:
        lock.release()
        raise
    return lock


class DevClusterError(RuntimeError):
    pass


class Child:
    """One child process; its output goes to a log file, its ready line is parsed."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.fields: dict[str, str] = {}
        self._ready = threading.Event()
        self._log = open(log_path, "a", encoding="utf-8")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{PARENT_PID_ENV: str(os.getpid())})
        # A new process group keeps the terminal's Ctrl-C away from the children: we stop them ourselves, in
        # order, by PID.
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self.pid = self.proc.pid
        self._terminated_at: float | None = None  # time.monotonic() of our SIGTERM
        self._reader = threading.Thread(target=self._read, name=f"dev-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith("ready ") and not self.fields:
                self.fields = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        if self._ready.wait(timeout_s) and self.fields:
            return
        rc = self.proc.poll()
        if rc is None and self._ready.is_set():  # output ended: the process is exiting
            try:
                rc = self.proc.wait(5)
            except subprocess.TimeoutExpired:
                rc = None
        what = f"exited with rc={rc}" if rc is not None else f"did not become ready within {timeout_s:.0f}s"
        try:
            tail = Path(self._log.name).read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
        except OSError:
            tail = []
        raise DevClusterError(f"{self.name} (pid {self.pid}) {what}; last lines of {self._log.name}:\n    "
                              + "\n    ".join(tail))

    def terminate(self) -> None:
        # Exactly one SIGTERM: a second one can land after the child's trio run has put the default handler
        # back, and would kill it in the middle of its final flush.
        if self.proc.poll() is None and self._terminated_at is None:
            self._terminated_at = time.monotonic()
            os.kill(self.pid, signal.SIGTERM)

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (unless ``terminate`` sent it already), then SIGKILL if the process has not exited ``timeout_s``
        seconds later; its exit status."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                waited = time.monotonic() - (self._terminated_at or time.monotonic())
                log.warning("%s (pid %d) ignored SIGTERM for %.1fs; killing it", self.name, self.pid, waited)
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._reader.join(2)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()  # else left to the garbage collector, with a ResourceWarning
        self._log.close()
        return self.proc.returncode


def _raftmq(*args: str) -> list[str]:
    return [sys.executable, "-m", "raftmq", *args]


class LocalCluster:
    """The processes of ``raftmq dev``: the name server and the group's three nodes, each a ``Child`` started here
    and stopped by PID. ``raftmq chaos`` kills and restarts single nodes of one.

    ``start_all`` runs in a worker thread and waits a minute and more for the children to be ready; a signal
    meanwhile abandons that thread and calls ``stop_all``, which from then on refuses every start (DevClusterError),
    so no child is started after the children were stopped, and stopping them ends the waits for their ready lines
    (their output ends)."""

    def __init__(self, data_dir: Path, state: dict[str, Any], *, overrides: Sequence[str] = (),
                 stop_timeout_s: float = 10.0, tls: DevTLS | None = None) -> None:
        self.logs = data_dir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.ports = state["ports"]
        self.paths = dict(zip(NODE_IDS, write_broker_configs(data_dir, state)))
        # With TLS the name server reads its tls_* keys from a file (it takes no --set), the brokers from --set.
        self.tls = tls
        self._namesrv_args: list[str] = []
        if tls is not None:
            namesrv_toml = data_dir / "namesrv.toml"
            namesrv_toml.write_text(tls.namesrv_toml(), encoding="utf-8")
            self._namesrv_args = ["--config", str(namesrv_toml)]
            overrides = [*overrides, *tls.broker_overrides()]
        self._overrides = [a for s in overrides for a in ("--set", s)]
        self.stop_timeout_s = stop_timeout_s
        self.namesrv: Child | None = None
        self.nodes: dict[str, Child] = {}
        self._starting = threading.Lock()  # a child is started, or the cluster set to stopping, one at a time
        self._stopping = False

    @property
    def children(self) -> list[Child]:
        return ([self.namesrv] if self.namesrv is not None else []) + list(self.nodes.values())

    def node_data_dirs(self, nid: str) -> tuple[Path, Path]:
        """Node ``nid``'s store directory and Raft data directory, as its config names them."""
        config = tomllib.loads(self.paths[nid].read_text(encoding="utf-8"))
        return Path(config["store"]["store_dir"]), Path(config["dledger"]["data_dir"])

    def start_node(self, nid: str) -> Child:
        """Start node ``nid`` on its data (again, after a kill) without waiting for it to be ready."""
        with self._starting:
            self._refuse_when_stopping(f"{GROUP}/{nid}")
            child = Child(f"{GROUP}/{nid}", _raftmq("broker", "--config", str(self.paths[nid]), *self._overrides),
                          self.logs / f"{GROUP}-{nid}.log")
            self.nodes[nid] = child
        return child

    def start_all(self) -> None:
        with self._starting:
            self._refuse_when_stopping("namesrv")
            self.namesrv = Child("namesrv", _raftmq("namesrv", *self._namesrv_args,
                                                    "--listen", f"127.0.0.1:{self.ports['namesrv']}",
                                                    "--metrics-listen", "127.0.0.1:0"), self.logs / "namesrv.log")
        self.namesrv.wait_ready(30)
        for nid in NODE_IDS:
            self.start_node(nid)
        for nid in NODE_IDS:
            self.nodes[nid].wait_ready(60)

    def _refuse_when_stopping(self, name: str) -> None:
        if self._stopping:
            raise DevClusterError(f"{name} not started: the cluster is stopping")

    def stop_all(self) -> None:
        """Stop every child, brokers first, all at once (each unregisters from the name server), the name server
        last; each gets SIGKILL if it has not exited ``stop_timeout_s`` after its SIGTERM. The brokers' waits share
        one deadline: waited one after the other with the whole timeout each, hung ones were killed at T, 2T, 3T."""
        with self._starting:
            self._stopping = True
        nodes = list(self.nodes.values())
        for child in nodes:
            child.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        for child in reversed(nodes):
            self._log_stopped(child, child.stop(max(0.0, deadline - time.monotonic())))
        if self.namesrv is not None:
            self._log_stopped(self.namesrv, self.namesrv.stop(self.stop_timeout_s))

    @staticmethod
    def _log_stopped(child: Child, rc: int | None) -> None:
        log.info("stopped %s pid=%d rc=%s", child.name, child.pid, rc)


def run(args: argparse.Namespace) -> int:
    check_range("--stop-timeout", args.stop_timeout, 0.1, 3600)
    check_base_port(args.base_port)
    args.set = [*args.set, *acl_overrides(args.acl_file)]
    data_dir = check_data_dir(args.data_dir)
    tls = None
    if args.tls_dir is not None:
        refuse_tls_overrides(args.set, "--tls-dir")
        check_tls_dir_for_ready_line(args.tls_dir)
        tls = open_tls_dir(args.tls_dir)  # checked (or made) before anything else is written
    check_overrides([*args.set, *(tls.broker_overrides() if tls else [])], data_dir)
    make_dir(data_dir, "--data-dir")
    lock = lock_data_dir(data_dir)
    try:
        return _run_locked(args, data_dir, tls)
    finally:
        # Held until every child has stopped: a second run must not rewrite the files of nodes still flushing.
        lock.release()


def _run_locked(args: argparse.Namespace, data_dir: Path, tls: DevTLS | None) -> int:
    cluster = LocalCluster(data_dir, plan_ports(data_dir, args.base_port), overrides=args.set,
                           stop_timeout_s=args.stop_timeout, tls=tls)
    logs = cluster.logs
    start_all, stop_all = cluster.start_all, cluster.stop_all

    async def watch(child: Child) -> None:
        while child.proc.poll() is None:
            await trio.sleep(0.5)
        log.warning("%s (pid %d) exited on its own with rc=%s; see %s", child.name, child.pid,
                    child.proc.returncode, logs)

    failed: list[str] = []
    started: list[bool] = []

    async def main(nursery: trio.Nursery) -> None:
        try:
            # Abandoned on a signal (run_until_signalled's stop_while_starting): stop_all below stops what it
            # started, and refuses it every further start.
            await trio.to_thread.run_sync(start_all, abandon_on_cancel=True)
        except DevClusterError as e:
            stop_all()
            failed.append(str(e))
            nursery.cancel_scope.cancel()
            return
        except BaseException:
            stop_all()
            raise
        children = cluster.children
        namesrv_addr = children[0].fields["listen"]
        brokers = [c.fields["listen"] for c in children[1:]]
        started.append(True)
        print(f"raftmq dev: name server {namesrv_addr}; group {GROUP} nodes {', '.join(brokers)}; "
              f"data {data_dir.resolve()}", flush=True)
        # Each child's /metrics address, in the order of brokers= (keys of their own: parsers of the other keys
        # are untouched).
        metrics = [c.fields.get("metrics", "") for c in children]
        # With TLS, the CA file clients need (a key of its own: parsers of the other keys are untouched).
        announce_ready("dev", listen=namesrv_addr, namesrv=namesrv_addr, brokers=",".join(brokers),
                       pids=",".join(str(c.pid) for c in children), namesrv_metrics=metrics[0],
                       broker_metrics=",".join(metrics[1:]), **({"tls_ca_file": str(tls.ca_file)} if tls else {}))
        print("  metrics: " + ", ".join(f"{c.name} http://{m}/metrics" for c, m in zip(children, metrics) if m),
              flush=True)
        flags = f" {tls.client_flags()}" if tls else ""
        if tls is not None:
            made = "made now" if tls.generated else "found"
            print(f"  TLS only (certificates {made} in {tls.cert_file.parent}): clients take {tls.client_flags()}, "
                  f"or $RAFTMQ_TLS_ENABLE=true and $RAFTMQ_TLS_CA_FILE={shlex.quote(str(tls.ca_file))}, or in code "
                  f"tls_enable=True, tls_ca_file={str(tls.ca_file)!r}", flush=True)
        print(f"  use it: point a client at namesrv {namesrv_addr}, e.g. "
              f"raftmq bench produce --namesrv {namesrv_addr}{flags} --seconds 10\n"
              f"  stop it: Ctrl-C (stops every process); logs in {logs.resolve()}", flush=True)

        async def keep() -> None:
            try:
                await trio.sleep_forever()
            finally:
                stop_all()

        nursery.start_soon(keep)
        for child in children:
            nursery.start_soon(watch, child)

    try:
        rc = run_until_signalled(main, stop_while_starting=True)
    except KeyboardInterrupt:
        print("raftmq dev: interrupted while starting; every process it started is stopped", file=sys.stderr)
        raise
    if failed:
        print(f"raftmq dev: error: {failed[0]}", file=sys.stderr)
        return 1
    if not started and rc == 0:
        print("raftmq dev: stopped while starting (SIGTERM); every process it started is stopped", file=sys.stderr)
    return rc
