"""baresip (the Debian ``baresip-core`` package), a real SIP phone, as a test's peer on
127.0.0.1: it speaks a WAV file (``aufile``; it hangs up when the file ends), records what it
sends and what it hears (``sndfile``), and answers or dials as its account and command line
say. Its configuration is the template ``tests/sip/baresip/config``; it runs in its own process
group (``tests.support.processes``), so nothing outlives the test."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from media import Resampler
from media.audio import pcm_rms_dbfs
from tests.support.processes import free_port, spawn, stop_group

__all__ = [
    "FRAME_BYTES",
    "LOUD_DBFS",
    "RATE",
    "Baresip",
    "loud_frames",
    "start_baresip",
    "until",
    "utterances",
]

RATE = 8000
"""The phone's audio, sent and heard: 8 kHz mono PCM16."""
FRAME_BYTES = RATE * 20 // 1000 * 2
"""One 20 ms frame of the phone's audio."""
LOUD_DBFS = -45.0
"""A frame above this level is loud (speech), at or below it quiet."""
TEMPLATE = Path(__file__).resolve().parent.parent / "sip" / "baresip" / "config"


def loud_frames(pcm: bytes) -> list[float]:
    """Start times (seconds, rounded to 10 ms) of the loud 20 ms frames of 8 kHz PCM16."""
    return [
        round(i / FRAME_BYTES * 0.02, 2)
        for i in range(0, len(pcm) - FRAME_BYTES + 1, FRAME_BYTES)
        if pcm_rms_dbfs(pcm[i : i + FRAME_BYTES]) > LOUD_DBFS
    ]


def utterances(pcm: bytes, gap_s: float) -> list[tuple[float, float]]:
    """Spans (start, end seconds) of the loud 20 ms frames of 8 kHz PCM16; pauses shorter than
    ``gap_s`` join words into one utterance."""
    spans: list[tuple[float, float]] = []
    for at in loud_frames(pcm):
        if spans and at - spans[-1][1] < gap_s:
            spans[-1] = (spans[-1][0], at + 0.02)
        else:
            spans.append((at, at + 0.02))
    return spans


@dataclass
class Baresip:
    """A running baresip started by :func:`start_baresip`, working in ``folder`` and listening
    for SIP on ``127.0.0.1:sip_port``."""

    process: asyncio.subprocess.Process
    folder: Path
    sip_port: int

    @property
    def log(self) -> Path:
        """Its output (stdout and stderr)."""
        return self.folder / "baresip.log"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace").replace("\r", "\n")

    def log_tail(self) -> str:
        """The last 40 lines of its output, for a failing test's message."""
        return "\n".join(self.log_text().splitlines()[-40:])

    def uri(self, user: str) -> str:
        """The SIP URI that reaches ``user`` at this phone."""
        return f"sip:{user}@127.0.0.1:{self.sip_port}"

    def call_over(self) -> bool:
        """Whether its call has ended (it hung up, or heard a BYE)."""
        return "terminated (duration" in self.log_text()

    def sent(self) -> bytes:
        """What it sent (its encoder's input) as 8 kHz PCM16, from the call's audio start."""
        return self._recorded("enc")

    def heard(self) -> bytes:
        """What it heard (its decoder's output) as 8 kHz PCM16, from the call's audio start.
        baresip writes its recordings as its call closes."""
        return self._recorded("dec")

    def heard_s(self) -> float:
        """How many seconds of the call's audio it has heard so far: its decoder's recording
        grows as it plays what came (20 ms at a time, in real time)."""
        found = list((self.folder / "recordings").glob("dump-*-dec.wav"))
        header = found[0].read_bytes()[:44] if found else b""
        per_s = int.from_bytes(header[28:32], "little")  # a plain WAV header's byte rate
        return (found[0].stat().st_size - 44) / per_s if len(header) == 44 and per_s else 0.0

    async def hears_more(self, seconds: float) -> None:
        """Until it has heard ``seconds`` more of the call than it had: with 0.3 s or more,
        whatever the server had sent by now has come out of its jitter buffer (100-200 ms deep)
        into its recording. Fails the test if it stops playing for 5 s."""
        heard_s = self.heard_s()
        await until(lambda: self.heard_s() >= heard_s + seconds, 5, "it stopped playing", self)

    def _recorded(self, direction: str) -> bytes:
        """A recording at 8 kHz, mono (a G.722 call's at 16 kHz and an Opus call's at 48 kHz
        in stereo, taken down)."""
        (path,) = (self.folder / "recordings").glob(f"dump-*-{direction}.wav")
        with wave.open(str(path), "rb") as wav:
            channels = wav.getnchannels()
            assert (channels in (1, 2), wav.getsampwidth()) == (True, 2)
            rate, pcm = wav.getframerate(), wav.readframes(wav.getnframes())
        if channels == 2:  # the left channel
            pcm = np.frombuffer(pcm, np.int16)[::2].tobytes()
        if rate == RATE:
            return pcm
        resampler = Resampler(rate, RATE)
        return resampler.resample(pcm) + resampler.flush()

    async def stop(self) -> None:
        """Quit (its recordings are written out), killed if it must be."""
        if self.process.returncode is None:
            self.process.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), 5)
        await stop_group(self.process)


async def until(
    condition: Callable[[], bool], timeout_s: float, what: str, *phones: Baresip
) -> None:
    """Wait until ``condition()`` holds (checked every 50 ms). If it does not within
    ``timeout_s``, fail the test with "WHAT within N s" and the end of each of ``phones``'
    logs."""
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():  # noqa: ASYNC110 - the server and the peers move it
                await asyncio.sleep(0.05)
    except TimeoutError:
        logs = "".join(f"\n\n{phone.folder.name}:\n{phone.log_tail()}" for phone in phones)
        pytest.fail(f"{what} within {timeout_s} s{logs}")


async def start_baresip(
    folder: Path,
    speech: bytes,
    *,
    account: str = "caller",
    dial: str | None = None,
    linger_s: float = 30.0,
    wideband: bool = False,
    opus: bool = False,
    extra_config: str = "",
) -> Baresip:
    """Start baresip in ``folder`` (created) with one local account that never registers
    (``account``: its user and any parameters, e.g. ``human;answermode=auto`` to answer at
    once), saying ``speech`` (8 kHz PCM16) in each call; it dials ``dial`` if given. It quits
    by itself ``linger_s`` after the speech would end, even if the test dies; stop it with
    :meth:`Baresip.stop`. With ``wideband`` it also has G.722, offered after PCMU and PCMA
    (and its file source then plays at 16 kHz: the call must settle on G.722); with ``opus``
    Opus, offered after those (its file source at 48 kHz: the call must settle on Opus).
    ``extra_config``: more lines for its configuration (modules, ``sip_cafile``...).
    Fails the test if baresip is not installed."""
    path = shutil.which("baresip")
    if path is None:
        pytest.fail("baresip is required: apt-get install -y baresip-core", pytrace=False)
    config, recordings, wav_path = folder / "config", folder / "recordings", folder / "speech.wav"
    for made in (config, recordings):
        made.mkdir(parents=True)
    rate = 48000 if opus else 2 * RATE if wideband else RATE
    if rate != RATE:  # its file source plays at the codec's rate: the call must be on it
        resampler = Resampler(RATE, rate)
        speech = resampler.resample(speech) + resampler.flush()
    channels = 2 if opus else 1  # its Opus takes stereo only
    if opus:
        mono = np.frombuffer(speech, np.int16)
        speech = np.repeat(mono, 2).tobytes()
    with wave.open(str(wav_path), "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(speech)
    port = free_port(span=2)  # SIP on UDP and TCP, and SIP/TLS on the port above
    (config / "config").write_text(
        TEMPLATE.read_text().format(
            sip_port=port,
            speech=wav_path,
            recordings=recordings,
            extra=("module\t\t\tg722.so\n" if wideband or opus else "")
            + ("module\t\t\topus.so\n" if opus else "")
            + extra_config,
        )
    )
    user, _, parameters = account.partition(";")
    line = ";".join([f"<sip:{user}@127.0.0.1>", "regint=0", *([parameters] if parameters else [])])
    (config / "accounts").write_text(line + "\n")
    seconds = round(len(speech) / 2 / rate + linger_s)
    with (folder / "baresip.log").open("wb") as output:
        process = await spawn(
            path,
            *("-f", str(config), "-t", str(seconds)),
            *(("-e", f"/dial {dial}") if dial else ()),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    return Baresip(process, folder, port)
