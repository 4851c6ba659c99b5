"""Imports point one way: the tree says where a change goes, and nothing reaches back up.

Top-level layers: ``server -> playbooks``, ``server -> media``; ``playbooks`` and ``media`` never
import ``server`` or each other. Inside ``server``, from the top: the commands (``cli`` and
``commands/``) -> ``testkit`` -> ``http`` -> ``transports`` -> ``runtime`` -> ``llm`` -> ``config``
-> ``admission`` -> ``call``. A package may import any package below it, never one above it.

Outside the product: ``tests`` may import anything, ``benchmarks`` anything but ``tests``; the
product (``server``, ``media``, ``playbooks``) imports neither. What both need (the scripted LLM,
the WebRTC caller) lives in ``server.testkit``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SERVER_LAYERS = [
    "commands",
    "testkit",
    "http",
    "transports",
    "runtime",
    "llm",
    "config",
    "admission",
    "call",
]
"""Sub-packages of ``server`` from the top; ``commands`` also holds the modules directly in
``server/`` (``cli``)."""

CALL_FORBIDDEN = ("aiohttp", "aiortc", "aiosipua", "aiortp", "av")
"""What ``server/call`` must not import: it is the same for every transport."""


def _imports(path: Path, root: Path = REPO) -> set[str]:
    """Absolute module names ``path`` (under ``root``) imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = path.relative_to(root).with_suffix("").parts[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                found.add(node.module)
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "server":
        return None
    if len(parts) > 1 and parts[1] in SERVER_LAYERS:
        return parts[1]
    return "commands"  # server.cli, server.__main__


def _server_modules() -> list[Path]:
    return sorted((REPO / "server").rglob("*.py"))


PRODUCT = ("server", "media", "playbooks")

FORBIDDEN: dict[str, tuple[str, ...]] = {
    **{top: ("tests", "benchmarks") for top in PRODUCT},
    "benchmarks": ("tests",),
}
"""What each top-level folder must not import: the product ships alone, the harness runs
without the test suite."""


def _wrong_imports(root: Path, top: str) -> set[str]:
    return {
        f"{path.relative_to(root)} imports {name}"
        for path in sorted((root / top).rglob("*.py"))
        for name in _imports(path, root)
        if name.split(".")[0] in FORBIDDEN[top]
    }


def _edits_sys_path(path: Path) -> bool:
    """Whether ``path`` calls a method of ``sys.path`` (``insert``, ``append``) or assigns to it."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            changed = [node.func.value]
        elif isinstance(node, ast.Assign):
            changed = node.targets
        elif isinstance(node, ast.AugAssign):
            changed = [node.target]
        else:
            continue
        if any(ast.unparse(target) == "sys.path" for target in changed):
            return True
    return False


@pytest.mark.parametrize("top", sorted(FORBIDDEN))
def test_neither_the_product_nor_the_harness_imports_the_tests(top: str) -> None:
    assert not _wrong_imports(REPO, top)


def test_the_direction_check_sees_forbidden_imports(tmp_path: Path) -> None:
    """Product code importing the harness, and the harness importing the tests, are caught."""
    (tmp_path / "server" / "http").mkdir(parents=True)
    (tmp_path / "server" / "http" / "probe.py").write_text("from benchmarks.report import x\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "probe.py").write_text(
        "import tests.support.calls\nfrom tests import speech\n"
    )
    assert _wrong_imports(tmp_path, "server") == {"server/http/probe.py imports benchmarks.report"}
    assert _wrong_imports(tmp_path, "benchmarks") == {
        "benchmarks/probe.py imports tests.support.calls",
        "benchmarks/probe.py imports tests",
    }


def test_nothing_edits_sys_path(tmp_path: Path) -> None:
    """Every package is imported as installed: no module finds another by editing ``sys.path``."""
    edits = [
        str(path.relative_to(REPO))
        for top in (*PRODUCT, "benchmarks", "tests")
        for path in sorted((REPO / top).rglob("*.py"))
        if _edits_sys_path(path)
    ]
    assert not edits
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nsys.path.insert(0, '.')\n")
    assert _edits_sys_path(probe)


@pytest.mark.parametrize("top", ["playbooks", "media"])
def test_playbooks_and_media_import_neither_server_nor_each_other(top: str) -> None:
    other = {"playbooks": "media", "media": "playbooks"}[top]
    wrong = {
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted((REPO / top).rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[0] in ("server", other)
    }
    assert not wrong


def test_server_packages_import_only_downwards() -> None:
    wrong = []
    for path in _server_modules():
        here = _layer(".".join(path.relative_to(REPO).with_suffix("").parts))
        assert here is not None
        for name in _imports(path):
            there = _layer(name)
            if there is None or there == here:
                continue
            if SERVER_LAYERS.index(there) < SERVER_LAYERS.index(here):
                wrong.append(f"{path.relative_to(REPO)} ({here}) imports {name} ({there})")
    assert not wrong


def test_every_server_module_is_in_a_known_place() -> None:
    """A new sub-package must be placed in the layer order above, not slip past the check."""
    server = REPO / "server"
    packages = {p.relative_to(server).parts[0] for p in _server_modules() if p.parent != server}
    assert packages <= set(SERVER_LAYERS)


def test_the_call_package_knows_no_network_stack() -> None:
    wrong = {
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted((REPO / "server" / "call").rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[0] in CALL_FORBIDDEN
    }
    assert not wrong


def test_the_check_reads_imports_as_they_resolve() -> None:
    """The resolver itself: a relative import two levels up is read as the module it names."""
    module = REPO / "server" / "call" / "session.py"
    assert "server.call.voice" in _imports(module)
    assert _layer("server.http.app") == "http"
    assert _layer("server.cli") == "commands"
    assert SERVER_LAYERS.index("http") < SERVER_LAYERS.index("call")
