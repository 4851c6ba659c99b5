"""Conversation history in chat-completions wire format, trimmed without splitting tool pairs."""

from __future__ import annotations

from typing import Any

__all__ = ["Conversation", "Message"]

Message = dict[str, Any]
"""A chat-completions message. Vocable may add ``"interrupted": True`` to an assistant message
whose answer was cut off by the caller, and ``"handoff": True`` to the handoff summary that
replaced a cleared history; both are stripped before the message is sent."""

_LOCAL_KEYS = ("interrupted", "handoff")


class Conversation:
    """Ordered messages (system prompt excluded) with a size limit counted in messages."""

    def __init__(self, limit: int = 50) -> None:
        if limit < 1:
            raise ValueError("history limit must be at least 1")
        self.limit = limit
        self.messages: list[Message] = []

    def __len__(self) -> int:
        return len(self.messages)

    def append(self, message: Message) -> None:
        self.messages.append(message)

    def clear(self) -> None:
        self.messages.clear()

    def trim(self, keep_from: int | None = None) -> int:
        """Drop whole groups from the oldest until within the limit; returns how many were dropped.

        A group is an assistant message with tool calls plus its tool results, or any other single
        message. Messages at index ``keep_from`` or later (the turn in progress) are never dropped,
        so the history may stay above the limit until that turn is over.
        """
        protected = len(self.messages) if keep_from is None else keep_from
        dropped = 0
        while len(self.messages) - dropped > self.limit:
            end = _group_end(self.messages, dropped)
            if end > protected:
                break
            dropped = end
        del self.messages[:dropped]
        return dropped

    def shed(self, keep_fraction: float, keep_from: int) -> int:
        """Drop whole groups from the oldest until at most ``keep_fraction`` of the characters
        before ``keep_from`` (the turn in progress, always kept) are left: for a history that
        outgrew the model's context. Returns how many messages were dropped."""
        sizes = [
            len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or ""))
            for m in self.messages
        ]
        budget = sum(sizes[:keep_from]) * max(0.0, keep_fraction)
        dropped = 0
        while dropped < keep_from and sum(sizes[dropped:keep_from]) > budget:
            end = _group_end(self.messages, dropped)
            if end > keep_from:
                break
            dropped = end
        del self.messages[:dropped]
        return dropped

    def for_request(self, system_prompt: str | None) -> list[Message]:
        """The messages to send, led by the system prompt, without Vocable's local keys."""
        out: list[Message] = []
        if system_prompt:
            out.append({"role": "system", "content": system_prompt})
        for message in self.messages:
            if any(key in message for key in _LOCAL_KEYS):
                message = {k: v for k, v in message.items() if k not in _LOCAL_KEYS}
            out.append(message)
        return out

    def last_content(self, role: str) -> str | None:
        for message in reversed(self.messages):
            if message.get("role") == role and isinstance(message.get("content"), str):
                return str(message["content"])
        return None


def _size(message: Message) -> int:
    """A message's size in characters, its tool calls included."""
    return len(str(message.get("content") or "")) + len(str(message.get("tool_calls") or ""))


def _group_end(messages: list[Message], start: int) -> int:
    """Index just past the group that begins at ``start``."""
    end = start + 1
    if messages[start].get("role") in ("assistant", "tool"):
        # an assistant's tool calls own the tool results that follow; a stray tool result
        # (which a valid history never has) is dropped along with its neighbours
        while end < len(messages) and messages[end].get("role") == "tool":
            end += 1
    return end
