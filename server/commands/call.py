"""``vocable call SIP-URI``: place an outbound call through a running server's HTTP API
(``POST /calls``) and follow it (``GET /calls/{id}/events``) until it ends.

Prints the session id, then one JSON object per event of the call (``--quiet``: only the
``call`` events, which carry the state, result and reason). Exit status: 0 when the call was
answered, 1 when it was not (busy, no answer, rejected, failed), 2 when the server refused the
request or could not be reached. Ctrl-C hangs the call up (``DELETE /sessions/{id}``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import aiohttp

__all__ = ["add_call_arguments", "run_call"]

EXIT_NOT_ANSWERED = 1
EXIT_REFUSED = 2


def add_call_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "to",
        metavar="SIP-URI",
        help="the callee, e.g. sip:alice@192.0.2.7:5060, or a number the trunk calls",
    )
    parser.add_argument("--playbook", metavar="ID", help="playbook id (default: the server's)")
    parser.add_argument("--trunk", metavar="NAME", help="the server's trunk to call through")
    parser.add_argument(
        "--url",
        default=os.environ.get("VOCABLE_URL", "http://127.0.0.1:8080"),
        help="the running server (default $VOCABLE_URL or http://127.0.0.1:8080)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("VOCABLE_AUTH_TOKEN"),
        help="its bearer token (default $VOCABLE_AUTH_TOKEN)",
    )
    parser.add_argument(
        "--ring-timeout-s", type=float, metavar="S", help="give up after S s of ringing"
    )
    parser.add_argument("--quiet", action="store_true", help="print only the call's state changes")


def run_call(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_call(args))
    except KeyboardInterrupt:
        return 130


async def _call(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    body: dict[str, Any] = {"to": args.to}
    if args.playbook:
        body["playbook"] = args.playbook
    if args.trunk:
        body["trunk"] = args.trunk
    if args.ring_timeout_s is not None:
        body["ring_timeout_s"] = args.ring_timeout_s
    base = args.url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
        try:
            async with http.post(f"{base}/calls", json=body) as response:
                answer = await response.json(content_type=None)
                if response.status >= 300:
                    error = answer.get("error") if isinstance(answer, dict) else answer
                    print(f"vocable: {response.status}: {error}", file=sys.stderr)
                    return EXIT_REFUSED
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            print(f"vocable: cannot reach {base}: {exc}", file=sys.stderr)
            return EXIT_REFUSED
        session_id = answer["session_id"]
        print(json.dumps({"session_id": session_id}), flush=True)
        try:
            return await _follow(http, base, session_id, quiet=args.quiet)
        except asyncio.CancelledError:
            await http.delete(f"{base}/sessions/{session_id}")
            raise


async def _follow(http: aiohttp.ClientSession, base: str, session_id: str, *, quiet: bool) -> int:
    """Print the call's events until it ends; the exit status of its result."""
    last: dict[str, Any] = {}
    async with http.get(f"{base}/calls/{session_id}/events") as response:
        async for raw in response.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line.removeprefix("data:"))
            if event.get("type") == "call":
                last = event
            if not quiet or event.get("type") == "call":
                print(json.dumps(event), flush=True)
    return 0 if last.get("result") == "answered" else EXIT_NOT_ANSWERED
