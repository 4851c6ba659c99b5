"""The caller's keypad: digits gathered into one input, as a phone's IVR gathers them.

Digits (RFC 4733 events, or a browser's ``dtmf`` message) are gathered until ``#`` or a pause
of ``pause_s``, then handed on as one line, ``Keypad: 123#``: the LLM sees it, and a keyword
condition of a playbook can match it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["DTMF_DIGITS", "Keypad", "keypad_line"]

DTMF_DIGITS = "0123456789*#ABCD"
"""The sixteen keys of a telephone keypad (A-D on military and test sets)."""


def keypad_line(digits: str) -> str:
    """The text a gathered input is answered as."""
    return f"Keypad: {digits}"


class Keypad:
    """Gathers one call's digits; ``entered(digits)`` gets each complete input."""

    def __init__(self, pause_s: float, entered: Callable[[str], None]) -> None:
        self.pause_s = pause_s
        self._entered = entered
        self._digits = ""
        self._timer: asyncio.TimerHandle | None = None

    @staticmethod
    def accepts(digit: str) -> bool:
        """Whether ``digit`` is one key of the keypad."""
        return len(digit) == 1 and digit in DTMF_DIGITS

    def press(self, digit: str) -> None:
        """One key (see :meth:`accepts`): ``#`` ends the input at once, any other key waits
        ``pause_s`` for the next."""
        self._digits += digit
        self._cancel_timer()
        if digit == "#":
            self._flush()
        else:
            self._timer = asyncio.get_running_loop().call_later(self.pause_s, self._flush)

    def close(self) -> None:
        """Drop what was gathered; nothing more is entered."""
        self._cancel_timer()
        self._digits = ""

    def _flush(self) -> None:
        self._timer = None
        digits, self._digits = self._digits, ""
        if digits:
            self._entered(digits)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
