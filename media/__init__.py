"""Audio: PCM helpers, VAD segmentation, Whisper STT, Piper TTS, sentence chunking, the speaker.

Knows nothing about LLMs, playbooks or transports.
"""

from .audio import FRAME_BYTES, FRAME_MS, SAMPLE_RATE, FrameSplitter, Resampler
from .chunker import SentenceChunker, joins_next, speakable
from .echo import EchoGate, EchoSettings
from .hearing import Hearing, HearingSettings
from .speaker import Playback, PlaybackResult, Speaker
from .stt import SpeechToText, Transcriber, TranscriberSettings, Transcript
from .tts import Synthesizer, SynthesizerSettings, TextToSpeech
from .vad import (
    SpeechEnded,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    VadEvent,
    VadSegmenter,
    VadSettings,
)

__all__ = [
    "FRAME_BYTES",
    "FRAME_MS",
    "SAMPLE_RATE",
    "EchoGate",
    "EchoSettings",
    "FrameSplitter",
    "Hearing",
    "HearingSettings",
    "Playback",
    "PlaybackResult",
    "Resampler",
    "SentenceChunker",
    "Speaker",
    "SpeechEnded",
    "SpeechPaused",
    "SpeechResumed",
    "SpeechStarted",
    "SpeechToText",
    "Synthesizer",
    "SynthesizerSettings",
    "TextToSpeech",
    "Transcriber",
    "TranscriberSettings",
    "Transcript",
    "VadEvent",
    "VadSegmenter",
    "VadSettings",
    "joins_next",
    "speakable",
]
