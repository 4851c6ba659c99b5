"""Remote STT and TTS through OpenAI-compatible audio APIs, against a stand-in GPU box on
127.0.0.1 that runs the real Whisper and Piper (``tests.support.audio_api_server``): transcription,
streamed synthesis in both formats, a whole voice call on remote engines, dead endpoints, and the
flags and variables that choose them."""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from media import Synthesizer
from media.audio import silence
from media.remote import (
    RemoteInferenceError,
    RemoteSynthesizer,
    RemoteSynthesizerSettings,
    RemoteTranscriber,
    RemoteTranscriberSettings,
    redact,
)
from media.tts import PIECE_MS, VoiceSettings
from playbooks import load_playbook
from playbooks.loader import LoadedPlaybook
from server.config.llm import ConfigError
from server.config.server import ServerConfig, add_serve_arguments
from server.runtime.engines import Engines
from server.testkit.scripted_llm import ScriptedLLM, answers_by_words
from tests.conftest import EXAMPLES
from tests.support.audio_api_server import AudioApiServer
from tests.support.calls import (
    VoiceCall,
    piper_speech,
    start_call,
    synthesizer,
    transcriber,
    word_error_rate,
    words,
)
from tests.support.speech import to_16k

pytestmark = pytest.mark.slow

QUESTION = "I would like to change my delivery address to the new office."
ANSWER = "Your order left our warehouse on Monday. It will arrive on Tuesday."


@pytest.fixture
async def gpu() -> AsyncIterator[AudioApiServer]:
    """The stand-in inference server, on the process's shared real models."""
    async with AudioApiServer(transcriber(), synthesizer()) as server:
        yield server


@pytest.fixture
def dead_url() -> str:
    """A base URL on a closed port of 127.0.0.1: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def _support() -> LoadedPlaybook:
    return load_playbook(EXAMPLES / "support.yaml")


async def _heard(pcm: bytes) -> str:
    """What local Whisper hears in 16 kHz ``pcm``."""
    return (await transcriber().transcribe(pcm)).text


def _stt(base_url: str, **changes: Any) -> RemoteTranscriber:
    return RemoteTranscriber(replace(RemoteTranscriberSettings(base_url), **changes))


def _tts(base_url: str, **changes: Any) -> RemoteSynthesizer:
    return RemoteSynthesizer(replace(RemoteSynthesizerSettings(base_url), **changes))


async def test_remote_stt_transcribes_speech_with_local_whisper_screening(
    gpu: AudioApiServer,
) -> None:
    remote = _stt(gpu.base_url, api_key="gpu-key-123")
    speech = piper_speech(QUESTION)
    try:
        started = time.perf_counter()
        heard = await remote.transcribe(speech)
        remote_ms = (time.perf_counter() - started) * 1000
        local = await transcriber().transcribe(speech)
        silent = await remote.transcribe(silence(800))
    finally:
        await remote.aclose()
    assert word_error_rate(heard.text, QUESTION) <= 0.2, heard
    assert heard.audio_ms == pytest.approx(len(speech) / 32)
    assert heard.compute_ms > 0
    assert heard.avg_logprob is not None
    assert heard.no_speech_prob is not None  # verbose_json confidences reached the filters
    assert (silent.text, silent.dropped) == ("", "empty")
    request = gpu.requests[0]
    assert request.path == "/v1/audio/transcriptions"
    assert request.authorization == "Bearer gpu-key-123"
    fields = request.fields
    assert (fields["model"], fields["language"], fields["response_format"]) == (
        "whisper-1",
        "en",
        "verbose_json",
    )
    assert fields["file_bytes"] == len(speech) + 44  # 16 kHz mono WAV: the PCM and a header
    print(f"one utterance: remote STT {remote_ms:.0f} ms, local {local.compute_ms:.0f} ms")


async def test_remote_stt_with_plain_json_and_a_retried_server_error(
    gpu: AudioApiServer,
) -> None:
    remote = _stt(gpu.base_url, response_format="json", model="large-v3", language=None)
    gpu.fail_next(503)
    try:
        heard = await remote.transcribe(piper_speech(QUESTION))
    finally:
        await remote.aclose()
    assert word_error_rate(heard.text, QUESTION) <= 0.2, heard
    assert heard.avg_logprob is None  # plain json carries no confidences
    assert len(gpu.requests) == 2  # the 503, then the retry
    assert gpu.requests[1].fields["model"] == "large-v3"
    assert "language" not in gpu.requests[1].fields


@pytest.mark.parametrize("audio_format", ["pcm", "wav"])
async def test_remote_tts_streams_speech_whisper_understands(
    gpu: AudioApiServer, audio_format: str
) -> None:
    remote = _tts(gpu.base_url, response_format=audio_format, voice="joe")
    text = (
        "Your order left our warehouse on Monday. The courier will bring it on Tuesday. "
        "You can track it on our website."
    )
    pieces: list[tuple[float, bytes]] = []
    try:
        started = time.perf_counter()
        async for pcm in remote.synthesize(text):
            pieces.append((time.perf_counter(), pcm))
        empty = [pcm async for pcm in remote.synthesize("  ")]
    finally:
        await remote.aclose()
    assert remote.sample_rate == 24_000
    assert all(0 < len(p) <= 24_000 * PIECE_MS // 1000 * 2 and len(p) % 2 == 0 for _, p in pieces)
    audio = b"".join(p for _, p in pieces)
    heard = await _heard(to_16k(audio, remote.sample_rate))
    assert word_error_rate(heard, text) <= 0.2, heard
    assert empty == []
    (request,) = gpu.requests
    assert request.fields["voice"] == "joe"
    assert request.fields["model"] == "tts-1"
    # streamed: the first piece was handed on before the server had written its last audio
    first_at = pieces[0][0]
    assert first_at < request.audio_writes[-1], (first_at - started, request.audio_writes)
    print(
        f"{audio_format}: first audio after {(first_at - started) * 1000:.0f} ms, "
        f"all after {(pieces[-1][0] - started) * 1000:.0f} ms"
    )


async def test_a_voice_call_on_remote_stt_and_tts(
    gpu: AudioApiServer, llm: ScriptedLLM, calls: list[VoiceCall]
) -> None:
    llm.script(answers_by_words({}, ANSWER))
    stt, tts = _stt(gpu.base_url), _tts(gpu.base_url)
    question = piper_speech(QUESTION)  # before the call: Piper would stall its 20 ms clock
    try:
        call = start_call(_support(), llm.base_url, stt=stt, tts=tts)
        calls.append(call)
        await call.say(question, trailing_silence_ms=200)
        await call.wait_idle()
    finally:
        await stt.aclose()
        await tts.aclose()
    (transcript,) = call.of_type("transcript")
    assert {"change", "delivery", "address"} <= set(words(transcript.data["text"]))
    assert llm.user_turns[-1] == transcript.data["text"]
    assert word_error_rate(await _heard(call.heard_since(0)), ANSWER) <= 0.2
    assert call.voice.heard == ANSWER
    (metrics,) = call.of_type("turn_metrics")
    assert metrics.data["stt_ms"] >= 0
    assert metrics.data["tts_first_audio_ms"] >= 0
    assert {r.path for r in gpu.requests} == {"/v1/audio/transcriptions", "/v1/audio/speech"}
    assert call.of_type("error") == []
    print("remote turn_metrics:", metrics.to_dict())


async def test_a_remote_variant_sends_its_voice_name_and_speed_over_the_same_client(
    gpu: AudioApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    remote = _tts(gpu.base_url, voice="alloy")
    slow = remote.variant(VoiceSettings(name="nova", speaking_rate=0.6))
    text = "The quick brown fox jumps over the lazy dog."
    try:
        normal_audio = b"".join([pcm async for pcm in remote.synthesize(text)])
        slow_audio = b"".join([pcm async for pcm in slow.synthesize(text)])
        assert remote.variant(VoiceSettings(name="nova", speaking_rate=0.6)) is slow
        await slow.aclose()  # a variant leaves the shared connections open
        again = b"".join([pcm async for pcm in remote.synthesize("Still here.")])
        with caplog.at_level("WARNING", logger="media.remote"):
            piper_only = remote.variant(VoiceSettings(model="/voices/fr.onnx"))
    finally:
        await remote.aclose()
    bodies = [r.fields for r in gpu.requests]
    assert [(b["voice"], b.get("speed")) for b in bodies] == [
        ("alloy", None),
        ("nova", 0.6),
        ("alloy", None),
    ]
    assert (remote.voice_id, slow.voice_id, piper_only.voice_id) == ("alloy", "nova", "alloy")
    assert len(slow_audio) > 1.4 * len(normal_audio)  # the server honoured the speed
    assert again
    assert "cannot use a Piper voice file" in caplog.text


async def test_a_stage_voice_name_reaches_the_remote_engine_in_a_call(
    gpu: AudioApiServer, llm: ScriptedLLM, calls: list[VoiceCall], tmp_path: Path
) -> None:
    path = tmp_path / "voices.yaml"
    path.write_text(
        """\
id: voices
name: Voices
initial_stage: front
stages:
  - id: front
    name: Front desk
    system_prompt: Answer briefly.
  - id: expert
    name: Expert
    system_prompt: Answer in depth.
    voice: {id: expert, name: nova, speaking_rate: 1.2}
transitions:
  - id: escalate
    from: front
    condition: {type: keyword, keywords: [expert], in: user}
    action: {target_stage: expert}
"""
    )
    llm.script(answers_by_words({}, ANSWER))
    tts = _tts(gpu.base_url, voice="alloy")
    try:
        call = start_call(load_playbook(path), llm.base_url, tts=tts)
        calls.append(call)
        for text in ("Where is my order?", "Put me through to an expert."):
            call.session.submit_text(text)
            await call.wait_idle()
    finally:
        await tts.aclose()
    voices = [e.data["voice"] for e in call.of_type("agent_sentence")]
    # each answer's first phrase ("Your order left") is a chunk of its own
    assert voices == ["alloy"] * 3 + ["expert"] * 3
    assert call.of_type("stage_change")[-1].data["voice"] == "expert"
    sent = [(r.fields["voice"], r.fields.get("speed")) for r in gpu.requests]
    assert sent == [("alloy", None)] * 3 + [("nova", 1.2)] * 3
    assert call.of_type("error") == []


async def test_a_dead_stt_endpoint_gives_the_error_event_and_the_spoken_fallback(
    dead_url: str, llm: ScriptedLLM, calls: list[VoiceCall]
) -> None:
    stt = _stt(dead_url)
    question = piper_speech("Hello, is anybody there?")
    try:
        call = start_call(_support(), llm.base_url, stt=stt)  # local Piper still speaks
        calls.append(call)
        await call.say(question, 200)
        await call.wait_idle()
    finally:
        await stt.aclose()
    error = call.of_type("error")[0]
    assert error.data["source"] == "stt"
    assert error.data["message"].startswith("RemoteInferenceError: remote speech recognition at")
    assert dead_url in error.data["message"]
    assert llm.requests == []  # nothing was heard, so nothing was asked
    assert call.voice.heard == "Sorry, I'm having trouble right now."
    assert "trouble" in words(await _heard(call.heard_since(0)))
    assert call.session.state == "listening"


async def test_a_dead_tts_endpoint_reports_the_error_and_the_call_stays_up(
    dead_url: str, gpu: AudioApiServer, llm: ScriptedLLM, calls: list[VoiceCall]
) -> None:
    llm.script(answers_by_words({}, "Let me see."))
    stt, tts = _stt(gpu.base_url), _tts(dead_url, retries=0)
    first, second = piper_speech(QUESTION), piper_speech("Hello, is anybody there?")
    try:
        call = start_call(_support(), llm.base_url, stt=stt, tts=tts)
        calls.append(call)
        await call.say(first, 200)
        await call.wait_idle()
        error = await call.wait_event("error")
        await call.say(second, 200)
        await call.wait_event("transcript", count=2)
        await call.wait_idle()
    finally:
        await stt.aclose()
        await tts.aclose()
    assert error.data["source"] == "tts"
    assert "remote speech synthesis at" in error.data["message"]
    assert len(llm.user_turns) == 2  # the second question was still heard and answered
    assert call.voice.heard == ""
    assert not any(call.line.recording)  # nothing but silence went out
    assert call.session.state == "listening"


async def test_an_error_status_raises_the_remote_error(gpu: AudioApiServer) -> None:
    remote = _tts(gpu.base_url, retries=0)
    gpu.fail_next(500)
    try:
        with pytest.raises(RemoteInferenceError, match=r"HTTP 500: .*scripted status 500"):
            async for _ in remote.synthesize("Hello there."):
                pass
    finally:
        await remote.aclose()


async def test_a_long_retry_after_fails_the_transcription_at_its_deadline(
    gpu: AudioApiServer,
) -> None:
    remote = _stt(gpu.base_url, timeout_s=1.0)
    gpu.fail_next(429, retry_after_s=30)
    speech = piper_speech(QUESTION)
    started = time.perf_counter()
    try:
        with pytest.raises(RemoteInferenceError, match="timed out"):
            await remote.transcribe(speech)
    finally:
        await remote.aclose()
    assert time.perf_counter() - started < 3.0
    assert len(gpu.requests) == 1  # the retry would only have come after 30 s


def _config(argv: list[str], env: dict[str, str]) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env=env)
    return ServerConfig.from_args(parser.parse_args(argv), env={})


async def test_flags_and_environment_choose_remote_engines(gpu: AudioApiServer) -> None:
    local = _config([], {})
    assert (local.remote_stt, local.remote_tts) == (None, None)

    config = _config(
        ["--stt-url", gpu.base_url + "/", "--stt-remote-model", "distil-large-v3"],
        {
            "VOCABLE_TTS_URL": gpu.base_url,
            "VOCABLE_TTS_REMOTE_VOICE": "nova",
            "VOCABLE_TTS_REMOTE_FORMAT": "wav",
            "VOCABLE_INFERENCE_API_KEY": "sk-never-logged",
        },
    )
    assert config.remote_stt == RemoteTranscriberSettings(
        base_url=gpu.base_url, model="distil-large-v3", api_key="sk-never-logged"
    )
    assert config.remote_tts == RemoteSynthesizerSettings(
        base_url=gpu.base_url,
        model="tts-1",
        voice="nova",
        response_format="wav",
        api_key="sk-never-logged",
    )
    assert "sk-never-logged" not in repr(config)

    engines = await Engines.load(config)
    try:
        assert isinstance(engines.transcriber, RemoteTranscriber)
        assert isinstance(engines.synthesizer, RemoteSynthesizer)
    finally:
        await engines.close()
    # both were warmed up at load, with the key
    assert sorted(r.path for r in gpu.requests) == ["/v1/audio/speech", "/v1/audio/transcriptions"]
    assert {r.authorization for r in gpu.requests} == {"Bearer sk-never-logged"}


async def test_remote_stt_with_local_tts_and_a_dead_server_at_startup(
    dead_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(["--stt-url", dead_url, "--inference-api-key", "sk-secret"], {})
    engines = await Engines.load(config)
    try:
        assert isinstance(engines.transcriber, RemoteTranscriber)
        assert isinstance(engines.synthesizer, Synthesizer)  # local Piper
    finally:
        await engines.close()
    assert "remote speech recognition at" in caplog.text  # the server starts, with a warning
    assert "sk-secret" not in caplog.text


def test_bad_remote_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="--stt-url"):
        _config(["--stt-url", "gpu-host:8000"], {})
    with pytest.raises(ConfigError, match="--tts-remote-format"):
        _config([], {"VOCABLE_TTS_URL": "http://gpu:8000/v1", "VOCABLE_TTS_REMOTE_FORMAT": "mp3"})
    assert redact("https://user:pw@gpu-host:8000/v1") == "https://gpu-host:8000/v1"
    assert redact("http://gpu-host/v1") == "http://gpu-host/v1"
