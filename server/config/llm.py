"""Where the LLM is: command-line flags first, then ``VOCABLE_*``, then ``OPENAI_*`` variables.

With no endpoint configured, ``--llm auto`` (the default) looks for a local OpenAI-compatible
server, then runs a model in process (``--llm-gguf FILE``, else the default model, downloaded
once); ``--llm local`` skips the search; ``--llm none`` runs without one on purpose."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast, get_args

from playbooks.models import ToolCalling

__all__ = [
    "DEFAULT_MODEL",
    "ENV_NAMES",
    "LLM_GROUP",
    "ConfigError",
    "LLMChoice",
    "LLMMode",
    "LLMSettings",
    "add_llm_arguments",
]

LLMMode = Literal["auto", "local", "none"]

DEFAULT_MODEL = "gpt-4o-mini"
LLM_GROUP = "LLM (embedded llama.cpp, or any OpenAI-compatible server)"
"""The --help group of the LLM flags; ``vocable serve`` adds its LLM options to it."""

ENV_NAMES: dict[str, tuple[str, ...]] = {
    "llm_base_url": ("VOCABLE_LLM_BASE_URL", "OPENAI_BASE_URL"),
    "llm_api_key": ("VOCABLE_LLM_API_KEY", "OPENAI_API_KEY"),
    "llm_model": ("VOCABLE_LLM_MODEL",),
    "llm": ("VOCABLE_LLM",),
    "llm_gguf": ("VOCABLE_LLM_GGUF",),
    "llm_tool_calling": ("VOCABLE_LLM_TOOL_CALLING",),
}
"""The variables read for each flag left out, first set (and not empty) first."""


class ConfigError(ValueError):
    """A setting is missing or invalid; the message says how to fix it."""


@dataclass(frozen=True)
class LLMSettings:
    base_url: str | None
    api_key: str | None
    model: str


@dataclass(frozen=True)
class LLMChoice:
    """What the LLM flags ask for: an endpoint, or a model in process, or nothing."""

    mode: LLMMode
    endpoint: LLMSettings | None
    """The configured endpoint (a base URL or an API key was given); None otherwise."""
    gguf: Path | None
    """``--llm-gguf``: the model file to run in process."""
    model: str | None
    """``--llm-model`` as given (None: the playbook's or the server's own)."""
    tool_calling: ToolCalling = "native"
    """``--llm-tool-calling``: who calls the tools where a playbook does not say."""

    @property
    def embedded(self) -> bool:
        """Whether no endpoint serves the calls: a local one is searched for or run."""
        return self.endpoint is None and self.mode != "none"

    @classmethod
    def resolve(
        cls,
        args: argparse.Namespace,
        env: Mapping[str, str] = os.environ,
        default_model: str | None = None,
    ) -> LLMChoice:
        """The choice of parsed flags and the environment; raises :class:`ConfigError` for an
        unknown mode, or flags (or variables) that contradict each other. A flag beats a
        variable, of its own setting or of one it contradicts."""
        flags = {
            "llm": getattr(args, "llm", None),
            "llm_gguf": getattr(args, "llm_gguf", None),
            "llm_base_url": getattr(args, "llm_base_url", None),
        }
        variables = {
            "llm": env.get("VOCABLE_LLM") or None,
            "llm_gguf": env.get("VOCABLE_LLM_GGUF") or None,
            "llm_base_url": env.get("VOCABLE_LLM_BASE_URL") or None,
        }
        _refuse_contradictions(flags, "--llm", "--llm-gguf", "--llm-base-url")
        unflagged = {dest: None if flags[dest] else value for dest, value in variables.items()}
        _refuse_contradictions(unflagged, "VOCABLE_LLM", "VOCABLE_LLM_GGUF", "VOCABLE_LLM_BASE_URL")
        chosen = dict(flags)
        for dest, value in variables.items():
            if chosen[dest] is None and not _contradicts(dest, value, flags):
                chosen[dest] = value
        mode_text = chosen["llm"] or "auto"
        if mode_text not in get_args(LLMMode):
            raise ConfigError(f"--llm {mode_text}: choose auto, local or none [env VOCABLE_LLM]")
        mode = cast(LLMMode, mode_text)
        gguf = Path(chosen["llm_gguf"]).expanduser() if chosen["llm_gguf"] else None
        endpoint: LLMSettings | None = None
        if gguf is None and mode != "local":  # in process, as asked: OPENAI_* do not count
            base_url = chosen["llm_base_url"] or env.get("OPENAI_BASE_URL") or None
            api_key = getattr(args, "llm_api_key", None) or next(
                (env[name] for name in ENV_NAMES["llm_api_key"] if env.get(name)), None
            )
            if base_url or api_key:
                model = getattr(args, "llm_model", None) or env.get("VOCABLE_LLM_MODEL")
                endpoint = LLMSettings(base_url, api_key, model or default_model or DEFAULT_MODEL)
        model_given = getattr(args, "llm_model", None) or env.get("VOCABLE_LLM_MODEL") or None
        calling = getattr(args, "llm_tool_calling", None) or env.get("VOCABLE_LLM_TOOL_CALLING")
        if (calling or "native") not in get_args(ToolCalling):
            raise ConfigError(
                f"--llm-tool-calling {calling}: choose native or guided "
                "[env VOCABLE_LLM_TOOL_CALLING]"
            )
        return cls(
            mode=mode,
            endpoint=endpoint,
            gguf=gguf,
            model=model_given,
            tool_calling=cast(ToolCalling, calling or "native"),
        )


def _contradicts(dest: str, value: str | None, others: Mapping[str, str | None]) -> bool:
    """Whether ``dest`` = ``value`` contradicts one of ``others`` (same keys)."""
    return value is not None and _contradiction({**others, dest: value}) is not None


def _contradiction(values: Mapping[str, str | None]) -> tuple[str, str] | None:
    """The two settings of ``values`` that contradict each other, if any."""
    mode, gguf, url = values["llm"], values["llm_gguf"], values["llm_base_url"]
    if mode == "none" and gguf:
        return ("llm", "llm_gguf")
    if gguf and url:
        return ("llm_gguf", "llm_base_url")
    if mode == "local" and url:
        return ("llm", "llm_base_url")
    return None


def _refuse_contradictions(values: Mapping[str, str | None], *names: str) -> None:
    """Raise :class:`ConfigError` naming the two of ``names`` (in the order llm, llm_gguf,
    llm_base_url) that contradict each other."""
    pair = _contradiction(values)
    if pair is None:
        return
    label = dict(zip(("llm", "llm_gguf", "llm_base_url"), names, strict=True))
    mode = label["llm"] + (" " if label["llm"].startswith("--") else "=") + str(values["llm"])
    shown = {**label, "llm": mode}
    first, second = pair
    raise ConfigError(f"{shown[first]} and {shown[second]} contradict each other: drop one")


def add_llm_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The LLM endpoint flags, in their own --help group (returned, for more LLM flags)."""

    def env(dest: str) -> str:
        return "env " + ", ".join(ENV_NAMES[dest])

    group = parser.add_argument_group(LLM_GROUP)
    group.add_argument(
        "--llm",
        choices=get_args(LLMMode),
        help="without an endpoint (--llm-base-url, OPENAI_API_KEY): 'auto' uses a local "
        "server (Ollama, LM Studio, llama.cpp, vLLM) if one runs, else a model in process; "
        "'local' runs the model in process; "
        f"'none' runs without an LLM [{env('llm')}; default auto]",
    )
    group.add_argument(
        "--llm-gguf",
        metavar="FILE",
        help="run this GGUF model file in process (llama.cpp) "
        f"[{env('llm_gguf')}; default: a small instruct model, downloaded once]",
    )
    group.add_argument(
        "--llm-base-url",
        metavar="URL",
        help="chat-completions base URL, e.g. http://127.0.0.1:11434/v1 "
        f"[{env('llm_base_url')}; default: OpenAI with OPENAI_API_KEY, else none]",
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
    group.add_argument(
        "--llm-tool-calling",
        choices=get_args(ToolCalling),
        help="who calls the tools where a playbook's llm_config does not say: 'native', the "
        "model; 'guided', the engine, on details the caller gave (for small models) "
        f"[{env('llm_tool_calling')}; default native]",
    )
    return group
