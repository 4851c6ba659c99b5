"""The tests' Chromium: :class:`server.testkit.browser.Browser`, started so that the test session
knows it (and kills it, at the latest, when the test ends)."""

from __future__ import annotations

from pathlib import Path

from server.testkit import browser
from tests.support.processes import spawn

__all__ = ["Browser"]


class Browser(browser.Browser):
    def __init__(self, profile: Path, microphone_wav: Path) -> None:
        super().__init__(profile, microphone_wav, spawn)
