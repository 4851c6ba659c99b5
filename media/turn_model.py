"""Whether the caller sounds finished: an audio end-of-turn model (Smart Turn v3.2).

Words alone cannot tell "my number is 555 0134," from "my number is 555 0134.": the voice can. A
speaker who will go on keeps their pitch up and does not lengthen the last syllable. Smart Turn
v3.2 (Daily, BSD-2-Clause; the file and its licence ship in ``media/models``) reads the last 8 s
of an utterance as Whisper's 80-bin log-mel features and returns the probability that the
speaker has finished.

It is meant to run at a pause, with ~200 ms of the caller's silence at the end of the audio (the
way it was trained: scores for a finished question rise from ~0.2 with 60 ms of silence to ~0.8
with 160 ms). One evaluation costs 20-30 ms of one core on an AVX-512 CPU (about twice that
without), in one worker thread below the event loop's priority; evaluations wait their turn
rather than share a core. The endpointing policy (``server/call/endpointing.py``) decides what
a score means next to the words.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .audio import SAMPLE_RATE, pcm_to_float32
from .blas import single_threaded_blas
from .priority import in_background_thread, lower_this_thread
from .priority_pool import PriorityPool

__all__ = [
    "BUNDLED_TURN_MODEL",
    "TurnModel",
    "TurnModelError",
    "TurnModelSettings",
    "check_turn_model",
]

BUNDLED_TURN_MODEL = Path(__file__).resolve().parent / "models" / "smart-turn-v3.2-cpu.onnx"
_WINDOW_SAMPLES = 8 * SAMPLE_RATE
"""The model reads the last 8 s, zero-padded at the start."""
_NORMALIZE_EPS = 1e-7


class TurnModelError(RuntimeError):
    """The model file is missing, is not an ONNX model, or has the wrong inputs."""


@dataclass(frozen=True)
class TurnModelSettings:
    path: Path = BUNDLED_TURN_MODEL
    threads: int = 1
    """onnxruntime's threads for one evaluation (one keeps it off the other core)."""

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError("the turn model needs at least one thread")


class TurnModel:
    """Scores 16 kHz PCM16 utterances: the probability (0..1) that the speaker has finished.
    Build with :meth:`load`; share one per process."""

    def __init__(self, session: Any, settings: TurnModelSettings) -> None:
        from faster_whisper.feature_extractor import FeatureExtractor

        self._session = session
        self.settings = settings
        self._features = FeatureExtractor(feature_size=80, chunk_length=8)
        self._pool = PriorityPool(1, thread_name_prefix="turn-model", initializer=lower_this_thread)
        self._lock = threading.Lock()
        self.evaluations = 0
        self.busy_s = 0.0
        """Seconds of evaluation so far (one worker: the core time it took)."""

    @classmethod
    def load(cls, settings: TurnModelSettings | None = None) -> TurnModel:
        """Load and warm up the model (blocking). Raises :class:`TurnModelError` with one line
        that names the file when it is missing or damaged."""
        settings = settings or TurnModelSettings()
        return in_background_thread(lambda: cls._load(settings))

    @classmethod
    def _load(cls, settings: TurnModelSettings) -> TurnModel:
        import onnxruntime as ort

        path = settings.path
        if not path.is_file():
            raise TurnModelError(f"turn model {path}: no such file")
        options = ort.SessionOptions()
        options.intra_op_num_threads = settings.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        try:
            session = ort.InferenceSession(
                str(path), sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own types for a bad file
            raise TurnModelError(f"turn model {path}: not a loadable ONNX model ({exc})") from None
        inputs = [i.name for i in session.get_inputs()]
        if inputs != ["input_features"]:
            raise TurnModelError(
                f"turn model {path}: expected input 'input_features', not {inputs}"
            )
        single_threaded_blas()
        model = cls(session, settings)
        model._score(bytes(SAMPLE_RATE))  # the first run pays one-off allocations
        model.evaluations, model.busy_s = 0, 0.0
        return model

    async def completion(self, pcm: bytes) -> float:
        """The probability that the speaker of ``pcm`` (16 kHz PCM16, ending in the silence
        after their last word) has finished their turn. Cancelling abandons the result."""
        return await asyncio.wrap_future(self._pool.submit(self._score, pcm))

    @property
    def mean_cost_ms(self) -> float:
        with self._lock:
            return self.busy_s / self.evaluations * 1000 if self.evaluations else 0.0

    def _score(self, pcm: bytes) -> float:
        started = time.perf_counter()
        audio = pcm_to_float32(pcm)[-_WINDOW_SAMPLES:]
        audio = np.pad(audio, (_WINDOW_SAMPLES - audio.size, 0))
        audio = (audio - audio.mean()) / np.sqrt(audio.var() + _NORMALIZE_EPS)
        features = self._features(audio, padding=0)[np.newaxis].astype(np.float32)
        (logits,) = self._session.run(None, {"input_features": features})
        score = float(np.clip(logits.reshape(-1)[0], 0.0, 1.0))
        with self._lock:
            self.evaluations += 1
            self.busy_s += time.perf_counter() - started
        return score

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_turn_model(path: Path) -> None:
    """Raise :class:`TurnModelError` (one line naming ``path``) unless it loads as a turn
    model: for a server to refuse a bad file before it loads anything else."""
    _session(path, threads=1)


def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    if not path.is_file():
        raise TurnModelError(f"turn model {path}: no such file")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 4  # its errors reach the caller as one line
    try:
        session = ort.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # onnxruntime raises its own types for a bad file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TurnModelError(f"turn model {path}: not a loadable ONNX model ({reason})") from None
    inputs = [i.name for i in session.get_inputs()]
    if inputs != ["input_features"]:
        raise TurnModelError(f"turn model {path}: its inputs are {inputs}, not input_features")
    return session
