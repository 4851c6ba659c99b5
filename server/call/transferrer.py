"""Handing a call to a person, whatever carries it: the transport-neutral half of a transfer.

The playbook's ``transfer_call`` tool reaches :class:`CallTransferrer` (the conversation's
``transferrer``): it says the stage's ``say`` line to the caller and waits until it has been
heard (a REFER sent sooner would cut it off), then asks the call's :class:`TransferLine` (the
transport: SIP REFER or a bridge, a media-stream event and the provider's REST API...) to put
the caller through, and returns the line's outcome. A transport that cannot transfer says so
before anything is spoken. Events (``transfer_started``, ``transfer_answered``,
``transfer_failed``) come from the conversation (:mod:`playbooks.transfer`).

:func:`synthesize` gives a transport the agent's voice as PCM for a warm transfer's summary.
"""

from __future__ import annotations

import logging
from typing import Protocol

from media.audio import Resampler
from playbooks.transfer import TransferOutcome, TransferRequest

from .voice import VoicePlaybookOrchestrator

__all__ = ["CallTransferrer", "TransferLine", "say", "synthesize"]

log = logging.getLogger(__name__)


class TransferLine(Protocol):
    """What a transport offers for transfers (``server.transports.base.TransportCall``)."""

    def transfer_problem(self, request: TransferRequest) -> str | None:
        """Why this call cannot be transferred as asked (None: it can be tried)."""
        ...

    async def transfer(self, request: TransferRequest) -> TransferOutcome:
        """Put the caller through to ``request.destination``; the outcome, never an exception
        but for cancellation. On success the transport ends or bridges the agent's leg."""
        ...


class CallTransferrer:
    """A :data:`playbooks.transfer.Transferrer` for one voice call on ``line``."""

    def __init__(self, voice: VoicePlaybookOrchestrator, line: TransferLine) -> None:
        self.voice = voice
        self.line = line

    async def __call__(self, request: TransferRequest) -> TransferOutcome:
        problem = self.line.transfer_problem(request)
        if problem is not None:
            return TransferOutcome.failed("not_supported", problem)
        if request.say:
            await say(self.voice, request.say)
        return await self.line.transfer(request)


async def say(voice: VoicePlaybookOrchestrator, text: str) -> bool:
    """Speak ``text`` to the caller in the current voice and return once it has been played
    (True) or cut short (False: a barge-in cleared it, or synthesis failed, which is logged)."""
    spoken = voice.voice()
    playbacks = []
    try:
        async for pcm in spoken.tts.synthesize(text):
            playbacks.append(voice.speaker.push(pcm, spoken.tts.sample_rate))
    except Exception:
        log.exception("the transfer line could not be synthesized")
        return False
    if not playbacks:
        return False
    voice.emit("agent_sentence", text=text, voice=spoken.id)
    results = [await playback.finished() for playback in playbacks]
    return all(result.completed for result in results)


async def synthesize(voice: VoicePlaybookOrchestrator, text: str, sample_rate: int) -> bytes:
    """``text`` in the call's current voice as PCM16 at ``sample_rate`` (for the person's leg
    of a warm transfer)."""
    spoken = voice.voice()
    resampler = Resampler(spoken.tts.sample_rate, sample_rate)
    parts = [resampler.resample(pcm) async for pcm in spoken.tts.synthesize(text)]
    return b"".join(parts) + resampler.flush()
