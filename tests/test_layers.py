"""Imports point one way: the tree says where a change goes, and nothing reaches back up.

Top-level layers: ``server -> playbooks``, ``server -> media``; ``playbooks`` and ``media`` never
import ``server`` or each other. Inside ``server``, from the top: the command (``cli``, ``chat``,
``serve``) -> ``http`` -> ``transports`` -> ``runtime`` -> ``config`` -> ``call``. A package may
import any package below it, never one above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SERVER_LAYERS = ["command", "http", "transports", "runtime", "config", "call"]
"""Sub-packages of ``server`` from the top; ``command`` is the modules directly in ``server/``."""

CALL_FORBIDDEN = ("aiohttp", "aiortc", "aiosipua", "aiortp", "av")
"""What ``server/call`` must not import: it is the same for every transport."""


def _imports(path: Path) -> set[str]:
    """Absolute module names ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
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
    return "command"


def _server_modules() -> list[Path]:
    return sorted((REPO / "server").rglob("*.py"))


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
    packages = {p.parent.name for p in _server_modules() if p.parent != REPO / "server"}
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
    assert _layer("server.cli") == "command"
    assert SERVER_LAYERS.index("http") < SERVER_LAYERS.index("call")
