"""Playbooks: stages and transitions that drive an LLM through two-phase turns.

Knows text, LLMs and tools; nothing about audio or HTTP.
"""

from .context import PlaybookContext, current_context
from .engine import (
    EngineSnapshot,
    IntentResult,
    PlaybookEngine,
    TransitionContext,
    TransitionRecord,
    TurnFacts,
)
from .events import EventBus, OrchestratorEvent, Retraction
from .history import Conversation
from .llm import ChatClient, ChatRequest, LLMError, RetryPolicy, ToolCallRequest
from .loader import (
    LoadedPlaybook,
    PlaybookError,
    check_playbook,
    load_playbook,
    load_playbooks,
)
from .models import (
    BargeInPolicy,
    LLMConfig,
    Playbook,
    Stage,
    ToolCalling,
    ToolDefinition,
    Transition,
    TransitionAction,
)
from .orchestrator import OrchestratorOptions, PlaybookOrchestrator, Snapshot
from .tools import Tool, ToolError, tool
from .turn import Turn, TurnHost

__all__ = [
    "BargeInPolicy",
    "ChatClient",
    "ChatRequest",
    "Conversation",
    "EngineSnapshot",
    "EventBus",
    "IntentResult",
    "LLMConfig",
    "LLMError",
    "LoadedPlaybook",
    "OrchestratorEvent",
    "OrchestratorOptions",
    "Playbook",
    "PlaybookContext",
    "PlaybookEngine",
    "PlaybookError",
    "PlaybookOrchestrator",
    "Retraction",
    "RetryPolicy",
    "Snapshot",
    "Stage",
    "Tool",
    "ToolCallRequest",
    "ToolCalling",
    "ToolDefinition",
    "ToolError",
    "Transition",
    "TransitionAction",
    "TransitionContext",
    "TransitionRecord",
    "Turn",
    "TurnFacts",
    "TurnHost",
    "check_playbook",
    "current_context",
    "load_playbook",
    "load_playbooks",
    "tool",
]
