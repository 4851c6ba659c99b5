"""Running scenarios: through a real call (a server started for the run, or a running one), or
typed to the playbook alone (``mode: text``).

:class:`ScenarioRig` holds what runs share (Whisper and Piper, the agent's LLM when it is the
configured one, the judge); each run gets its own server on loopback (its own scripted LLM when
the scenario is scripted), so runs can go on at once without hearing each other's LLM script.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import wave
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from media import SpeechToText, Synthesizer, SynthesizerSettings, TextToSpeech, Transcriber
from media.audio import FRAME_BYTES, FRAME_MS, SAMPLE_RATE
from media.turn_model import TurnModel
from playbooks import (
    ChatClient,
    OrchestratorEvent,
    OrchestratorOptions,
    PlaybookOrchestrator,
    Retraction,
    ToolCalling,
)
from server.admission.cgroup import usable_cores
from server.call.events import voice_event_of
from server.call.keypad import keypad_line
from server.config.llm import LLMSettings
from server.config.server import LocalLLMSettings, ServerConfig, SipSettings
from server.http.app import SIP, create_app
from server.llm.provider import LLMProvider
from server.runtime.engines import Engines
from server.testkit.echo_path import ReturnedEcho
from server.testkit.network import NetworkPath

from ..loopback import start_on_loopback
from ..scripted_llm import ScriptedLLM
from .checks import TurnFacts, check_turn, words_of
from .files import LoadedScenario, load_scenario
from .judge import Exchange, Judge, SimulatedCallerLLM
from .lines import (
    CallLine,
    SentSpeech,
    Transport,
    first_sound_after,
    heard_between,
    heard_spans,
    last_sound,
    open_line,
    silent_from,
)
from .model import Expectation, Scenario, SimulatedCaller, Turn
from .result import ScenarioResult, TurnResult
from .script import TurnScript
from .speech import CallerSpeech, SpeechError, impaired, read_wav

__all__ = ["AgentLLM", "RigOptions", "ScenarioRig", "TurnTimeout", "run_scenario"]

log = logging.getLogger(__name__)

QUIET_S = 0.6
"""How long the agent must be idle and silent before a turn counts as over."""
TAIL_S = 1.0
"""The most silence an answer's audio may end in after its last sound (the server's
``tts_end`` comes after it)."""
CATCH_UP_S = 5.0
"""How long after the server's ``tts_end`` a caller who heard the answer begin, but not yet
its end, is waited for: a loaded caller's audio trails the server's events (a playout that
ran dry lags for good), and its checks read what the caller heard."""
POLL_S = 0.05
HEARD_GAP_S = 0.5
"""A silence in an answer this long or longer is not counted as hearing it (sentences are
~0.2-0.4 s apart)."""
CHECK_SLACK_S = 10.0
"""How long a check's own decode may wait: a scenario run's server shares the runner's Whisper,
and a decode needed now (another call's end of turn, at ``--jobs`` above 1) must not wait
behind one the harness needs only to judge a turn already over."""

"""How typed (text mode) keypad digits reach the playbook: as a call's digits do."""


class TurnTimeout(Exception):
    """The agent did not finish a turn in time."""


@dataclass(frozen=True)
class AgentLLM:
    """The configured LLM of the agent (scenarios with ``agent_llm: configured``): an
    OpenAI-compatible endpoint, or a local one (a running server, or llama.cpp in process)."""

    endpoint: LLMSettings | None = None
    local: LocalLLMSettings | None = None

    @property
    def given(self) -> bool:
        return self.endpoint is not None or self.local is not None


@dataclass(frozen=True)
class RigOptions:
    """How scenarios run; every field has a default for a quick local run."""

    transport: Transport = "webrtc"
    url: str | None = None
    """A running server (``http://host:port``) instead of one started per run; its own LLM
    answers (scripts cannot reach it), so its scenarios run as ``configured``."""
    token: str | None = None
    """The running server's ``--auth-token``."""
    sip_port: int | None = None
    """The running server's SIP port (``--url`` with ``--transport sip``; same host)."""
    agent: AgentLLM = AgentLLM()
    agent_llm: Literal["script", "configured"] | None = None
    """Overrides every file's choice (``configured``: run scripted scenarios on a real LLM)."""
    judge: ChatClient | None = None
    """The judge of ``judge`` checks and the simulated callers' voice (any OpenAI-compatible
    endpoint); None: see ``judge_configured``."""
    judge_configured: bool | None = None
    """Without ``judge``: True, the configured LLM judges (the embedded model by default),
    scripted runs included; False, no judge (``judge`` checks are skipped); None, the
    configured LLM judges the runs it answers in (not scripted runs, nor ``url`` ones)."""
    mode: Literal["voice", "text"] | None = None
    """Overrides every file's mode."""
    keep_audio: Path | None = None
    """A folder to keep each run's conversation in (stereo WAV: caller left, agent right)."""
    tool_calling: ToolCalling = "native"
    """Who calls the tools where a playbook does not say (``--llm-tool-calling``)."""


@dataclass
class _Run:
    """One run's state while its turns go on."""

    loaded: LoadedScenario
    result: ScenarioResult
    stage: str | None
    agent: str
    """``script`` or ``configured``: who answers as the agent."""
    conversation: list[Exchange] = field(default_factory=list)
    spoken: list[tuple[float, bytes]] = field(default_factory=list)
    """The caller's utterances with when they started leaving, for the kept audio."""


class ScenarioRig:
    """``async with ScenarioRig(options) as rig: result = await rig.run(loaded)``."""

    def __init__(self, options: RigOptions | None = None) -> None:
        self.options = options or RigOptions()
        self.speech = CallerSpeech()
        self._transcriber: SpeechToText | None = None
        self._synthesizer: TextToSpeech | None = None
        self._turn_model: TurnModel | None = None
        self._agent: LLMProvider | None = None
        self._loading = asyncio.Lock()

    async def __aenter__(self) -> ScenarioRig:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._agent is not None:
            await self._agent.close()
        for engine in (self._transcriber, self._synthesizer):
            if engine is not None:
                await engine.aclose()
        if self._turn_model is not None:
            self._turn_model.close()

    # -- shared parts, loaded when first needed ------------------------------------------------

    async def transcriber(self) -> SpeechToText:
        async with self._loading:
            if self._transcriber is None:
                self._transcriber = await asyncio.to_thread(Transcriber.load)
            return self._transcriber

    async def synthesizer(self) -> TextToSpeech:
        async with self._loading:
            if self._synthesizer is None:
                self._synthesizer = await asyncio.to_thread(
                    Synthesizer.load, SynthesizerSettings(cores=usable_cores())
                )
            return self._synthesizer

    async def turn_model(self) -> TurnModel:
        """The bundled audio end-of-turn model, as ``vocable serve`` runs it by default."""
        async with self._loading:
            if self._turn_model is None:
                self._turn_model = await asyncio.to_thread(TurnModel.load)
            return self._turn_model

    async def agent_provider(self) -> LLMProvider:
        """The configured agent LLM, started once; raises RuntimeError when there is none."""
        async with self._loading:
            if self._agent is None:
                agent = self.options.agent
                if not agent.given:
                    raise RuntimeError(
                        "the scenario runs on the configured LLM, and none is configured "
                        "(give an --llm-base-url, or --llm local, or script its turns)"
                    )
                model = agent.endpoint.model if agent.endpoint else None
                provider = LLMProvider(agent.endpoint, agent.local, model=model, announce=False)
                await provider.start()
                self._agent = provider
            client = await self._agent.ready()
            if client is None:
                raise RuntimeError(f"the agent's LLM is not ready: {self._agent.status.detail}")
            return self._agent

    async def judge_client(self, agent: str) -> ChatClient | None:
        """The judge's LLM for a run whose agent LLM is ``agent`` (see ``RigOptions``)."""
        options = self.options
        if options.judge_configured is False:
            return None
        if options.judge is not None:
            return options.judge
        if options.judge_configured or (agent == "configured" and options.url is None):
            return (await self.agent_provider()).client
        return None

    # -- running -------------------------------------------------------------------------------

    def plan(self, scenario: Scenario) -> tuple[str, Literal["script", "configured"]]:
        """(mode, agent LLM) a scenario runs with under these options."""
        mode = self.options.mode or scenario.mode
        agent: Literal["script", "configured"] = self.options.agent_llm or (
            "script" if scenario.scripted else "configured"
        )
        if self.options.url is not None and mode == "voice":
            agent = "configured"  # the running server's own LLM
        return mode, agent

    async def run(self, loaded: LoadedScenario, run: int = 1) -> ScenarioResult:
        """Run ``loaded`` once; never raises for what the agent or the call does (that is in
        the result's failures), only for a bug of the runner. Each run gets its playbook
        loaded afresh (:meth:`LoadedScenario.afresh`): runs never share the state of its tools."""
        loaded = loaded.afresh()
        scenario = loaded.scenario
        mode, agent = self.plan(scenario)
        transport = self.options.transport if mode == "voice" else "none"
        result = ScenarioResult(scenario.name, str(loaded.path), mode, transport, agent, run=run)
        state = _Run(loaded, result, loaded.playbook.spec.initial_stage, agent)
        started = time.monotonic()
        try:
            if mode == "text":
                await self._run_text(state, agent)
            else:
                await self._run_voice(state, agent)
        except (TurnTimeout, SpeechError, RuntimeError, OSError, ValueError) as exc:
            result.error = str(exc) or type(exc).__name__
        except Exception as exc:  # a bug of ours must not pass as the agent's failure
            log.exception("scenario %s failed to run", scenario.name)
            result.error = f"the runner failed: {type(exc).__name__}: {exc}"
        result.duration_s = round(time.monotonic() - started, 2)
        return result

    # -- voice ---------------------------------------------------------------------------------

    async def _run_voice(self, state: _Run, agent: str) -> None:
        scenario = state.loaded.scenario
        lines = await asyncio.to_thread(self._prepare_speech, state.loaded)
        script = TurnScript() if agent == "script" else None
        async with self._server(state.loaded, script) as (base_url, sip_port):
            started = time.monotonic()
            echo = scenario.impairments.echo if scenario.impairments is not None else None
            network = scenario.impairments.network if scenario.impairments is not None else None
            line = await open_line(
                self.options.transport,
                base_url,
                state.loaded.playbook.spec.id,
                sip_port=sip_port,
                token=self.options.token,
                echo=ReturnedEcho(echo.delay_ms, echo.return_loss_db) if echo else None,
                network=NetworkPath(network.packet_loss, network.jitter_ms) if network else None,
            )
            try:
                if scenario.simulated_caller is not None:
                    await self._simulated_voice(state, line, scenario.simulated_caller, started)
                else:
                    await self._turns_voice(state, line, lines, script, started)
            finally:
                state.result.events = list(line.events)
                lossy = line.network
                if lossy is not None:
                    lost = f"{lossy.lost} of the caller's {lossy.sent} packets"
                    state.result.notes.append(f"network: {lost} lost")
                if self.options.keep_audio is not None:
                    state.result.audio_file = str(self._keep_audio(state, line, started))
                await line.close()
            if script is not None:
                state.result.notes += script.missing

    def _prepare_speech(self, loaded: LoadedScenario) -> list[bytes | None]:
        """Every caller line's audio, made before the call (synthesis mid-call would take the
        CPU from the call's own clock)."""
        scenario = loaded.scenario
        audio: list[bytes | None] = []
        for number, turn in enumerate(scenario.turns, 1):
            if turn.say is not None:
                pcm = self.speech.speak(turn.say, turn.voice or scenario.caller, turn.pause_ms)
            elif turn.wav is not None:
                pcm = read_wav(loaded.resolve(turn.wav))
            else:
                audio.append(None)
                continue
            audio.append(impaired(pcm, turn.impairments or scenario.impairments, seed=number))
        return audio

    @contextlib.asynccontextmanager
    async def _server(
        self, loaded: LoadedScenario, script: TurnScript | None
    ) -> AsyncIterator[tuple[str, int | None]]:
        """(base URL, SIP port) of the server this run calls: the running one, or one started
        on loopback for the run with the scenario's playbook."""
        if self.options.url is not None:
            yield self.options.url.rstrip("/"), self.options.sip_port
            return
        transcriber, synthesizer = await self.transcriber(), await self.synthesizer()
        llm: ScriptedLLM | None = None
        client: ChatClient | None = None
        if script is not None:
            llm = ScriptedLLM(script)
            await llm.start()
            client = ChatClient.connect(llm.base_url, None, "scripted")
            provider = LLMProvider.serving(client)
        else:
            provider = await self.agent_provider()
        playbooks = {loaded.playbook.spec.id: loaded.playbook}
        engines = Engines(transcriber, synthesizer, playbooks, provider, await self.turn_model())
        config = replace(
            _run_config(loaded, sip=self.options.transport == "sip"),
            tool_calling=self.options.tool_calling,
        )
        runner: web.AppRunner | None = None
        try:
            app = create_app(config, engines)
            runner, port = await start_on_loopback(app)
            sip = app.get(SIP)
            yield f"http://127.0.0.1:{port}", (sip.port if sip is not None else None)
        finally:
            if runner is not None:
                await runner.cleanup()
            if client is not None:
                await client.aclose()
            if llm is not None:
                await llm.close()

    async def _turns_voice(
        self,
        state: _Run,
        line: CallLine,
        audio: Sequence[bytes | None],
        script: TurnScript | None,
        started: float,
    ) -> None:
        turns = state.loaded.scenario.turns
        since = started
        for index, turn in enumerate(turns):
            number = index + 1
            if script is not None:
                script.play(number, turn)
            following = turns[index + 1] if index + 1 < len(turns) else None
            begun = time.monotonic() if index else started
            sent: SentSpeech | None = None
            pcm = audio[index]
            if pcm is not None:
                leaving = time.monotonic()
                sent = await line.say(pcm)
                state.spoken.append((leaving, pcm))
                since = sent.last_voiced_at
            elif turn.dtmf is not None:
                since = time.monotonic()  # "#" ends the digits at once: the answer may start
                await line.press(turn.dtmf)
            elif turn.silence_ms is not None:
                await asyncio.sleep(turn.silence_ms / 1000)
            expect_answer = turn.action in ("say", "wav", "dtmf") or turn.action is None
            if following is not None and following.barge_in is not None:
                await _until_heard(line, since, following.barge_in.after_ms, turn.timeout_s)
            else:
                answer_from = since  # a line the agent cut into: what it began inside is the answer
                if sent is not None and _cut_in_at(line, sent, turn) is not None:
                    answer_from = sent.first_voiced_at
                await _settle(
                    line,
                    since,
                    expect_answer=expect_answer,
                    timeout_s=turn.timeout_s,
                    answer_from=answer_from,
                )
            ended = time.monotonic()
            await self._close_turn(state, line, turn, number, begun, ended, sent)
            if line.ended() and following is not None:
                raise RuntimeError(f"the call ended after turn {number}, before the scenario did")

    async def _close_turn(
        self,
        state: _Run,
        line: CallLine,
        turn: Turn,
        number: int,
        begun: float,
        ended: float,
        sent: SentSpeech | None,
    ) -> None:
        """Record turn ``number`` (events from ``begun`` to ``ended``) and check it."""
        events = _between(line.events, begun, ended)
        result = TurnResult(number, _action(turn))
        facts = self._facts(state, events, result, voice=True)
        facts.ended = line.ended()
        if sent is not None:
            heard_at = first_sound_after(line, sent.last_voiced_at)
            if heard_at is not None and heard_at <= ended:
                facts.voice_to_voice_ms = result.voice_to_voice_ms = round(
                    (heard_at - sent.last_voiced_at) * 1000, 1
                )
            early = _cut_in_at(line, sent, turn)
            if early is not None:
                facts.cut_in_ms = result.cut_in_ms = round((early - sent.first_voiced_at) * 1000)
            if turn.barge_in is not None:
                facts.barge_in = True
                quiet = silent_from(line, sent.first_voiced_at)
                if quiet is not None:
                    facts.silent_after_ms = round((quiet - sent.first_voiced_at) * 1000, 1)
        if any(e.kind == "heard" for e in turn.expect):
            pcm = heard_between(line, sent.last_voiced_at if sent else begun, ended)
            result.heard = await self._transcribe(pcm)
            facts.heard = result.heard
        result.duration_ms = round((ended - begun) * 1000, 1)
        result.timeline = _timeline(events, heard_spans(line, begun, ended), begun)
        await self._check(state, turn.expect, facts, result, said=turn.say)

    def _facts(
        self, state: _Run, events: list[dict[str, Any]], result: TurnResult, *, voice: bool
    ) -> TurnFacts:
        """The facts of a turn's events; moves the run's stage on."""
        for event in events:
            if event["type"] == "stage_change":
                state.stage = event.get("stage")
            elif event["type"] == "tool_call_start":
                result.tools.append(
                    {"name": event.get("name"), "arguments": event.get("arguments")}
                    | ({"id": event["id"]} if "id" in event else {})
                )
            elif event["type"] == "tool_call_end":
                for tool in result.tools:
                    if tool.get("id", tool["name"]) == event.get("id", event.get("name")):
                        tool.update(result=event.get("result"), error=bool(event.get("error")))
            elif event["type"] == "speech_end" and event.get("reason"):
                score = event.get("turn_score")
                shown = f" (voice {score:.2f})" if isinstance(score, (int, float)) else ""
                result.turn_ends.append(f"{event['reason']}{shown}")
            elif event["type"] == "transcript" and event.get("text"):
                result.understood = event["text"]  # the last: what the answer was to
            elif event["type"] == "dtmf" and event.get("digit"):
                typed = result.understood or ""
                keys = typed.removeprefix("keypad ") if typed.startswith("keypad ") else ""
                result.understood = f"keypad {keys}{event['digit']}"
            elif event["type"] == "turn_metrics":
                result.metrics = {k: v for k, v in event.items() if k not in ("type", "t_ms")}
        spoken = [str(e.get("text", "")) for e in events if e["type"] == "agent_sentence"]
        result.stage = state.stage
        result.answer = " ".join(s.strip() for s in _last_answer(events) if s.strip())
        facts = TurnFacts(events, spoken, state.stage, voice=voice)
        facts.answer = result.answer
        return facts

    async def _check(
        self,
        state: _Run,
        expectations: Sequence[Expectation],
        facts: TurnFacts,
        result: TurnResult,
        *,
        said: str | None,
        whole: bool = False,
    ) -> None:
        if not whole:
            self._remember(state, result, said)
        else:
            state.result.turns.append(result)
        wanted = any(e.kind == "judge" for e in expectations)
        judge = await self.judge_client(state.agent) if wanted else None
        if judge is not None:
            judging = Judge(judge)
            conversation = list(state.conversation)

            async def decide(statement: str) -> Any:
                return await judging.verdict(statement, conversation, of_last_answer=not whole)

            facts.judge = decide
        result.checks = await check_turn(expectations, facts)

    async def _transcribe(self, pcm: bytes) -> str:
        """What the caller heard, in words (a ``heard`` check's), at :data:`CHECK_SLACK_S`: the
        server under test shares the Whisper worker, and its calls' decodes go first."""
        if len(pcm) < FRAME_BYTES * 10:
            return ""
        transcriber = await self.transcriber()
        return (await transcriber.transcribe(pcm, slack_s=CHECK_SLACK_S, owner=self)).text

    async def _simulated_voice(
        self, state: _Run, line: CallLine, caller: SimulatedCaller, started: float
    ) -> None:
        await _settle(line, started, expect_answer=True, timeout_s=30.0)
        greeting = _between(line.events, started, time.monotonic())

        async def exchange(number: int, said: str) -> TurnResult:
            pcm = await asyncio.to_thread(self.speech.speak, said, state.loaded.scenario.caller)
            begun = time.monotonic()
            sent = await line.say(pcm)
            state.spoken.append((begun, pcm))
            await _settle(line, sent.last_voiced_at, expect_answer=True, timeout_s=60.0)
            ended = time.monotonic()
            result = TurnResult(number, f"say {said!r}")
            self._facts(state, _between(line.events, begun, ended), result, voice=True)
            heard_at = first_sound_after(line, sent.last_voiced_at)
            if heard_at is not None:
                result.voice_to_voice_ms = round((heard_at - sent.last_voiced_at) * 1000, 1)
            result.duration_ms = round((ended - begun) * 1000, 1)
            return result

        await self._simulate(state, caller, greeting, exchange, line.ended, voice=True)
        await self._outcome(
            state, caller, _between(line.events, started, time.monotonic()), voice=True
        )

    async def _simulate(
        self,
        state: _Run,
        caller: SimulatedCaller,
        greeting: list[dict[str, Any]],
        exchange: Callable[[int, str], Awaitable[TurnResult]],
        ended: Callable[[], bool],
        *,
        voice: bool,
    ) -> None:
        """The simulated caller's side: after the agent's ``greeting`` (its events), a line
        at a time (``exchange`` says it and returns the turn) until the caller is done, the
        turns run out or the call ``ended``."""
        voice_llm = await self._caller_llm(caller, state.agent)
        first = TurnResult(0, "wait for the agent")
        self._facts(state, greeting, first, voice=voice)
        self._remember(state, first, said=None)
        for number in range(1, caller.max_turns + 1):
            said = caller.opening if number == 1 and caller.opening else None
            said = said or await voice_llm.next_line(state.conversation)
            if said is None:
                break
            self._remember(state, await exchange(number, said), said)
            if ended():
                break

    def _remember(self, state: _Run, turn: TurnResult, said: str | None) -> None:
        """Add a finished turn to the run and to the conversation the LLMs are shown."""
        caller_words = turn.understood or said
        if caller_words:
            state.conversation.append(Exchange("caller", caller_words))
        if turn.answer:
            state.conversation.append(Exchange("agent", turn.answer))
        state.result.turns.append(turn)

    async def _caller_llm(self, caller: SimulatedCaller, agent: str) -> SimulatedCallerLLM:
        client = await self.judge_client(agent)
        if client is None:
            raise RuntimeError(
                "a simulated caller needs an LLM: give --judge-base-url, or the agent's LLM"
            )
        return SimulatedCallerLLM(client, caller.persona, caller.goal)

    async def _outcome(
        self, state: _Run, caller: SimulatedCaller, events: list[dict[str, Any]], *, voice: bool
    ) -> None:
        """The simulated caller's expectations, checked on the whole conversation."""
        outcome = TurnResult(len(state.result.turns), "the conversation's outcome")
        stage = state.stage
        facts = self._facts(state, [], outcome, voice=voice)
        facts.events, facts.stage = events, stage
        facts.spoken = [str(e.get("text", "")) for e in events if e["type"] == "agent_sentence"]
        facts.answer = outcome.answer = " ".join(facts.spoken)
        outcome.stage = stage
        outcome.tools = [
            {"name": e.get("name"), "arguments": e.get("arguments")}
            for e in events
            if e["type"] == "tool_call_start"
        ]
        await self._check(state, caller.expect, facts, outcome, said=None, whole=True)

    # -- text ----------------------------------------------------------------------------------

    async def _run_text(self, state: _Run, agent: str) -> None:
        scenario = state.loaded.scenario
        script = TurnScript() if agent == "script" else None
        llm: ScriptedLLM | None = None
        client: ChatClient | None
        if script is not None:
            llm = ScriptedLLM(script)
            await llm.start()
            client = ChatClient.connect(llm.base_url, None, "scripted")
        else:
            client = (await self.agent_provider()).client
        assert client is not None
        events: list[dict[str, Any]] = []
        orchestrator = PlaybookOrchestrator(
            state.loaded.playbook,
            client,
            OrchestratorOptions(tool_calling=self.options.tool_calling),
        )
        orchestrator.on(lambda event: events.extend(_as_voice_events(event)))
        try:
            greeting = orchestrator.greet()
            if greeting:
                events.append({"type": "agent_sentence", "text": greeting, "t_ms": _now_ms()})
            if scenario.simulated_caller is not None:
                await self._simulated_text(state, orchestrator, events, scenario.simulated_caller)
            else:
                for index, turn in enumerate(scenario.turns):
                    if script is not None:
                        script.play(index + 1, turn)
                    await self._text_turn(state, orchestrator, events, turn, index + 1)
        finally:
            state.result.events = events
            if script is not None:
                state.result.notes += script.missing
            await orchestrator.aclose()
            if llm is not None:
                assert client is not None
                await client.aclose()
                await llm.close()

    async def _typed(self, state: _Run, turn: Turn) -> str | None:
        """What the caller types for ``turn`` in text mode (None: nothing)."""
        if turn.say is not None:
            return " ".join(turn.say.replace("...", " ").split())
        if turn.dtmf is not None:
            return keypad_line(turn.dtmf)
        if turn.wav is not None:
            return await self._transcribe(read_wav(state.loaded.resolve(turn.wav)))
        return None

    async def _text_turn(
        self,
        state: _Run,
        orchestrator: PlaybookOrchestrator,
        events: list[dict[str, Any]],
        turn: Turn,
        number: int,
    ) -> None:
        mark = len(events) if number > 1 else 0
        begun = time.monotonic()
        typed = await self._typed(state, turn)
        result = TurnResult(number, _action(turn), understood=typed)
        if typed:
            await _type(orchestrator, events, typed, turn.timeout_s)
        facts = self._facts(state, events[mark:], result, voice=False)
        result.duration_ms = round((time.monotonic() - begun) * 1000, 1)
        await self._check(state, turn.expect, facts, result, said=typed)

    async def _simulated_text(
        self,
        state: _Run,
        orchestrator: PlaybookOrchestrator,
        events: list[dict[str, Any]],
        caller: SimulatedCaller,
    ) -> None:
        async def exchange(number: int, said: str) -> TurnResult:
            mark = len(events)
            begun = time.monotonic()
            await _type(orchestrator, events, said, 60.0)
            result = TurnResult(number, f"say {said!r}", understood=said)
            self._facts(state, events[mark:], result, voice=False)
            result.duration_ms = round((time.monotonic() - begun) * 1000, 1)
            return result

        await self._simulate(state, caller, list(events), exchange, lambda: False, voice=False)
        await self._outcome(state, caller, list(events), voice=False)

    # -- audio kept ----------------------------------------------------------------------------

    def _keep_audio(self, state: _Run, line: CallLine, started: float) -> Path:
        """The conversation as a stereo WAV: what the caller said (left) and heard (right)."""
        folder = self.options.keep_audio
        assert folder is not None
        folder.mkdir(parents=True, exist_ok=True)
        stem = words_of(state.loaded.scenario.name).replace(" ", "-")[:60] or "scenario"
        path = folder / f"{stem}-{self.options.transport}-run{state.result.run}.wav"
        frames = line.frames
        end = max([f.at for f in frames] + [started]) + 0.5
        length = int((end - started) * SAMPLE_RATE) * 2
        left, right = bytearray(length), bytearray(length)
        for at, pcm in state.spoken:
            _place(left, pcm, at - started)
        heard = line.heard
        for n, frame in enumerate(frames):
            chunk = heard[n * FRAME_BYTES : (n + 1) * FRAME_BYTES]
            _place(right, bytes(chunk), frame.at - started)
        with wave.open(str(path), "wb") as out:
            out.setnchannels(2)
            out.setsampwidth(2)
            out.setframerate(SAMPLE_RATE)
            out.writeframes(_interleave(bytes(left), bytes(right)))
        return path


async def _type(
    orchestrator: PlaybookOrchestrator, events: list[dict[str, Any]], text: str, timeout_s: float
) -> None:
    """Answer ``text`` typed to the playbook, noting it and the answer in ``events``."""
    events.append({"type": "transcript", "text": text, "t_ms": _now_ms()})
    async with asyncio.timeout(timeout_s), orchestrator.turn(text) as answer:
        async for delta in answer:
            if isinstance(delta, Retraction):
                continue  # the answer's text is read from answer.answer at the end
        said = answer.answer
    if said:
        events.append({"type": "agent_sentence", "text": said, "t_ms": _now_ms()})


def _place(track: bytearray, pcm: bytes, offset_s: float) -> None:
    start = max(0, int(offset_s * SAMPLE_RATE)) * 2
    piece = pcm[: max(0, len(track) - start)]
    track[start : start + len(piece)] = piece


def _interleave(left: bytes, right: bytes) -> bytes:
    import numpy as np

    a = np.frombuffer(left, dtype=np.int16)
    b = np.frombuffer(right, dtype=np.int16)
    return np.column_stack((a, b)).astype(np.int16).tobytes()


def _run_config(loaded: LoadedScenario, *, sip: bool) -> ServerConfig:
    """A server for one run: the scenario's playbook, on loopback, nothing recorded, no rate
    limit, and admission not by CPU (the callers share the server's process)."""
    base = ServerConfig()
    assert loaded.playbook.source is not None
    impairments = loaded.scenario.impairments
    echoes = impairments is not None and impairments.echo is not None
    return replace(
        base,
        host="127.0.0.1",
        playbook=loaded.playbook.source,
        sip=SipSettings(host="127.0.0.1", port=0) if sip else None,
        rate_limit_per_min=0,
        overload=replace(base.overload, capacity_cpu_percent=0),
        # an echoing WebRTC caller is a browser whose canceller let the echo through
        echo_cancellation="all" if echoes else base.echo_cancellation,
    )


def _last_answer(events: list[dict[str, Any]]) -> list[str]:
    """The sentences of the turn's last answer: those after its last ``tts_start`` (an answer
    begun early and undone, or cut by the caller, is not the one the turn ended with)."""
    starts = [n for n, e in enumerate(events) if e["type"] == "tts_start"]
    tail = events[starts[-1] :] if starts else events
    return [str(e.get("text", "")) for e in tail if e["type"] == "agent_sentence"]


def _now_ms() -> float:
    return round(time.monotonic() * 1000, 1)


def _between(events: list[dict[str, Any]], start: float, end: float) -> list[dict[str, Any]]:
    return [e for e in list(events) if start * 1000 <= float(e.get("t_ms", 0)) <= end * 1000]


def _action(turn: Turn) -> str:
    if turn.say is not None:
        return f"say {turn.say!r}" + (" (over the agent)" if turn.barge_in else "")
    if turn.wav is not None:
        return f"wav {turn.wav}" + (" (over the agent)" if turn.barge_in else "")
    if turn.dtmf is not None:
        return f"dtmf {turn.dtmf}"
    if turn.silence_ms is not None:
        return f"silence {turn.silence_ms} ms"
    return "wait for the agent"


def _as_voice_events(event: OrchestratorEvent) -> list[dict[str, Any]]:
    """An orchestrator event as the voice event a call would emit (text mode has no voice)."""
    translated = voice_event_of(event, time.monotonic())
    return [translated.to_dict()] if translated is not None else []


_TIMELINE = frozenset(
    {"speech_start", "speech_end", "transcript", "tts_start", "tts_end"}
    | {"paused", "resumed", "interrupted", "error"}
)
"""The server's events a turn's timeline shows."""


def _timeline(
    events: list[dict[str, Any]], heard: list[tuple[float, float]], begun: float
) -> list[str]:
    """A turn's timeline (:attr:`TurnResult.timeline`) from its events and the spans in which
    the caller heard the agent."""
    marks = [(start, f"caller hears the agent for {end - start:.2f} s") for start, end in heard]
    for event in events:
        if event["type"] in _TIMELINE:
            detail = (
                event.get("text")
                or event.get("heard")
                or event.get("reason")
                or event.get("message")
            )
            said = f" {str(detail)[:60]!r}" if detail else ""
            marks.append((event["t_ms"] / 1000, f"{event['type']}{said}"))
    return [f"+{at - begun:.2f} {what}" for at, what in sorted(marks, key=lambda m: m[0])]


def _cut_in_at(line: CallLine, sent: SentSpeech | None, turn: Turn) -> float | None:
    """When the agent was first heard inside the caller's line (a cut-in), else None; a
    barge-in is meant to be said over the agent."""
    if sent is None or turn.barge_in is not None:
        return None
    early = first_sound_after(line, sent.first_voiced_at)
    return early if early is not None and early < sent.last_voiced_at else None


async def _settle(
    line: CallLine,
    since: float,
    *,
    expect_answer: bool,
    timeout_s: float,
    answer_from: float | None = None,
) -> None:
    """Wait until the turn is over: the agent answered (when ``expect_answer``) with an answer
    begun after ``answer_from`` (default ``since``; a line the agent cut into is answered by
    what it began inside it, and its check says so), and is listening and silent for
    :data:`QUIET_S` after ``since``, or the call ended; raises :class:`TurnTimeout`."""
    deadline = time.monotonic() + timeout_s
    begun_after_ms = (since if answer_from is None else answer_from) * 1000
    while time.monotonic() < deadline:
        if line.ended():
            return
        now = time.monotonic()
        events = list(line.events)
        starts = [e for e in events if e["type"] == "tts_start" and e["t_ms"] >= begun_after_ms]
        answered = bool(starts) and any(
            e["type"] == "tts_end" and e["t_ms"] >= starts[-1]["t_ms"] for e in events
        )
        states = [e.get("state") for e in events if e["type"] == "state"]
        listening = not states or states[-1] == "listening"
        heard_last = last_sound(line)
        quiet = now - max(heard_last or 0.0, since) >= QUIET_S
        behind = answered and _heard_behind(line, starts[-1], events, heard_last, now)
        if listening and quiet and not behind and (answered or not expect_answer):
            return
        await asyncio.sleep(POLL_S)
    what = "answer and fall silent" if expect_answer else "fall silent"
    raise TurnTimeout(f"the agent did not {what} within {timeout_s:g} s")


def _heard_behind(
    line: CallLine,
    start: dict[str, Any],
    events: list[dict[str, Any]],
    heard_last: float | None,
    now: float,
) -> bool:
    """Whether the caller heard the answer that began at ``start`` (a ``tts_start``) begin but
    not yet end: its last sound is more than ``TAIL_S`` before the server's ``tts_end``, and
    ``CATCH_UP_S`` have not passed since."""
    end_s = max(e["t_ms"] for e in events if e["type"] == "tts_end") / 1000
    began = first_sound_after(line, start["t_ms"] / 1000)
    return began is not None and (heard_last or 0.0) < end_s - TAIL_S and now < end_s + CATCH_UP_S


async def _until_heard(line: CallLine, since: float, after_ms: int, timeout_s: float) -> None:
    """Wait until the caller has heard ``after_ms`` of the agent's answer begun after ``since``
    (the moment a barge-in speaks over it), or the answer is over; raises :class:`TurnTimeout`.

    What counts is the answer's audio as heard, pauses shorter than :data:`HEARD_GAP_S`
    included, not the clock since it began: on a loaded machine a later sentence can reach the
    caller seconds after the first, and a barge-in timed by the clock then falls into that
    silence, where it is not a barge-in at all."""
    deadline = time.monotonic() + timeout_s
    began: float | None = None
    while time.monotonic() < deadline:
        began = first_sound_after(line, since)
        if began is not None:
            spans = heard_spans(line, began, time.monotonic(), gap_s=HEARD_GAP_S)
            heard_s = sum(last - first + FRAME_MS / 1000 for first, last in spans)
            if heard_s >= after_ms / 1000 or _answer_over(line, began):
                return
        if line.ended():
            during = "before the agent spoke" if began is None else "during the agent's answer"
            raise RuntimeError(f"the call ended {during}")
        await asyncio.sleep(POLL_S / 2)
    if began is None:
        raise TurnTimeout(f"the agent did not begin to answer within {timeout_s:g} s")
    raise TurnTimeout(f"the caller had not heard {after_ms} ms of the answer in {timeout_s:g} s")


def _answer_over(line: CallLine, began: float) -> bool:
    """Whether the answer the caller began to hear at ``began`` is over: the server's call went
    back to listening after it, and the caller has heard nothing for :data:`HEARD_GAP_S`."""
    states = [e for e in line.events if e["type"] == "state"]
    if not states or states[-1].get("state") != "listening":
        return False
    if states[-1]["t_ms"] / 1000 < began:
        return False
    return time.monotonic() - (last_sound(line) or 0.0) >= HEARD_GAP_S


def run_scenario(
    path: str | Path, options: RigOptions | None = None, *, repeat: int = 1
) -> list[ScenarioResult]:
    """Load and run one scenario file ``repeat`` times (blocking; for a pytest test): each
    run's result. Raises :class:`~.files.ScenarioError` for an invalid file."""
    loaded = load_scenario(path)

    async def runs() -> list[ScenarioResult]:
        async with ScenarioRig(options) as rig:
            return [await rig.run(loaded, n + 1) for n in range(repeat)]

    return asyncio.run(runs())
