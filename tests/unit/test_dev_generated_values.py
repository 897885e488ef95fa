"""What ``raftmq dev`` and ``raftmq chaos`` write for their processes reads back as what they meant: every path and
string of the generated broker and name server TOML, and of the ``--set`` values they add, survives a backslash, a
quote, a character beyond U+FFFF and DEL in the directory names; and the client options printed for a TLS
directory paste into a shell as one path."""

from __future__ import annotations

import shlex
import tomllib

import pytest

from raftmq.commands.broker import parse_overrides
from raftmq.commands.dev import GROUP, NODE_IDS, LocalCluster, acl_overrides, plan_ports
from raftmq.commands.dev_tls import DevTLS

# Each was read back as another path (a tab, the letter A), or made the file unreadable (exit 1 after every
# process had started).
AWKWARD_NAMES = ["back\\tslash", "uni\\u0041code", 'quo"te', "emoji\U0001F600", "del\x7fete", "new\nline"]


@pytest.mark.parametrize("name", AWKWARD_NAMES)
def test_every_node_config_names_the_directories_under_the_data_dir_as_they_are(name, tmp_path):
    data_dir = tmp_path / name
    data_dir.mkdir()
    cluster = LocalCluster(data_dir, plan_ports(data_dir, 0))
    for nid in NODE_IDS:
        node_dir = (data_dir / GROUP / nid).resolve()
        assert cluster.node_data_dirs(nid) == (node_dir / "store", node_dir / "dledger")
        config = tomllib.loads(cluster.paths[nid].read_text(encoding="utf-8"))
        assert config["dledger"]["group"] == GROUP and config["dledger"]["self_id"] == nid
        assert config["dledger"]["secret"] == (data_dir / "secret").read_text().strip()


@pytest.mark.parametrize("name", AWKWARD_NAMES)
def test_the_tls_settings_of_every_process_name_the_files_as_they_are(name, tmp_path):
    tls_dir = tmp_path / name
    tls = DevTLS(tls_dir / "ca.pem", tls_dir / "server.pem", tls_dir / "server.key", generated=False)
    expected = {"tls_mode": "enforcing", "tls_cert_file": str(tls.cert_file), "tls_key_file": str(tls.key_file),
                "tls_ca_file": str(tls.ca_file)}
    assert tomllib.loads(tls.namesrv_toml()) == expected
    assert parse_overrides(tls.broker_overrides()) == {**expected, "tls_client_enable": True}


@pytest.mark.parametrize("name", AWKWARD_NAMES)
def test_the_acl_file_given_to_every_node_is_the_one_named(name, tmp_path):
    path = tmp_path / name / "acl.toml"
    path.parent.mkdir()
    path.write_text('[[accounts]]\naccess_key = "producer1"\nsecret_key = "producer-secret"\n')
    assert parse_overrides(acl_overrides(str(path))) == {"acl_enable": True, "acl_file": str(path)}


@pytest.mark.parametrize("name", ["my tls", "it's", "$HOME", "a;b", "star*"])
def test_the_printed_client_options_paste_into_a_shell_as_one_path(name, tmp_path):
    tls_dir = tmp_path / name
    tls = DevTLS(tls_dir / "ca.pem", tls_dir / "server.pem", tls_dir / "server.key", generated=True)
    assert shlex.split(tls.client_flags()) == ["--tls", "--tls-ca-file", str(tls_dir / "ca.pem")]
