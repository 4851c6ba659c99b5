"""Where the LLM is: command-line flags first, then ``VOCABLE_*``, then ``OPENAI_*`` variables."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_MODEL", "ConfigError", "LLMSettings", "add_llm_arguments"]

DEFAULT_MODEL = "gpt-4o-mini"


class ConfigError(ValueError):
    """A setting is missing or invalid; the message says how to fix it."""


@dataclass(frozen=True)
class LLMSettings:
    base_url: str | None
    api_key: str | None
    model: str

    @classmethod
    def resolve(
        cls,
        args: argparse.Namespace,
        env: Mapping[str, str] = os.environ,
        default_model: str | None = None,
    ) -> LLMSettings:
        """Settings from parsed flags and the environment; raises :class:`ConfigError` when no
        endpoint is configured at all (no base URL and no API key)."""
        base_url = (
            args.llm_base_url or env.get("VOCABLE_LLM_BASE_URL") or env.get("OPENAI_BASE_URL")
        )
        api_key = args.llm_api_key or env.get("VOCABLE_LLM_API_KEY") or env.get("OPENAI_API_KEY")
        model = args.llm_model or env.get("VOCABLE_LLM_MODEL") or default_model or DEFAULT_MODEL
        if not base_url and not api_key:
            raise ConfigError(
                "no LLM endpoint configured: pass --llm-base-url (any OpenAI-compatible server, "
                "e.g. http://127.0.0.1:11434/v1 for Ollama) or set VOCABLE_LLM_BASE_URL; "
                "for OpenAI itself set OPENAI_API_KEY"
            )
        return cls(base_url=base_url or None, api_key=api_key or None, model=model)


def add_llm_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LLM endpoint (any OpenAI-compatible server)")
    group.add_argument(
        "--llm-base-url",
        metavar="URL",
        help="chat-completions base URL, e.g. http://127.0.0.1:11434/v1 "
        "[env VOCABLE_LLM_BASE_URL, OPENAI_BASE_URL; default: OpenAI]",
    )
    group.add_argument(
        "--llm-model",
        metavar="NAME",
        help=f"model name [env VOCABLE_LLM_MODEL; default: the playbook's, else {DEFAULT_MODEL}]",
    )
    group.add_argument(
        "--llm-api-key",
        metavar="KEY",
        help="API key [env VOCABLE_LLM_API_KEY, OPENAI_API_KEY; local servers need none]",
    )
