"""Conversation history: trimming whole groups, never splitting a tool call from its results."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from playbooks import Conversation
from playbooks.history import Message


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def calls(*ids: str) -> Message:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            for i in ids
        ],
    }


def result(call_id: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": "{}"}


def tool_group(*ids: str) -> list[Message]:
    return [calls(*ids), *(result(i) for i in ids)]


def conversation(messages: list[Message], limit: int) -> Conversation:
    history = Conversation(limit)
    for message in messages:
        history.append(message)
    return history


def assert_valid_pairs(messages: list[Message]) -> None:
    """No tool result without its assistant call just before it, and no call without results."""
    index = 0
    while index < len(messages):
        message = messages[index]
        assert message["role"] != "tool", f"tool result without its call at {index}"
        index += 1
        if message["role"] == "assistant" and message.get("tool_calls"):
            wanted = [c["id"] for c in message["tool_calls"]]
            got: list[str] = []
            while index < len(messages) and messages[index]["role"] == "tool":
                got.append(messages[index]["tool_call_id"])
                index += 1
            assert got == wanted, f"tool call ids {wanted} answered by {got}"


# -- basics ----------------------------------------------------------------------------------------


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Conversation(0)
    assert Conversation().limit == 50


def test_append_len_clear() -> None:
    history = conversation([user("a"), assistant("b")], limit=5)
    assert len(history) == 2
    history.clear()
    assert len(history) == 0
    assert history.messages == []


def test_trim_within_the_limit_drops_nothing() -> None:
    messages = [user("1"), assistant("2"), user("3")]
    history = conversation(list(messages), limit=3)
    assert history.trim() == 0
    assert history.messages == messages


def test_trim_drops_the_oldest_messages() -> None:
    messages = [user("1"), assistant("2"), user("3"), assistant("4"), user("5")]
    history = conversation(list(messages), limit=3)
    assert history.trim() == 2
    assert history.messages == messages[2:]


def test_trim_drops_a_tool_group_whole() -> None:
    messages = [user("q"), *tool_group("a", "b"), assistant("answer"), user("next")]
    history = conversation(list(messages), limit=3)
    # dropping the user message and the call alone would reach the limit, but split the group
    assert history.trim() == 4
    assert history.messages == [assistant("answer"), user("next")]
    assert_valid_pairs(history.messages)


def test_trim_never_leaves_results_without_their_call() -> None:
    messages = [*tool_group("a", "b", "c"), user("x")]
    history = conversation(list(messages), limit=2)
    assert history.trim() == 4
    assert history.messages == [user("x")]


def test_group_larger_than_the_limit_is_dropped_when_it_is_the_oldest() -> None:
    messages = [user("q"), *tool_group("a", "b", "c")]
    history = conversation(list(messages), limit=2)
    history.trim()
    assert history.messages == []


def test_consecutive_tool_groups_are_separate_groups() -> None:
    messages = [*tool_group("a"), *tool_group("b"), assistant("done")]
    history = conversation(list(messages), limit=3)
    assert history.trim() == 2
    assert history.messages == [*tool_group("b"), assistant("done")]


def test_keep_from_protects_the_turn_in_progress() -> None:
    messages = [user("1"), assistant("2"), user("3"), *tool_group("a", "b")]
    history = conversation(list(messages), limit=2)
    assert history.trim(keep_from=2) == 2
    assert history.messages == messages[2:], "above the limit, but the turn is protected"


def test_keep_from_zero_drops_nothing() -> None:
    messages = [user("1"), assistant("2"), user("3")]
    history = conversation(list(messages), limit=1)
    assert history.trim(keep_from=0) == 0
    assert history.messages == messages


def test_group_straddling_keep_from_is_kept() -> None:
    messages = [user("1"), *tool_group("a", "b"), user("2")]
    # keep_from points into the group: dropping the group would drop a protected message
    history = conversation(list(messages), limit=1)
    assert history.trim(keep_from=2) == 1
    assert history.messages == messages[1:]
    assert_valid_pairs(history.messages)


def test_trim_stops_as_soon_as_within_the_limit() -> None:
    messages = [user("1"), assistant("2"), user("3"), assistant("4")]
    history = conversation(list(messages), limit=3)
    assert history.trim(keep_from=4) == 1
    assert history.messages == messages[1:]


# -- what is sent ------------------------------------------------------------------------------


def test_for_request_leads_with_the_system_prompt() -> None:
    messages = [user("hi"), *tool_group("a"), assistant("hello")]
    history = conversation(list(messages), limit=10)
    sent = history.for_request("Be kind.")
    assert sent == [{"role": "system", "content": "Be kind."}, *messages]


@pytest.mark.parametrize("prompt", [None, ""])
def test_for_request_without_a_system_prompt(prompt: str | None) -> None:
    history = conversation([user("hi")], limit=10)
    assert history.for_request(prompt) == [user("hi")]


def test_for_request_strips_the_local_interrupted_key() -> None:
    cut: Message = {"role": "assistant", "content": "Your order is", "interrupted": True}
    history = conversation([user("where is it"), cut, user("hello?")], limit=10)
    sent = history.for_request("sys")
    assert sent[2] == {"role": "assistant", "content": "Your order is"}
    assert all("interrupted" not in message for message in sent)
    assert history.messages[1]["interrupted"] is True, "the stored message keeps its mark"


def test_for_request_returns_a_new_list() -> None:
    history = conversation([user("hi")], limit=10)
    sent = history.for_request(None)
    sent.append(user("extra"))
    assert len(history) == 1


def test_last_content() -> None:
    history = conversation(
        [user("first"), assistant("one"), user("second"), *tool_group("a")], limit=10
    )
    assert history.last_content("user") == "second"
    assert history.last_content("assistant") == "one", "a tool-call message has no text"
    assert history.last_content("system") is None


# -- property: trimming any valid history ----------------------------------------------------------


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    """A valid history: user and assistant messages and whole tool groups in any order."""
    messages: list[Message] = []
    for kind in draw(st.lists(st.sampled_from(["user", "assistant", "tools"]), max_size=25)):
        if kind == "user":
            messages.append(user("u"))
        elif kind == "assistant":
            messages.append(assistant("a"))
        else:
            count = draw(st.integers(min_value=1, max_value=4))
            messages.extend(tool_group(*(f"call_{len(messages)}_{k}" for k in range(count))))
    return messages


def group_starts(messages: list[Message]) -> set[int]:
    return {i for i, m in enumerate(messages) if m["role"] != "tool"} | {len(messages)}


@settings(max_examples=200, deadline=None, derandomize=True)
@given(messages=histories(), limit=st.integers(min_value=1, max_value=40), data=st.data())
def test_trim_keeps_any_valid_history_valid(
    messages: list[Message], limit: int, data: st.DataObject
) -> None:
    keep_from = data.draw(
        st.none() | st.integers(min_value=0, max_value=len(messages)), label="keep_from"
    )
    original = copy.deepcopy(messages)
    history = conversation(copy.deepcopy(messages), limit)

    dropped = history.trim(keep_from)

    assert history.messages == original[dropped:], "trim only drops from the front"
    assert dropped in group_starts(original), "trim drops whole groups"
    assert_valid_pairs(history.messages)
    protected = len(original) if keep_from is None else keep_from
    assert dropped <= protected, "never drops at or after keep_from"
    if keep_from is None:
        assert len(history) <= limit
    elif len(history) > limit:
        # over the limit only because the next group reaches into the protected turn
        next_start = min(s for s in group_starts(original) if s > dropped)
        assert next_start > keep_from
    if dropped:
        previous_start = max(s for s in group_starts(original) if s < dropped)
        assert len(original) - previous_start > limit, "dropped no more than needed"
