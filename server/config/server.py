"""``vocable serve`` settings: flags, each with a ``VOCABLE_*`` environment equivalent."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Network, IPv6Network, ip_network
from pathlib import Path
from typing import Any, get_args

from media import TranscriberSettings, VadSettings
from media.remote import RemoteSynthesizerSettings, RemoteTranscriberSettings
from media.tts import SynthesizerSettings
from playbooks import BargeInPolicy, OrchestratorOptions
from server.call.endpointing import EndpointSettings
from server.call.session import SessionSettings

from .arguments import positive_float, positive_int
from .llm import ConfigError, LLMSettings, add_llm_arguments

__all__ = [
    "EXAMPLES",
    "IceServer",
    "ServerConfig",
    "SipSettings",
    "add_serve_arguments",
    "parse_address",
    "parse_port_range",
]

EXAMPLES = Path(__file__).resolve().parents[2] / "playbooks" / "examples"


@dataclass(frozen=True)
class IceServer:
    urls: str
    username: str | None = None
    credential: str | None = None

    def to_client(self) -> dict[str, Any]:
        """The RTCIceServer dictionary browsers take."""
        out: dict[str, Any] = {"urls": self.urls}
        if self.username:
            out["username"] = self.username
        if self.credential:
            out["credential"] = self.credential
        return out


@dataclass(frozen=True)
class SipSettings:
    """The native SIP endpoint (``--sip``): where it listens and whom it answers."""

    host: str = "127.0.0.1"
    port: int = 5060
    advertise: str | None = None
    """The address put in SDP and Contact, when the bind address is not what peers reach
    (behind NAT, or bound to 0.0.0.0). None: the bind address, or the local address facing
    the caller."""
    allow: tuple[IPv4Network | IPv6Network, ...] = ()
    """Source networks whose SIP messages are answered; empty: any source."""
    rtp_ports: tuple[int, int] = (10000, 20000)
    """RTP/RTCP port pairs are taken from this range (low inclusive, high exclusive)."""
    media_timeout_s: float = 30.0
    """Hang up when no RTP arrives this long (a peer that vanished without a BYE)."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    playbook_path: Path = EXAMPLES
    llm: LLMSettings | None = None
    """None: no endpoint configured; calls still work but the agent cannot answer."""
    llm_retries: int = 3
    llm_timeout_s: float = OrchestratorOptions().llm_timeout_ms / 1000
    """The longest the LLM may stay silent (before its first token or between chunks) before
    the turn falls back to the spoken apology."""
    transcriber: TranscriberSettings = field(default_factory=TranscriberSettings)
    synthesizer: SynthesizerSettings = field(default_factory=SynthesizerSettings)
    # remote inference (see "Remote STT and TTS" at the end of this module)
    remote_stt: RemoteTranscriberSettings | None = None
    """Transcribe on an OpenAI-compatible audio server instead of local Whisper."""
    remote_tts: RemoteSynthesizerSettings | None = None
    """Synthesize on an OpenAI-compatible audio server instead of local Piper."""
    session: SessionSettings = field(default_factory=SessionSettings)
    ice_servers: tuple[IceServer, ...] = ()
    max_sessions: int = 8
    auth_token: str | None = None
    cors_origins: tuple[str, ...] = ()
    idle_timeout_s: float = 300.0
    """Hang up after this long without caller speech."""
    max_call_s: float = 3600.0
    audiosocket: tuple[str, int] | None = None
    """Where to accept Asterisk AudioSocket connections (None: not at all)."""
    sip: SipSettings | None = None
    """The native SIP endpoint (None: off)."""
    rate_limit_per_min: float = 60.0
    """New calls admitted per client address and minute (WebRTC offers, SIP INVITEs); 0: no
    limit."""
    rate_limit_burst: int = 20
    trusted_proxies: tuple[IPv4Network | IPv6Network, ...] = ()
    """Load balancers whose ``X-Forwarded-For`` names the real client (for the rate limit)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long live calls may go on before they are hung up."""
    workers: int = 1
    """Processes sharing the HTTP port (SO_REUSEPORT), each with its own models."""
    worker_index: int = 0
    call_id_prefix: str = ""
    """Prefix of this process's call ids (``w1.`` in worker 1), so any worker can route a
    hang-up to the worker holding the call."""
    log_format: str = "text"
    otel: bool = False
    """Export a trace per turn over OTLP (the ``otel`` extra; ``OTEL_EXPORTER_OTLP_*``)."""
    web_client_dir: Path = Path(__file__).resolve().parents[2] / "web-client"

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ
    ) -> ServerConfig:
        try:
            llm: LLMSettings | None = LLMSettings.resolve(args, env)
        except ConfigError:
            llm = None
        _check_choices(args)
        _check_operations(args)
        username, credential = args.turn_username, args.turn_credential
        ice = tuple(
            IceServer(url, username, credential) if url.startswith("turn") else IceServer(url)
            for url in args.ice_server
        )
        return cls(
            host=args.host,
            port=args.port,
            playbook_path=args.playbook,
            llm=llm,
            llm_retries=args.llm_retries,
            llm_timeout_s=args.llm_timeout_s,
            transcriber=TranscriberSettings(model=args.stt_model, cpu_threads=args.stt_threads),
            synthesizer=SynthesizerSettings(voice=args.tts_voice),
            remote_stt=_remote_stt(args),
            remote_tts=_remote_tts(args),
            session=_session_settings(args),
            ice_servers=ice,
            max_sessions=args.max_sessions,
            auth_token=args.auth_token or None,
            cors_origins=tuple(args.cors_origin),
            idle_timeout_s=args.idle_timeout_s,
            max_call_s=args.max_call_s,
            audiosocket=parse_address(args.audiosocket) if args.audiosocket else None,
            sip=_sip_settings(args),
            rate_limit_per_min=args.rate_limit,
            rate_limit_burst=args.rate_limit_burst,
            trusted_proxies=_networks("--trusted-proxy", args.trusted_proxy),
            drain_timeout_s=args.drain_timeout_s,
            workers=args.workers,
            log_format=args.log_format,
            otel=args.otel,
        )


def _sip_settings(args: argparse.Namespace) -> SipSettings | None:
    if not args.sip:
        return None
    host, port = parse_address(args.sip)
    return SipSettings(
        host=host,
        port=port,
        advertise=args.sip_advertise or None,
        allow=_networks("--sip-allow", args.sip_allow),
        rtp_ports=parse_port_range(args.rtp_ports),
    )


def _session_settings(args: argparse.Namespace) -> SessionSettings:
    """The audio flags as session settings; raises ConfigError for values they refuse."""
    try:
        return SessionSettings(
            vad=VadSettings(
                aggressiveness=args.vad_aggressiveness,
                end_silence_ms=args.end_silence_ms,
                pause_ms=args.speculation_pause_ms,
            ),
            barge_in_min_ms=args.barge_in_min_ms,
            barge_in=args.barge_in,
            endpoint=EndpointSettings(
                speculate=not args.no_speculation, preempt_lead_ms=args.preempt_lead_ms
            ),
        )
    except ValueError as exc:
        raise ConfigError(f"audio settings: {exc}") from None


CHOICES: dict[str, tuple[Any, ...]] = {
    "barge_in": get_args(BargeInPolicy),
    "log_format": ("text", "json"),
    "vad_aggressiveness": (0, 1, 2, 3),
    "tts_remote_format": ("pcm", "wav"),
}
"""The values each flag with a fixed set takes, from the command line or the environment (whose
values argparse does not check against ``choices``)."""


def _check_choices(args: argparse.Namespace) -> None:
    for dest, allowed in CHOICES.items():
        value = getattr(args, dest, allowed[0])
        if value not in allowed:
            flag = "--" + dest.replace("_", "-")
            listed = ", ".join(str(choice) for choice in allowed)
            raise ConfigError(f"{flag} must be one of {listed}, not {value!r}")


def _check_operations(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    if args.rate_limit < 0:
        raise ConfigError("--rate-limit must not be negative (0: no limit)")
    if args.rate_limit_burst < 1:
        raise ConfigError("--rate-limit-burst must be at least 1")
    if args.llm_timeout_s <= 0:
        raise ConfigError("--llm-timeout-s must be positive")
    if args.drain_timeout_s < 0:
        raise ConfigError("--drain-timeout-s must not be negative")
    complete_ms = EndpointSettings().complete_silence_ms
    if not 0 <= args.preempt_lead_ms < complete_ms:
        raise ConfigError(f"--preempt-lead-ms must be 0 to {complete_ms - 1}")


def _networks(flag: str, items: list[str]) -> tuple[IPv4Network | IPv6Network, ...]:
    try:
        return tuple(ip_network(item, strict=False) for item in items)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def parse_port_range(text: str) -> tuple[int, int]:
    """``LOW-HIGH`` -> (low, high + 1), a range of at least one even/odd pair; raises
    ConfigError."""
    low, _, high = text.partition("-")
    try:
        first, last = int(low), int(high)
    except ValueError:
        raise ConfigError(f"{text!r} is not LOW-HIGH") from None
    if not 1024 <= first < last <= 65535:
        raise ConfigError(f"{text!r}: need 1024 <= LOW < HIGH <= 65535")
    return first, last + 1


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def parse_address(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` -> (host, port); raises ConfigError."""
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"{text!r} is not HOST:PORT") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"{text!r}: port out of range")
    return (host.strip("[]") or default_host), number


def add_serve_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ
) -> None:
    """Flags of ``vocable serve``; each default comes from its ``VOCABLE_*`` variable."""

    def default(name: str, cast: Callable[[str], Any], fallback: Any) -> Any:
        value = env.get(f"VOCABLE_{name}")
        if value is None or value == "":
            return fallback
        try:
            return cast(value)
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(f"vocable: VOCABLE_{name}={value!r}: {exc}") from None
        except ValueError:
            raise SystemExit(f"vocable: VOCABLE_{name}={value!r} is not valid") from None

    def listing(name: str) -> list[str]:
        return [item.strip() for item in env.get(f"VOCABLE_{name}", "").split(",") if item.strip()]

    net = parser.add_argument_group("network")
    net.add_argument("--host", default=default("HOST", str, "127.0.0.1"), help="[VOCABLE_HOST]")
    net.add_argument("--port", type=int, default=default("PORT", int, 8080), help="[VOCABLE_PORT]")
    net.add_argument(
        "--ice-server",
        action="append",
        default=listing("ICE_SERVERS"),
        metavar="URL",
        help="STUN/TURN URL, repeatable, e.g. stun:stun.example.org:3478 [VOCABLE_ICE_SERVERS, "
        "comma-separated; default: none, which suits calls on one network]",
    )
    net.add_argument("--turn-username", default=default("TURN_USERNAME", str, None))
    net.add_argument("--turn-credential", default=default("TURN_CREDENTIAL", str, None))
    net.add_argument(
        "--auth-token",
        default=default("AUTH_TOKEN", str, None),
        help="require 'Authorization: Bearer TOKEN' on POST /offer, DELETE /sessions/ID and the "
        "/twilio/media WebSocket (there ?token=TOKEN also works) [VOCABLE_AUTH_TOKEN; default: "
        "none, anyone may call]",
    )
    net.add_argument(
        "--cors-origin",
        action="append",
        default=listing("CORS_ORIGINS"),
        metavar="ORIGIN",
        help="allowed cross-origin page, repeatable [VOCABLE_CORS_ORIGINS]",
    )

    net.add_argument(
        "--rate-limit",
        type=float,
        default=default("RATE_LIMIT", float, 60.0),
        metavar="PER_MIN",
        help="new calls per client address and minute, /offer and SIP INVITE; 0: no limit "
        "[VOCABLE_RATE_LIMIT; default: 60]",
    )
    net.add_argument(
        "--rate-limit-burst",
        type=int,
        default=default("RATE_LIMIT_BURST", int, 20),
        metavar="N",
        help="new calls one address may open at once [VOCABLE_RATE_LIMIT_BURST; default: 20]",
    )
    net.add_argument(
        "--trusted-proxy",
        action="append",
        default=listing("TRUSTED_PROXIES"),
        metavar="CIDR",
        help="load balancer whose X-Forwarded-For names the client, repeatable "
        "[VOCABLE_TRUSTED_PROXIES, comma-separated]",
    )

    net.add_argument(
        "--audiosocket",
        default=default("AUDIOSOCKET", str, None),
        metavar="[HOST:]PORT",
        help="accept Asterisk AudioSocket calls here (host default 127.0.0.1) "
        "[VOCABLE_AUDIOSOCKET]",
    )

    sip = parser.add_argument_group("SIP")
    sip.add_argument(
        "--sip",
        default=default("SIP", str, None),
        metavar="[HOST:]PORT",
        help="answer SIP calls (UDP and TCP) here; host default 127.0.0.1 [VOCABLE_SIP]",
    )
    sip.add_argument(
        "--sip-allow",
        action="append",
        default=listing("SIP_ALLOW"),
        metavar="CIDR",
        help="answer SIP only from these networks, repeatable, e.g. 10.0.0.0/8 "
        "[VOCABLE_SIP_ALLOW, comma-separated; default: any source]",
    )
    sip.add_argument(
        "--sip-advertise",
        default=default("SIP_ADVERTISE", str, None),
        metavar="IP",
        help="address to put in SDP and Contact when peers reach this host by another "
        "(NAT, or --sip 0.0.0.0:PORT) [VOCABLE_SIP_ADVERTISE]",
    )
    sip.add_argument(
        "--rtp-ports",
        default=default("RTP_PORTS", str, "10000-19999"),
        metavar="LOW-HIGH",
        help="UDP ports for call audio [VOCABLE_RTP_PORTS; default: 10000-19999]",
    )

    calls = parser.add_argument_group("calls")
    calls.add_argument(
        "--playbook",
        type=Path,
        default=default("PLAYBOOK", Path, EXAMPLES),
        metavar="PATH",
        help="a playbook file or a folder of them [VOCABLE_PLAYBOOK; default: the examples]",
    )
    calls.add_argument(
        "--max-sessions",
        type=positive_int,
        default=default("MAX_SESSIONS", positive_int, 8),
        metavar="N",
        help="calls this process holds at once, all transports together; more are refused "
        "(HTTP or SIP 503 with Retry-After) [VOCABLE_MAX_SESSIONS; default: 8]",
    )
    calls.add_argument(
        "--idle-timeout-s",
        type=positive_float,
        default=default("IDLE_TIMEOUT_S", positive_float, 300.0),
        metavar="S",
        help="hang up a call (any transport) after this long without caller speech or input "
        "(keypad, typed text) while the agent is quiet [VOCABLE_IDLE_TIMEOUT_S; default: 300]",
    )
    calls.add_argument(
        "--max-call-s",
        type=positive_float,
        default=default("MAX_CALL_S", positive_float, 3600.0),
        metavar="S",
        help="hang up a call (any transport) this long after it started "
        "[VOCABLE_MAX_CALL_S; default: 3600]",
    )
    calls.add_argument(
        "--drain-timeout-s",
        type=float,
        default=default("DRAIN_TIMEOUT_S", float, 30.0),
        help="on SIGTERM, let live calls go on this long before hanging up "
        "[VOCABLE_DRAIN_TIMEOUT_S; default: 30]",
    )

    ops = parser.add_argument_group("operations")
    ops.add_argument(
        "--workers",
        type=int,
        default=default("WORKERS", int, 1),
        metavar="N",
        help="processes sharing the port, each with its own models [VOCABLE_WORKERS; default: 1]",
    )
    ops.add_argument(
        "--log-format",
        choices=CHOICES["log_format"],
        default=default("LOG_FORMAT", str, "text"),
        help="json: one JSON object per line, with the call's session id [VOCABLE_LOG_FORMAT]",
    )
    ops.add_argument(
        "--otel",
        action="store_true",
        default=default("OTEL", _flag, False),
        help="export a trace per turn (stage spans) over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT; "
        "needs pip install 'vocable[otel]' [VOCABLE_OTEL=1]",
    )

    add_llm_arguments(parser)
    parser.add_argument(
        "--llm-retries", type=int, default=default("LLM_RETRIES", int, 3), metavar="N"
    )
    parser.add_argument(
        "--llm-timeout-s",
        type=float,
        default=default("LLM_TIMEOUT_S", float, ServerConfig.llm_timeout_s),
        metavar="S",
        help="longest LLM silence (to the first token, or between chunks) before the agent "
        "apologizes [VOCABLE_LLM_TIMEOUT_S; default: %(default)g]",
    )

    audio = parser.add_argument_group("speech")
    audio.add_argument(
        "--stt-model",
        default=default("STT_MODEL", str, None),
        help="CTranslate2 Whisper folder or size name [VOCABLE_STT_MODEL; default: tiny.en]",
    )
    audio.add_argument("--stt-threads", type=int, default=default("STT_THREADS", int, 2))
    audio.add_argument(
        "--tts-voice",
        default=default("TTS_VOICE", str, None),
        help="Piper .onnx voice [VOCABLE_TTS_VOICE; default: en_US-joe-medium]",
    )
    audio.add_argument(
        "--vad-aggressiveness",
        type=int,
        choices=CHOICES["vad_aggressiveness"],
        default=default("VAD_AGGRESSIVENESS", int, 2),
    )
    audio.add_argument("--end-silence-ms", type=int, default=default("END_SILENCE_MS", int, 400))
    audio.add_argument("--barge-in-min-ms", type=int, default=default("BARGE_IN_MIN_MS", int, 200))
    audio.add_argument(
        "--barge-in",
        choices=CHOICES["barge_in"],
        default=default("BARGE_IN", str, "pause_resume"),
        help="policy of stages that set none [VOCABLE_BARGE_IN; default: pause_resume]",
    )
    audio.add_argument(
        "--no-speculation",
        action="store_true",
        default=default("NO_SPECULATION", _flag, False),
        help="transcribe only after the end of the turn, not at each pause "
        "[VOCABLE_NO_SPECULATION=1]",
    )
    audio.add_argument(
        "--speculation-pause-ms",
        type=int,
        default=default("SPECULATION_PAUSE_MS", int, VadSettings().pause_ms),
        help="silence inside an utterance at which Whisper starts on the words so far and the "
        "answer is prepared [VOCABLE_SPECULATION_PAUSE_MS; default: %(default)s]",
    )
    audio.add_argument(
        "--preempt-lead-ms",
        type=int,
        default=default("PREEMPT_LEAD_MS", int, EndpointSettings().preempt_lead_ms),
        help="how long before the end of the turn the answer may start on the words so far: "
        "longer answers sooner and wastes more LLM requests on callers who go on; 0: only at "
        "the end of the turn [VOCABLE_PREEMPT_LEAD_MS; default: %(default)s]",
    )
    _add_remote_arguments(parser, env)


# -- Remote STT and TTS ------------------------------------------------------------------------
# Each direction is local unless its URL is given; remote STT with local TTS (or the reverse) is
# fine. The API key is never logged nor echoed: it lives in fields with repr=False.


def _add_remote_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ
) -> None:
    """Flags pointing speech recognition and synthesis at OpenAI-compatible audio servers."""

    def default(name: str, fallback: str | None) -> str | None:
        return env.get(f"VOCABLE_{name}") or fallback

    group = parser.add_argument_group(
        "remote speech (OpenAI-compatible /v1/audio APIs, e.g. on a GPU server; default: local)"
    )
    group.add_argument(
        "--stt-url",
        default=default("STT_URL", None),
        metavar="URL",
        help="transcribe with this server's /audio/transcriptions, e.g. http://gpu-host:8000/v1 "
        "[VOCABLE_STT_URL; default: local Whisper]",
    )
    group.add_argument(
        "--stt-remote-model",
        default=default("STT_REMOTE_MODEL", "whisper-1"),
        metavar="NAME",
        help="[VOCABLE_STT_REMOTE_MODEL; default: whisper-1]",
    )
    group.add_argument(
        "--tts-url",
        default=default("TTS_URL", None),
        metavar="URL",
        help="synthesize with this server's /audio/speech [VOCABLE_TTS_URL; default: local Piper]",
    )
    group.add_argument(
        "--tts-remote-model",
        default=default("TTS_REMOTE_MODEL", "tts-1"),
        metavar="NAME",
        help="[VOCABLE_TTS_REMOTE_MODEL; default: tts-1]",
    )
    group.add_argument(
        "--tts-remote-voice",
        default=default("TTS_REMOTE_VOICE", "alloy"),
        metavar="NAME",
        help="[VOCABLE_TTS_REMOTE_VOICE; default: alloy]",
    )
    group.add_argument(
        "--tts-remote-format",
        choices=CHOICES["tts_remote_format"],
        default=default("TTS_REMOTE_FORMAT", "pcm"),
        help="pcm: raw 24 kHz PCM16 as OpenAI sends it; wav: for servers whose raw audio has "
        "another rate [VOCABLE_TTS_REMOTE_FORMAT; default: pcm]",
    )
    group.add_argument(
        "--inference-api-key",
        default=default("INFERENCE_API_KEY", None),
        metavar="KEY",
        help="bearer token for --stt-url and --tts-url [VOCABLE_INFERENCE_API_KEY; "
        "default: none, which self-hosted servers accept]",
    )


def _remote_url(flag: str, url: str | None) -> str | None:
    if not url:
        return None
    if not url.startswith(("http://", "https://")):
        raise ConfigError(
            f"{flag} must be an http:// or https:// base URL, like http://host:8000/v1"
        )
    return url.rstrip("/")


def _remote_stt(args: argparse.Namespace) -> RemoteTranscriberSettings | None:
    url = _remote_url("--stt-url", args.stt_url)
    if url is None:
        return None
    return RemoteTranscriberSettings(
        base_url=url, model=args.stt_remote_model, api_key=args.inference_api_key or None
    )


def _remote_tts(args: argparse.Namespace) -> RemoteSynthesizerSettings | None:
    url = _remote_url("--tts-url", args.tts_url)
    if url is None:
        return None
    return RemoteSynthesizerSettings(
        base_url=url,
        model=args.tts_remote_model,
        voice=args.tts_remote_voice,
        response_format=args.tts_remote_format,
        api_key=args.inference_api_key or None,
    )
