"""``vocable test PATH...``: run spoken scenario tests of playbooks (see
:mod:`server.testkit.scenarios`) and report them: readable text on stdout, ``--json`` and
``--junit`` files, the conversations' audio with ``--keep-audio``. Exit status: 0 when every run
passed, 1 when one failed, 2 for invalid scenario files or flags (nothing is run then)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from server.config.command_flags import positive_int
from server.config.llm import ConfigError, add_llm_arguments

if TYPE_CHECKING:  # the test kit (aiortc callers, the scripted LLM) loads only to run tests
    from playbooks.errors import Problem
    from server.testkit.scenarios import LoadedScenario, RigOptions, ScenarioResult

__all__ = ["add_test_arguments", "run_tests"]

EXIT_FAILED = 1
EXIT_USAGE = 2


def add_test_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="scenario files, or folders searched for *.scenario.yaml",
    )
    run = parser.add_argument_group("running")
    run.add_argument(
        "--transport",
        choices=("webrtc", "sip"),
        default="webrtc",
        help="how the calls are placed (default webrtc)",
    )
    run.add_argument(
        "--mode",
        choices=("voice", "text"),
        help="run every scenario in this mode (default: each file's)",
    )
    run.add_argument(
        "--agent-llm",
        choices=("script", "configured"),
        help="the agent's LLM for every scenario: its turns' scripts, or the configured LLM"
        " (default: the file's; a file with scripts runs them)",
    )
    run.add_argument(
        "--jobs", type=positive_int, default=1, metavar="N", help="runs at once (default 1)"
    )
    run.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        metavar="N",
        help="run each scenario N times and report its pass rate",
    )
    run.add_argument(
        "--url", metavar="URL", help="test a running server instead of starting one per run"
    )
    run.add_argument("--token", metavar="TOKEN", help="the running server's --auth-token")
    run.add_argument(
        "--sip-port",
        type=positive_int,
        metavar="PORT",
        help="the running server's SIP port (--url with --transport sip)",
    )
    add_llm_arguments(parser)
    judge = parser.add_argument_group("judge (semantic checks and simulated callers)")
    judge.add_argument(
        "--judge",
        choices=("auto", "configured", "none"),
        default="auto",
        help="'auto': --judge-base-url if given, else the configured LLM when the agent runs on"
        " it; 'configured': the configured LLM (the embedded model by default) even for"
        " scripted runs; 'none': skip semantic checks (default auto)",
    )
    judge.add_argument(
        "--judge-base-url", metavar="URL", help="an OpenAI-compatible endpoint to judge with"
    )
    judge.add_argument("--judge-model", metavar="NAME", default="judge", help="its model name")
    judge.add_argument("--judge-api-key", metavar="KEY", help="its API key")
    report = parser.add_argument_group("reports")
    report.add_argument("--junit", type=Path, metavar="FILE", help="write JUnit XML here")
    report.add_argument("--json", type=Path, metavar="FILE", help="write the JSON report here")
    report.add_argument(
        "--keep-audio",
        type=Path,
        metavar="DIR",
        help="keep each conversation's audio (stereo WAV) here",
    )
    report.add_argument("-q", "--quiet", action="store_true", help="list turns of failed runs only")


def run_tests(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Load every scenario (all problems of all files, then exit 2), run them, report."""
    from server.testkit.scenarios.report import write_json, write_junit, write_text

    if args.url is not None and args.transport == "sip" and args.sip_port is None:
        raise ConfigError("--url with --transport sip needs the server's --sip-port")
    loaded = _load_all(args.paths)
    options = _options(args)
    results = asyncio.run(_run_all(loaded, options, args))
    write_text(results, out, verbose=not args.quiet)
    if args.json is not None:
        with args.json.open("w") as file:
            write_json(results, file)
    if args.junit is not None:
        with args.junit.open("w") as file:
            write_junit(results, file)
    return 0 if all(result.passed for result in results) else EXIT_FAILED


def _load_all(paths: list[Path]) -> list[LoadedScenario]:
    from server.testkit.scenarios import ScenarioError, find_scenarios, load_scenario

    problems: list[Problem] = []
    loaded: list[LoadedScenario] = []
    for path in find_scenarios(paths):
        try:
            loaded.append(load_scenario(path))
        except ScenarioError as exc:
            problems += exc.problems
    if problems:
        raise ScenarioError.of(problems)
    return loaded


def _options(args: argparse.Namespace) -> RigOptions:
    from playbooks import ChatClient
    from server.config.llm import LLMChoice
    from server.config.server import LocalLLMSettings
    from server.testkit.scenarios import AgentLLM, RigOptions

    choice = LLMChoice.resolve(args)
    agent = AgentLLM(choice.endpoint, LocalLLMSettings.of(choice))
    judge = None
    if args.judge_base_url:
        judge = ChatClient.connect(args.judge_base_url, args.judge_api_key, args.judge_model)
    return RigOptions(
        transport=args.transport,
        url=args.url,
        token=args.token,
        sip_port=args.sip_port,
        agent=agent,
        agent_llm=args.agent_llm,
        judge=judge,
        judge_configured={"auto": None, "configured": True, "none": False}[args.judge],
        mode=args.mode,
        keep_audio=args.keep_audio,
        tool_calling=choice.tool_calling,
    )


async def _run_all(
    loaded: list[LoadedScenario], options: RigOptions, args: argparse.Namespace
) -> list[ScenarioResult]:
    from server.testkit.scenarios import ScenarioRig

    runs = [(scenario, n + 1) for scenario in loaded for n in range(args.repeat)]
    print(f"vocable: {len(runs)} scenario run(s), {args.jobs} at once", file=sys.stderr, flush=True)
    gate = asyncio.Semaphore(args.jobs)

    async def one(rig: ScenarioRig, scenario: LoadedScenario, n: int) -> ScenarioResult:
        async with gate:
            result = await rig.run(scenario, n)
        mark = "pass" if result.passed else "FAIL"
        print(f"vocable: {mark} {scenario.label} (run {n})", file=sys.stderr, flush=True)
        return result

    try:
        async with ScenarioRig(options) as rig:
            return list(await asyncio.gather(*(one(rig, s, n) for s, n in runs)))
    finally:
        if options.judge is not None:
            await options.judge.aclose()
