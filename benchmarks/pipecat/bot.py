"""The pipecat side of the side-by-side benchmark: a pipecat 1.14 voice bot over SmallWebRTC.

Runs in its own virtualenv (``.venv-pipecat``, ``requirements.txt`` beside this file), never in
Vocable's. ``python -m benchmarks.compare`` starts it; by hand::

    .venv-pipecat/bin/python benchmarks/pipecat/bot.py --port 7860 \\
        --llm-base-url http://127.0.0.1:PORT/v1 --whisper-model DIR --piper-voice FILE.onnx

The pipeline is the one pipecat 1.14's own project scaffold (``pipecat init``, cascade bot)
generates, with the benchmark's models in its services:

- transport: ``SmallWebRTCTransport`` (aiortc), ``TransportParams(audio_in_enabled=True,
  audio_out_enabled=True)``, pipecat's default rates (16 kHz in, 24 kHz out);
- ``transport.input() -> stt -> user aggregator -> llm -> tts -> transport.output() ->
  assistant aggregator``;
- VAD: ``SileroVADAnalyzer()`` with pipecat's default ``VADParams`` (confidence 0.7, start 0.2 s,
  stop 0.2 s, min volume 0.6), in ``LLMUserAggregatorParams(vad_analyzer=...)`` as the scaffold
  does;
- turn taking: pipecat's default ``UserTurnStrategies()``: a turn starts on VAD speech or a
  transcript, and ends when the bundled Smart Turn v3.2 model (``LocalSmartTurnAnalyzerV3``, its
  default ``SmartTurnParams``: 3 s silence fallback) calls it complete; interruptions on;
- STT: ``WhisperSTTService`` (faster-whisper) given the model folder (``--whisper-model``),
  ``device="cpu"``, ``compute_type="int8"``, English; the service's own decoding otherwise;
- LLM: ``OpenAILLMService`` at ``--llm-base-url`` (model ``--llm-model``);
- TTS: ``PiperTTSService`` given the voice's folder as its ``download_dir`` and the voice's name
  (so the file found there is loaded, nothing downloaded).

``POST /offer`` takes ``{"sdp", "type"}`` and answers ``{"sdp", "type", "pc_id", "session_id"}``
(the shape the harness's caller reads); one pipeline per call. It prints ``ready`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from aiohttp import web
from loguru import logger
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.services.piper.tts import PiperTTSService
from pipecat.services.whisper.stt import WhisperSTTService
from pipecat.transcriptions.language import Language
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
from pipecat.workers.runner import WorkerRunner

SYSTEM_PROMPT = "Answer the caller's question in one or two short spoken sentences."
"""The same instruction as Vocable's benchmark playbook (the scripted LLM ignores it)."""


def build_pipeline(transport: SmallWebRTCTransport, args: argparse.Namespace) -> Pipeline:
    stt = WhisperSTTService(
        device="cpu",
        compute_type="int8",
        settings=WhisperSTTService.Settings(model=args.whisper_model, language=Language.EN),
    )
    voice = Path(args.piper_voice)
    tts = PiperTTSService(
        download_dir=voice.parent,
        settings=PiperTTSService.Settings(voice=voice.name.removesuffix(".onnx")),
    )
    llm = OpenAILLMService(
        api_key=args.llm_api_key,
        base_url=args.llm_base_url,
        settings=OpenAILLMService.Settings(model=args.llm_model, system_instruction=SYSTEM_PROMPT),
    )
    context = LLMContext()
    user_aggregator, assistant_aggregator = LLMContextAggregatorPair(
        context,
        user_params=LLMUserAggregatorParams(vad_analyzer=SileroVADAnalyzer()),
    )
    return Pipeline(
        [
            transport.input(),
            stt,
            user_aggregator,
            llm,
            tts,
            transport.output(),
            assistant_aggregator,
        ]
    )


def prepare_call(connection: SmallWebRTCConnection, args: argparse.Namespace) -> PipelineWorker:
    """One call's pipeline, its models loaded (as pipecat bots do, per call)."""
    transport = SmallWebRTCTransport(
        webrtc_connection=connection,
        params=TransportParams(audio_in_enabled=True, audio_out_enabled=True),
    )
    worker = PipelineWorker(
        build_pipeline(transport, args),
        params=PipelineParams(enable_metrics=True, enable_usage_metrics=True),
    )

    async def on_client_disconnected(transport: Any, client: Any) -> None:
        await worker.cancel()

    transport.add_event_handler("on_client_disconnected", on_client_disconnected)
    return worker


async def run_call(worker: PipelineWorker) -> None:
    """Run one call's pipeline until the caller leaves."""
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await runner.run()


def make_app(args: argparse.Namespace) -> web.Application:
    calls: set[asyncio.Task[None]] = set()

    async def offer(request: web.Request) -> web.Response:
        body = await request.json()
        connection = SmallWebRTCConnection()
        await connection.initialize(sdp=body["sdp"], type=body["type"])
        # the models load before the answer goes back: the call is ready once connected
        call = asyncio.create_task(run_call(prepare_call(connection, args)))
        calls.add(call)
        call.add_done_callback(calls.discard)
        answer = connection.get_answer()
        if answer is None:
            return web.json_response({"error": "no SDP answer"}, status=500)
        return web.json_response({**answer, "session_id": answer["pc_id"]})

    async def cancel_calls(app: web.Application) -> None:
        for call in list(calls):
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    app = web.Application()
    app.router.add_post("/offer", offer)
    app.on_shutdown.append(cancel_calls)
    return app


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(make_app(args))
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"pipecat bot ready on http://{args.host}:{args.port}", flush=True)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--llm-base-url", required=True)
    parser.add_argument("--llm-model", default="bench")
    parser.add_argument("--llm-api-key", default="bench")
    parser.add_argument("--whisper-model", required=True, help="a CTranslate2 Whisper folder")
    parser.add_argument("--piper-voice", required=True, help="a Piper .onnx (.onnx.json beside)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    logger.remove()
    logger.add(sys.stderr, level=args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
