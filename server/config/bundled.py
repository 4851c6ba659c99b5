"""Files that ship inside the installed packages, found through :mod:`importlib.resources`: the
same lookup serves a wheel in site-packages, an editable install and a Docker image."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["EXAMPLES", "WEB_CLIENT"]


def _folder(package: str, *parts: str) -> Path:
    """A folder of ``package``'s data as a path; packages are installed as files, not zipped."""
    return Path(str(files(package).joinpath(*parts)))


WEB_CLIENT = _folder("server.web_client")
"""The browser client (``index.html``, ``app.js``, ``style.css``): ``web-client/`` in a checkout."""

EXAMPLES = _folder("playbooks", "examples")
"""The example playbooks and their tools, the default ``--playbook``."""
