"""Where the LLM is: command-line flags first, then ``VOCABLE_*``, then ``OPENAI_*`` variables."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MODEL",
    "ENV_NAMES",
    "LLM_GROUP",
    "ConfigError",
    "LLMSettings",
    "add_llm_arguments",
]

DEFAULT_MODEL = "gpt-4o-mini"
LLM_GROUP = "LLM endpoint (any OpenAI-compatible server)"
"""The --help group of the LLM flags; ``vocable serve`` adds its LLM options to it."""

ENV_NAMES: dict[str, tuple[str, ...]] = {
    "llm_base_url": ("VOCABLE_LLM_BASE_URL", "OPENAI_BASE_URL"),
    "llm_api_key": ("VOCABLE_LLM_API_KEY", "OPENAI_API_KEY"),
    "llm_model": ("VOCABLE_LLM_MODEL",),
}
"""The variables read for each flag left out, first set (and not empty) first."""


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

        def given(dest: str) -> str | None:
            values = (getattr(args, dest), *(env.get(name) for name in ENV_NAMES[dest]))
            return next((value for value in values if value), None)

        base_url, api_key = given("llm_base_url"), given("llm_api_key")
        model = given("llm_model") or default_model or DEFAULT_MODEL
        if not base_url and not api_key:
            raise ConfigError(
                "no LLM endpoint configured: pass --llm-base-url (any OpenAI-compatible server, "
                "e.g. http://127.0.0.1:11434/v1 for Ollama) or set VOCABLE_LLM_BASE_URL; "
                "for OpenAI itself set OPENAI_API_KEY"
            )
        return cls(base_url=base_url, api_key=api_key, model=model)


def add_llm_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The LLM endpoint flags, in their own --help group (returned, for more LLM flags)."""

    def env(dest: str) -> str:
        return "env " + ", ".join(ENV_NAMES[dest])

    group = parser.add_argument_group(LLM_GROUP)
    group.add_argument(
        "--llm-base-url",
        metavar="URL",
        help="chat-completions base URL, e.g. http://127.0.0.1:11434/v1 "
        f"[{env('llm_base_url')}; default: OpenAI]",
    )
    group.add_argument(
        "--llm-model",
        metavar="NAME",
        help=f"model name [{env('llm_model')}; default: the playbook's, else {DEFAULT_MODEL}]",
    )
    group.add_argument(
        "--llm-api-key",
        metavar="KEY",
        help=f"API key [{env('llm_api_key')}; local servers need none]",
    )
    return group
