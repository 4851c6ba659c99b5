"""One soak call: connect, hear the greeting, ask one question, hear the answer, hang up.

Calls vary with their index so that every way a call runs and ends is repeated many times:

- input: even calls speak a corpus question (VAD, speculative STT and Whisper on the server); odd
  calls type its text over the data channel (the web client's text box), which spares the caller
  the seconds of speaking and the server a Whisper decode, and exercises the typed-turn path;
- hang-up: ``message`` (the web client's ``{"type": "hangup"}``, confirmed by the server),
  ``delete`` (``DELETE /sessions/{id}``) or ``drop`` (the peer connection closes, as when a tab is
  closed); every call finally closes its peer connection;
- calls 3 and 4 of every 8 hang up as soon as the answer starts playing, so the server cancels a
  turn mid-speech (Piper and the speaker busy); the others hear the whole answer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import aiohttp

from server.testkit.caller import WebRTCCaller

from .corpus import Utterance
from .scenarios import BenchTarget

__all__ = ["CALL_TIMEOUT_S", "CallStyle", "soak_call"]

HangUp = Literal["message", "delete", "drop"]
HANG_UPS: tuple[HangUp, ...] = ("message", "delete", "drop")
CALL_TIMEOUT_S = 60.0
"""A whole call, connection to hang-up; a call that takes longer has failed."""
Record = dict[str, Any]


@dataclass(frozen=True)
class CallStyle:
    spoken: bool
    """The question is spoken (else typed)."""
    hang_up: HangUp
    early: bool
    """Hang up as soon as the answer starts playing."""

    @classmethod
    def of(cls, index: int) -> CallStyle:
        """Call ``index``'s style: any 12 calls in a row take each of the 12 styles once."""
        return cls(index % 2 == 0, HANG_UPS[index % 3], index % 12 >= 6)


async def soak_call(target: BenchTarget, index: int, question: Utterance) -> Record:
    """Run call ``index`` asking ``question``; a record with ``ok`` and, when not ok, ``error``
    (and the ``step`` it failed at). Never raises for a failed call; always closes its peer."""
    style = CallStyle.of(index)
    record: Record = {"call": index, "utterance": question.id, **asdict(style), "step": "connect"}
    started = time.monotonic()
    caller = WebRTCCaller()
    error: str | None
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            extra = {"playbook": target.playbook} if target.playbook else {}
            await caller.connect(target.base_url, token=target.token, **extra)
            error = await _converse(caller, question, style, record)
            if error is None:
                record["step"] = "hang-up"
                error = await _hang_up(caller, target, style.hang_up)
    except TimeoutError:
        error = f"no progress in {CALL_TIMEOUT_S:g} s"
    except (RuntimeError, OSError, aiohttp.ClientError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        await caller.close()
    record["seconds"] = round(time.monotonic() - started, 2)
    record["ok"] = error is None
    if error is not None:
        record["error"] = error
    else:
        del record["step"]
    return record


async def _converse(
    caller: WebRTCCaller, question: Utterance, style: CallStyle, record: Record
) -> str | None:
    """Greeting, question, answer; what went wrong, if anything."""
    record["step"] = "greeting"
    await caller.wait_for("tts_end", 1, CALL_TIMEOUT_S)
    record["step"] = "answer"
    if style.spoken:
        caller.say(question.pcm())
    else:
        caller.send({"type": "text", "text": question.text})
    await caller.wait_for("tts_start" if style.early else "tts_end", 2, CALL_TIMEOUT_S)
    errors = caller.of_type("error")
    if errors:
        return f"the server reported an error: {errors[0]}"
    if style.spoken:
        heard = [event["text"] for event in caller.of_type("transcript") if event["text"]]
        if not heard:
            return "the spoken question was not transcribed"
        record["transcript"] = heard[-1]
    return None


async def _hang_up(caller: WebRTCCaller, target: BenchTarget, how: HangUp) -> str | None:
    if how == "message":
        caller.send({"type": "hangup"})
        await caller.wait_for("hangup", 1, CALL_TIMEOUT_S)  # the server's word that it ended
    elif how == "delete":
        headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        url = f"{target.base_url}/sessions/{caller.session_id}"
        async with aiohttp.ClientSession() as http, http.delete(url, headers=headers) as response:
            if response.status != 200:
                return f"DELETE /sessions answered {response.status}: {await response.text()}"
    return None  # "drop": closing the peer connection (every call does) is the hang-up
