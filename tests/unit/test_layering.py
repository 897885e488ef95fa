"""The import arrows of conventions.md, checked with ``ast`` over every module of every package."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = {"remoting", "dledger", "broker", "namesrv", "client", "pipeline", "raftmq"}
ALLOWED = {
    "remoting": set(),
    "dledger": {"remoting"},
    "broker": {"dledger", "remoting"},
    "namesrv": {"remoting"},
    "client": {"remoting"},
    "pipeline": {"client", "remoting"},
    "raftmq": OURS,
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _modules(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def test_every_package_exists():
    for package in OURS:
        assert (ROOT / package / "__init__.py").is_file(), package


def test_import_arrows_point_one_way():
    violations = []
    for package, allowed in ALLOWED.items():
        for path in _modules(package):
            for imported in _imports(path) & OURS - {package}:
                if imported not in allowed:
                    violations.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not violations, "\n".join(violations)


def test_only_dledger_imports_pysyncobj():
    offenders = [str(p.relative_to(ROOT)) for pkg in OURS - {"dledger"} for p in _modules(pkg)
                 if "pysyncobj" in _imports(p)]
    assert not offenders, offenders


def test_remoting_codec_is_sans_io():
    codec = ROOT / "remoting" / "codec.py"
    assert codec.is_file()
    assert not _imports(codec) & {"trio", "socket", "asyncio", "selectors"}


def test_checker_sees_a_violation(tmp_path):
    # Guards against a checker that silently finds nothing.
    bad = tmp_path / "m.py"
    bad.write_text("import broker.store\nfrom client import x\nfrom . import y\n")
    assert _imports(bad) == {"broker", "client"}


def test_every_runtime_dependency_is_imported():
    # prometheus-client was installed with every deployment while nothing imported it (metrics are not built).
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    names = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in declared}
    imported = set().union(*(_imports(p) for pkg in OURS for p in _modules(pkg)))
    assert names and not names - imported, sorted(names - imported)
