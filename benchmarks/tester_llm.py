"""The LLM a benchmark of ``vocable test``'s judge or simulated caller asks: a GGUF model run in
process (llama.cpp, as the server embeds it), or any OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

from playbooks import ChatClient
from server.config.server import LocalLLMSettings
from server.llm.provider import LLMProvider

from .models import model_path

__all__ = ["add_llm_source", "llm_client"]


def add_llm_source(parser: argparse.ArgumentParser, default_model: str) -> None:
    """``--llm-gguf FILE|NAME`` or ``--base-url URL`` (with ``--model``, ``--api-key``)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--llm-gguf",
        type=model_path,
        help="a GGUF model run in process: a file, or a name "
        "of benchmarks.models (qwen2.5-coder-0.5b, smollm2-135m)",
    )
    source.add_argument("--base-url", help="an OpenAI-compatible endpoint")
    parser.add_argument("--model", default=default_model, help="the endpoint's model name")
    parser.add_argument("--api-key")


@contextlib.asynccontextmanager
async def llm_client(args: argparse.Namespace) -> AsyncIterator[ChatClient]:
    """The client of the flags of :func:`add_llm_source`, closed (the model stopped) after."""
    if args.base_url:
        client = ChatClient.connect(args.base_url, args.api_key, args.model)
        try:
            yield client
        finally:
            await client.aclose()
        return
    provider = LLMProvider(None, LocalLLMSettings(gguf=args.llm_gguf, search=False), announce=False)
    try:
        await provider.start()
        ready = await provider.ready()
        if ready is None:
            raise SystemExit(f"no model: {provider.status.detail}")
        yield ready
    finally:
        await provider.close()
