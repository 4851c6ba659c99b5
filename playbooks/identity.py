"""Who the agent is in a stage: its persona (the prompt's identity block), voice and language.

``set_language`` is the built-in tool a playbook enables by listing it in ``global_tools`` or a
stage's ``tools``; it changes the conversation's language (the prompt's language line and,
where the language configures one, the voice).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .models import Persona, Playbook, Stage, Voice
from .tools import InvalidToolCall, Tool

__all__ = [
    "BUILTIN_TOOLS",
    "LANGUAGE_TOOL",
    "effective_voice",
    "identity_block",
    "language_instruction",
    "language_tool",
    "resolve_language",
    "resolve_model",
    "stage_persona",
    "voice_models",
]

LANGUAGE_TOOL = "set_language"
BUILTIN_TOOLS = frozenset({LANGUAGE_TOOL})
"""Tool names a playbook may list without defining them."""


def stage_persona(spec: Playbook, stage: Stage) -> Persona | None:
    """The persona in ``stage``: its own, else the playbook's; None: no identity block."""
    return stage.persona or spec.persona


def identity_block(persona: Persona | None) -> str:
    """The prompt's identity block; empty without a persona."""
    if persona is None:
        return ""
    lines = ["Your identity:", f"- Role: {persona.role.strip()}"]
    if persona.description and persona.description.strip():
        lines.append(f"- Description: {persona.description.strip()}")
    return "\n".join(lines)


def language_instruction(spec: Playbook, code: str | None) -> str:
    """The prompt's language line for ``code``; empty when no language is set."""
    if not code:
        return ""
    language = spec.languages.get(code)
    if language is not None and language.instruction:
        return language.instruction
    name = language.name if language is not None and language.name else code
    return f"Answer in {name}."


def resolve_language(spec: Playbook, requested: str) -> str:
    """The code of the configured language ``requested`` names (its code or name, any case);
    any non-empty name when the playbook configures none. Raises InvalidToolCall."""
    wanted = requested.strip()
    if not spec.languages:
        if not wanted:
            raise InvalidToolCall("language must not be empty")
        return wanted
    for code, language in spec.languages.items():
        if wanted.casefold() in (code.casefold(), (language.name or code).casefold()):
            return code
    raise InvalidToolCall(f"language must be one of {sorted(spec.languages)}")


def effective_voice(
    spec: Playbook, stage: Stage, language: str | None, source: Path | None
) -> Voice | None:
    """The voice in effect: the language's over the stage's over the playbook's (field by
    field), its model path made absolute against the playbook file's folder; None: the
    server's voice as it is."""
    voice: Voice | None = None
    spoken = spec.languages.get(language) if language else None
    for layer in (spec.voice, stage.voice, spoken.voice if spoken else None):
        if layer is not None:
            voice = layer.merged_over(voice)
    if voice is None or voice.model is None:
        return voice
    return voice.model_copy(update={"model": str(resolve_model(voice.model, source))})


def resolve_model(model: str, source: Path | None) -> Path:
    """A voice ``model`` path, relative to the folder of the playbook file ``source``."""
    path = Path(model)
    if not path.is_absolute() and source is not None:
        path = source.parent / path
    return path


def voice_models(spec: Playbook, source: Path | None) -> list[Path]:
    """Every voice file the playbook names (each once), to load before serving."""
    voices = [spec.voice, *(s.voice for s in spec.stages)]
    voices += [language.voice for language in spec.languages.values()]
    models = [resolve_model(v.model, source) for v in voices if v is not None and v.model]
    return list(dict.fromkeys(models))


def language_tool(spec: Playbook, switch: Callable[[str], None]) -> Tool:
    """``set_language(language)``: calls ``switch(code)`` on the event loop and reports it."""
    described = ", ".join(
        f"{code} ({language.name})" if language.name else code
        for code, language in spec.languages.items()
    )
    prop: dict[str, Any] = {"type": "string", "description": "The language to speak from now on."}
    if spec.languages:
        prop["enum"] = list(spec.languages)
        prop["description"] += f" One of: {described}."

    async def set_language(language: Any = None) -> dict[str, str]:
        if not isinstance(language, str):
            raise InvalidToolCall("language must be a string")
        code = resolve_language(spec, language)
        switch(code)
        return {"language": code, "instruction": language_instruction(spec, code)}

    return Tool(
        name=LANGUAGE_TOOL,
        description="Switch the language of the conversation when the caller asks for another.",
        parameters={"type": "object", "properties": {"language": prop}, "required": ["language"]},
        function=set_language,
        side_effects=False,  # conversation state only: an undone turn restores it
    )
