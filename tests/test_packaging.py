"""The wheel works on its own: built from the source, installed into a fresh virtual environment
outside the checkout, it serves the web client and checks its bundled example playbooks.

The fresh environment gets Vocable from the wheel alone (``--no-deps``); its dependencies are
borrowed from the test run's own environment through a ``.pth`` line, which adds them to
``sys.path`` without the checkout or its editable install (the test proves Vocable's modules load
from the new environment). Downloading them again would take minutes and the network.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import REPO
from tests.support.processes import free_port, spawn, until_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SOURCES = ("pyproject.toml", "README.md", "LICENSE", "server", "media", "playbooks", "web-client")
"""What a wheel is built from (the Dockerfile copies the same)."""


def _declared_packages() -> set[str]:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(setuptools["packages"])


def test_every_folder_of_the_tree_is_declared() -> None:
    """A new sub-package or data folder missing from pyproject.toml's list would be left out of
    the wheel (setuptools only warns)."""
    found = {
        ".".join(folder.relative_to(REPO).parts)
        for top in ("server", "media", "playbooks")
        for folder in [REPO / top, *(REPO / top).rglob("*")]
        if folder.is_dir() and "__pycache__" not in folder.parts
    }
    assert _declared_packages() == found | {"server.web_client"}


@pytest.fixture(scope="module")
def fresh_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment outside the checkout with the wheel installed: its bin/."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, source / name)
    wheels = root / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
        check=True,
        timeout=180,
    )
    (wheel,) = wheels.glob("vocable-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", str(wheel)],
        check=True,
        timeout=120,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "borrowed-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def _outside_env() -> dict[str, str]:
    """The environment without anything that points back into the checkout."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("VOCABLE_", "OPENAI_", "PYTHON", "VIRTUAL_ENV"))
    }


def test_the_wheel_carries_the_web_client_and_the_examples(fresh_install: Path) -> None:
    (wheel,) = fresh_install.parent.parent.joinpath("wheels").glob("vocable-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for client_file in ("index.html", "app.js", "style.css"):
        assert f"server/web_client/{client_file}" in names
    assert "playbooks/examples/support.yaml" in names
    assert "playbooks/examples/support_tools.py" in names
    assert "playbooks/examples/markdown/support.md" in names
    assert "server/llm/templates/chatml-tools.jinja" in names
    assert "media/models/smart-turn-v3.2-cpu.onnx" in names  # the end-of-turn model
    assert "media/models/LICENSE-smart-turn" in names  # and its licence
    assert any(n.endswith(".dist-info/licenses/media/models/LICENSE-smart-turn") for n in names)
    assert not any(name.startswith(("tests/", "benchmarks/")) for name in names)


def test_the_installed_cli_checks_a_bundled_example(fresh_install: Path, tmp_path: Path) -> None:
    where = subprocess.run(
        [
            str(fresh_install / "python"),
            "-c",
            "import server, playbooks; from server.config.bundled import EXAMPLES;"
            " print(server.__file__); print(EXAMPLES)",
        ],
        cwd=tmp_path,
        env=_outside_env(),
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.splitlines()
    venv = str(fresh_install.parent)
    assert all(line.startswith(venv) for line in where), where
    checked = subprocess.run(
        [str(fresh_install / "vocable"), "playbook", "check", f"{where[1]}/support.yaml"],
        cwd=tmp_path,
        env=_outside_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr
    assert "stage" in checked.stdout


async def test_the_installed_server_serves_the_web_client(
    fresh_install: Path, tmp_path: Path
) -> None:
    port = free_port()
    process = await spawn(
        str(fresh_install / "vocable"),
        "serve",
        "--port",
        str(port),
        "--llm",
        "none",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,
        env=_outside_env(),
    )
    assert process.stdout is not None
    try:
        await until_ready(process, 120)
        async with aiohttp.ClientSession() as http:
            for path, kind in (("/", "text/html"), ("/client/app.js", "javascript")):
                async with http.get(f"http://127.0.0.1:{port}{path}") as response:
                    assert response.status == 200, path
                    assert kind in response.content_type, (path, response.content_type)
                    assert await response.read()
    finally:
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 0, err.decode()
