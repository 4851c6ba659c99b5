"""What a server process loads once and shares across calls: models, playbooks, the LLM client."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

from media import SpeechToText, Synthesizer, TextToSpeech, Transcriber
from media.remote import RemoteSynthesizer, RemoteTranscriber
from media.turn_model import TurnModel, TurnModelError
from playbooks import ChatClient, LoadedPlaybook, load_playbooks
from playbooks.identity import voice_models
from server.admission.cgroup import usable_cores
from server.config.llm import ConfigError
from server.config.server import ServerConfig
from server.llm.provider import LLMProvider

from .memory import return_free_memory

__all__ = ["Engines"]

log = logging.getLogger(__name__)


@dataclass
class Engines:
    transcriber: SpeechToText
    synthesizer: TextToSpeech
    playbooks: dict[str, LoadedPlaybook]
    llm_provider: LLMProvider
    turn_model: TurnModel | None = None
    """The audio end-of-turn model the calls share (None: words and silence alone)."""

    @property
    def llm(self) -> ChatClient | None:
        """The calls' LLM; None while there is none (not configured, downloading, failed)."""
        return self.llm_provider.client

    @property
    def default_playbook(self) -> str:
        return next(iter(self.playbooks))

    @classmethod
    async def load(cls, config: ServerConfig) -> Engines:
        """Load playbooks (raising ``PlaybookError``), the LLM (see :class:`LLMProvider`;
        ``ConfigError`` for a model file it cannot load), then speech recognition and synthesis
        concurrently, each warmed up: local Whisper and Piper in worker threads, or clients of
        the configured remote servers (which may be down: that is logged, not fatal)."""
        playbooks = load_playbooks(config.playbook, config.tools_module)
        llm = LLMProvider.of_server(config)
        # first: a model file llama.cpp cannot load stops the server at once
        await llm.start(prime=list(playbooks.values()))
        try:
            transcriber, synthesizer, turn_model = await asyncio.gather(
                _transcriber(config), _synthesizer(config), _turn_model(config)
            )
        except BaseException:
            await llm.close()
            raise
        if isinstance(synthesizer, Synthesizer):  # the playbooks' voices, once per process
            models = [m for p in playbooks.values() for m in voice_models(p.spec, p.source)]
            await asyncio.to_thread(synthesizer.preload, list(dict.fromkeys(models)))
            if isinstance(transcriber, Transcriber):  # a decode under way: synthesize lean
                synthesizer.also_contended = lambda: transcriber.in_flight > 0
        await asyncio.to_thread(return_free_memory)  # what rewriting the voice graphs freed
        return cls(transcriber, synthesizer, playbooks, llm, turn_model)

    async def close(self) -> None:
        await self.transcriber.aclose()
        await self.synthesizer.aclose()
        await self.llm_provider.close()
        if self.turn_model is not None:
            self.turn_model.close()
        if any(p.spec.mcp_servers for p in self.playbooks.values()):
            from playbooks.mcp import close_mcp_sessions

            await asyncio.to_thread(close_mcp_sessions)


async def _transcriber(config: ServerConfig) -> SpeechToText:
    if config.remote_stt is None:
        return await asyncio.to_thread(Transcriber.load, config.transcriber)
    remote = RemoteTranscriber(config.remote_stt)
    log.info("speech recognition: %s, model %s", remote.endpoint, config.remote_stt.model)
    await remote.warm_up()
    return remote


async def _turn_model(config: ServerConfig) -> TurnModel | None:
    if config.turn_model is None:
        return None
    try:
        return await asyncio.to_thread(TurnModel.load, config.turn_model)
    except TurnModelError as exc:
        raise ConfigError(str(exc)) from None


async def _synthesizer(config: ServerConfig) -> TextToSpeech:
    if config.remote_tts is None:
        local = config.synthesizer
        if local.cores is None:  # Piper's threads within the CPU quota, not the host's cores
            local = dataclasses.replace(local, cores=usable_cores())
        return await asyncio.to_thread(Synthesizer.load, local)
    remote = RemoteSynthesizer(config.remote_tts)
    settings = config.remote_tts
    log.info(
        "speech synthesis: %s, model %s, voice %s", remote.endpoint, settings.model, settings.voice
    )
    await remote.warm_up()
    return remote
