"""What a server process loads once and shares across calls: models, playbooks, the LLM client."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from media import Synthesizer, Transcriber
from playbooks import ChatClient, LoadedPlaybook, RetryPolicy, load_playbooks

from .config import ServerConfig

__all__ = ["Engines"]

log = logging.getLogger(__name__)


@dataclass
class Engines:
    transcriber: Transcriber
    synthesizer: Synthesizer
    playbooks: dict[str, LoadedPlaybook]
    llm: ChatClient | None
    """None when no LLM endpoint is configured."""

    @property
    def default_playbook(self) -> str:
        return next(iter(self.playbooks))

    @classmethod
    async def load(cls, config: ServerConfig) -> Engines:
        """Load playbooks (raising ``PlaybookError``), then Whisper and Piper in worker threads,
        concurrently, each warmed up."""
        playbooks = load_playbooks(config.playbook_path)
        transcriber, synthesizer = await asyncio.gather(
            asyncio.to_thread(Transcriber.load, config.transcriber),
            asyncio.to_thread(Synthesizer.load, config.synthesizer),
        )
        llm = None
        if config.llm is not None:
            llm = ChatClient.connect(
                config.llm.base_url,
                config.llm.api_key,
                config.llm.model,
                retry=RetryPolicy(retries=config.llm_retries),
            )
        else:
            log.warning("no LLM endpoint configured: calls connect, but the agent cannot answer")
        return cls(transcriber, synthesizer, playbooks, llm)

    async def close(self) -> None:
        self.transcriber.close()
        self.synthesizer.close()
        if self.llm is not None:
            await self.llm.client.close()
