"""``vocable serve``'s settings as the server uses them: :class:`ServerConfig`, built from the
checked flat :class:`~server.config.serve_options.ServeOptions` (whose defaults its fields take).

A field that is an option (named alike, or in :data:`RENAMED`) is taken from the options as it is
(:data:`OPTION_FIELDS`); only the settings built from options are written in
:meth:`ServerConfig.from_options`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Any, Literal

from media import HearingSettings, TranscriberSettings
from media.remote import RemoteSynthesizerSettings, RemoteTranscriberSettings
from media.tts import SynthesizerSettings
from media.turn_model import TurnModelSettings
from playbooks import ToolCalling
from server.admission.overload import OverloadSettings
from server.call.recordings import RecordingSettings
from server.call.session import SessionSettings

from .bundled import EXAMPLES, WEB_CLIENT
from .llm import ConfigError, LLMChoice, LLMSettings
from .option_values import DEFAULT_HOST, parse_address, parse_port_range
from .serve_flags import add_serve_arguments, serve_options
from .serve_options import Cleanup, Line, ServeOptions
from .sip_trunks import (
    InboundAuth,
    RegisterSettings,
    Trunk,
    TrunkError,
    inbound_auth,
    load_trunks,
    register_settings,
)

__all__ = [
    "BUILT_ALIKE",
    "EXAMPLES",
    "OPTION_FIELDS",
    "RENAMED",
    "IceServer",
    "ServerConfig",
    "SharedLLM",
    "SipSettings",
    "TransferApiSettings",
    "add_serve_arguments",
    "parse_address",
    "parse_port_range",
]

DEFAULTS = ServeOptions()
"""Where the defaults of the fields below that are options come from."""


@dataclass(frozen=True)
class IceServer:
    urls: str
    username: str | None = None
    credential: str | None = field(default=None, repr=False)

    def to_client(self) -> dict[str, Any]:
        """The RTCIceServer dictionary browsers take."""
        out: dict[str, Any] = {"urls": self.urls}
        if self.username:
            out["username"] = self.username
        if self.credential:
            out["credential"] = self.credential
        return out


@dataclass(frozen=True)
class SipTls:
    """SIP over TLS (``--sip-tls``): where it listens, and the certificate it shows."""

    host: str
    port: int
    certificate: Path
    key: Path

    def context(self) -> ssl.SSLContext:
        """The server's TLS context; raises ConfigError with one line when the certificate or
        key cannot be read, or do not match."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.certificate, self.key)
        except FileNotFoundError as exc:
            raise ConfigError(f"--sip-tls: {exc.filename}: no such file") from None
        except (ssl.SSLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc.__class__.__name__
            raise ConfigError(
                f"--sip-tls: cannot use {self.certificate} with {self.key}: {reason}"
            ) from None
        return context


SrtpMode = Literal["required", "optional", "off"]
"""Whether SIP calls' media must be SRTP (SDES), may be, or must not be."""


@dataclass(frozen=True)
class SipSettings:
    """The native SIP endpoint (``--sip``): where it listens and whom it answers."""

    host: str = DEFAULT_HOST
    port: int = 5060
    advertise: str | None = None
    """The address put in SDP and Contact, when the bind address is not what peers reach
    (behind NAT, or bound to 0.0.0.0). None: the bind address, or the local address facing
    the caller."""
    allow: tuple[IPv4Network | IPv6Network, ...] = ()
    """Source networks whose SIP messages are answered; empty: any source."""
    rtp_ports: tuple[int, int] = DEFAULTS.rtp_ports
    """RTP/RTCP port pairs are taken from this range (low inclusive, high exclusive)."""
    media_timeout_s: float = 30.0
    """Hang up when no RTP arrives this long (a peer that vanished without a BYE)."""
    ring_timeout_s: float = DEFAULTS.sip_ring_timeout_s
    """How long an outbound call (``POST /calls``) rings before it is cancelled (no answer)."""
    trunks: Mapping[str, Trunk] = field(default_factory=dict)
    """Named ways out for outbound calls (:mod:`server.config.sip_trunks`)."""
    register: RegisterSettings | None = None
    """Register at a PBX or registrar as an extension (``--sip-register``)."""
    auth: InboundAuth | None = None
    """Challenge INVITEs from outside ``allow`` (``--sip-auth``); None: they get no answer."""
    dns_server: tuple[str, int] | None = None
    """The nameserver SIP hosts are resolved with (NAPTR, SRV, A); None: the system's."""
    srtp: SrtpMode = "optional"
    """SRTP for inbound calls (``--sip-srtp``): when offered, always, or never."""
    tls: SipTls | None = None
    """Also take SIP over TLS (``--sip-tls``)."""


@dataclass(frozen=True)
class TransferApiSettings:
    """The provider's REST API that moves a media-stream call to a person (Twilio's Calls
    resource, or one speaking its wire format)."""

    base_url: str
    username: str | None = None
    """Basic-auth user; None: the stream's ``accountSid``."""
    password: str | None = field(default=None, repr=False)
    timeout_s: float = 10.0


@dataclass(frozen=True)
class SharedLLM:
    """A model the supervisor of ``--workers`` runs in its own process for all its workers:
    one copy of the weights, reached on loopback with a key made at start."""

    base_url: str
    api_key: str = field(repr=False)
    model: str


@dataclass(frozen=True)
class LocalLLMSettings:
    """An LLM on this machine, for a server given no endpoint."""

    gguf: Path | None = None
    """The model file to run in process; None: the default model (downloaded once)."""
    search: bool = True
    """Look for a running local server (Ollama, LM Studio, ...) first."""
    model: str | None = None
    """The model to ask a local server for (``--llm-model``); None: the first it lists."""
    shared: SharedLLM | None = None
    """A worker's model, run by its supervisor (set by the supervisor, not by a flag)."""

    @classmethod
    def of(cls, choice: LLMChoice) -> LocalLLMSettings | None:
        """What ``choice`` asks of a local LLM; None when it names an endpoint or none."""
        if not choice.embedded:
            return None
        search = choice.mode == "auto" and choice.gguf is None
        return cls(gguf=choice.gguf, search=search, model=choice.model)


@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULTS.host
    port: int = DEFAULTS.port
    playbook: Path = DEFAULTS.playbook
    """A playbook file or a folder of them."""
    tools_module: Path | None = DEFAULTS.tools_module
    """The tools module of playbook files that name none."""
    llm: LLMSettings | None = None
    """The configured endpoint; None: see ``local_llm``."""
    local_llm: LocalLLMSettings | None = None
    """With no endpoint: where a local LLM is found or run; None (and no endpoint): calls still
    work but the agent cannot answer."""
    tool_calling: ToolCalling = "native"
    """Who calls the tools where a playbook does not say (``--llm-tool-calling``)."""
    llm_retries: int = DEFAULTS.llm_retries
    llm_timeout_s: float = DEFAULTS.llm_timeout_s
    """The longest the LLM may stay silent (before its first token or between chunks) before
    the turn falls back to the spoken apology."""
    transcriber: TranscriberSettings = field(default_factory=TranscriberSettings)
    synthesizer: SynthesizerSettings = field(default_factory=SynthesizerSettings)
    # remote inference: each direction is local unless its URL is given. The API key is never
    # logged nor echoed: it lives in fields with repr=False.
    remote_stt: RemoteTranscriberSettings | None = None
    """Transcribe on an OpenAI-compatible audio server instead of local Whisper."""
    remote_tts: RemoteSynthesizerSettings | None = None
    """Synthesize on an OpenAI-compatible audio server instead of local Piper."""
    session: SessionSettings = field(default_factory=SessionSettings)
    turn_model: TurnModelSettings | None = field(default_factory=TurnModelSettings)
    """The audio end-of-turn model beside the words (None: words and silence alone)."""
    noise_suppression: Cleanup = DEFAULTS.noise_suppression
    echo_cancellation: Cleanup = DEFAULTS.echo_cancellation
    ice_servers: tuple[IceServer, ...] = ()
    max_sessions: int = DEFAULTS.max_sessions
    overload: OverloadSettings = field(default_factory=OverloadSettings)
    """When new calls are refused before ``max_sessions``: measured load past capacity."""
    auth_token: str | None = field(default=DEFAULTS.auth_token, repr=False)
    cors_origins: tuple[str, ...] = DEFAULTS.cors_origins
    idle_timeout_s: float = DEFAULTS.idle_timeout_s
    """Hang up after this long without caller speech."""
    max_call_s: float = DEFAULTS.max_call_s
    webrtc_media_timeout_s: float = DEFAULTS.webrtc_media_timeout_s
    redis_url: str | None = DEFAULTS.redis_url
    """Where the replicas record their live calls (None: this server alone answers for its
    calls)."""
    internal_url: str | None = DEFAULTS.internal_url
    """How the other replicas reach this server (None: ``http://HOST:PORT``)."""
    """Hang up a WebRTC call whose caller audio stopped this long ago (the peer vanished)."""
    audiosocket: tuple[str, int] | None = DEFAULTS.audiosocket
    """Where to accept Asterisk AudioSocket connections (None: not at all)."""
    sip: SipSettings | None = None
    """The native SIP endpoint (None: off)."""
    recording: RecordingSettings | None = None
    """Where and how calls are recorded (None: not at all)."""
    transfer_api: TransferApiSettings | None = None
    """Where media-stream transfers are sent (None: only the stream's ``transfer`` event)."""
    rate_limit_per_min: float = DEFAULTS.rate_limit
    """New calls admitted per client address and minute (WebRTC offers, SIP INVITEs); 0: no
    limit."""
    rate_limit_burst: int = DEFAULTS.rate_limit_burst
    trusted_proxies: tuple[IPv4Network | IPv6Network, ...] = DEFAULTS.trusted_proxies
    """Load balancers whose ``X-Forwarded-For`` names the real client (for the rate limit)."""
    drain_timeout_s: float = DEFAULTS.drain_timeout_s
    """On SIGTERM, how long live calls may go on before they are hung up."""
    workers: int = DEFAULTS.workers
    """Processes sharing the HTTP port (SO_REUSEPORT), each with its own models."""
    worker_index: int = 0
    call_id_prefix: str = ""
    """Prefix of this process's call ids (``w1.`` in worker 1), so any worker can route a
    hang-up to the worker holding the call."""
    log_format: str = DEFAULTS.log_format
    otel: bool = DEFAULTS.otel
    """Export a trace per turn over OTLP (the ``otel`` extra; ``OTEL_EXPORTER_OTLP_*``)."""
    web_client_dir: Path = WEB_CLIENT

    def hearing(self, line: Line) -> HearingSettings:
        """How a call on ``line`` has its caller's audio cleaned (``phone``: on phone lines)."""
        return HearingSettings(
            noise_suppression=_applies(self.noise_suppression, line),
            echo_cancellation=_applies(self.echo_cancellation, line),
        )

    @property
    def reachable_at(self) -> str:
        """The URL the other replicas use to reach this server."""
        if self.internal_url:
            return self.internal_url
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ
    ) -> ServerConfig:
        """The configuration of a namespace parsed with :func:`add_serve_arguments` (``env`` is
        read for the LLM endpoint only); raises ConfigError with one line for bad values."""
        options = serve_options(args)
        choice = LLMChoice.resolve(args, env)
        local = LocalLLMSettings.of(choice)
        return dataclasses.replace(
            cls.from_options(options, choice.endpoint),
            local_llm=local,
            tool_calling=choice.tool_calling,
        )

    @classmethod
    def from_options(cls, options: ServeOptions, llm: LLMSettings | None = None) -> ServerConfig:
        """The configuration of checked options: the fields of :data:`OPTION_FIELDS` as the
        options give them, the others built from them. Raises ConfigError only for a file an
        option names that cannot be read (the SIP trunks, their passwords)."""
        ice = tuple(
            IceServer(url, options.turn_username, options.turn_credential)
            if url.startswith("turn")
            else IceServer(url)
            for url in options.ice_servers
        )
        taken = {name: getattr(options, option) for name, option in OPTION_FIELDS.items()}
        return cls(
            **taken,
            llm=llm,
            transcriber=TranscriberSettings(
                model=options.stt_model, cpu_threads=options.stt_threads
            ),
            synthesizer=SynthesizerSettings(voice=options.tts_voice, threads=options.tts_threads),
            remote_stt=_remote_stt(options),
            remote_tts=_remote_tts(options),
            session=options.session(),
            turn_model=None
            if options.no_turn_model
            else TurnModelSettings(options.turn_model_file),
            ice_servers=ice,
            sip=_sip_settings(options),
            recording=_recording_settings(options),
            transfer_api=_transfer_api(options),
            overload=OverloadSettings(
                max_loop_lag_ms=options.overload_loop_lag_ms,
                max_decode_backlog=options.overload_decode_backlog,
                max_synthesis_backlog=options.overload_synthesis_backlog,
                max_cpu_percent=options.overload_cpu_percent,
                capacity_cpu_percent=options.overload_capacity_cpu_percent,
            ),
        )


def _applies(choice: Cleanup, line: Line) -> bool:
    return choice == "all" or (choice == "phone" and line == "phone")


RENAMED: Mapping[str, str] = {"rate_limit_per_min": "rate_limit"}
""":class:`ServerConfig` field -> its option, where the names differ (the field's name says its
unit; renaming it would reach the call registry and many tests)."""

BUILT_ALIKE = frozenset({"ice_servers", "sip"})
"""Fields named like their option but built from it (and from other options) in
:meth:`ServerConfig.from_options`: the ICE URLs with the TURN credentials, the SIP address with
the other SIP options. (One left out of here is given twice: a TypeError.)"""

OPTION_FIELDS: Mapping[str, str] = {
    config.name: option
    for config in dataclasses.fields(ServerConfig)
    if (option := RENAMED.get(config.name, config.name)) in ServeOptions.model_fields
    and config.name not in BUILT_ALIKE
}
""":class:`ServerConfig` field -> the :class:`ServeOptions` field whose value it takes as it is:
every field named like an option, or in :data:`RENAMED`, but those in :data:`BUILT_ALIKE`."""


def _transfer_api(options: ServeOptions) -> TransferApiSettings | None:
    if options.transfer_api_url is None:
        return None
    return TransferApiSettings(
        options.transfer_api_url, options.transfer_api_username, options.transfer_api_password
    )


def _recording_settings(options: ServeOptions) -> RecordingSettings | None:
    if options.record is None:
        return None
    return RecordingSettings(
        directory=options.record,
        notice=options.record_notice,
        retention_days=options.record_retention_days,
    )


def _sip_settings(options: ServeOptions) -> SipSettings | None:
    """The SIP endpoint's settings; raises ConfigError when a trunk's file or password cannot
    be read."""
    if options.sip is None:
        return None
    host, port = options.sip
    flags = {
        "proxy": options.sip_outbound_proxy,
        "username": options.sip_username,
        "password": options.sip_password,
        "password_file": options.sip_password_file,
        "caller_id": options.sip_caller_id,
    }
    try:
        trunks = load_trunks(options.sip_trunks, flags)
        register = register_settings(
            options.sip_register,
            expires_s=options.sip_register_expires_s,
            username=options.sip_username,
            proxy=options.sip_outbound_proxy,
            password=options.sip_password,
            password_file=options.sip_password_file,
        )
        auth = inbound_auth(
            options.sip_auth,
            password=options.sip_auth_password,
            password_file=options.sip_auth_password_file,
            algorithm=options.sip_auth_algorithm,
        )
    except TrunkError as exc:
        raise ConfigError(str(exc)) from None
    tls = _sip_tls(options, host)
    if register is not None and register.transport == "tls" and tls is None:
        raise ConfigError("--sip-register over TLS (transport=tls) needs --sip-tls")
    return SipSettings(
        host=host,
        port=port,
        advertise=options.sip_advertise,
        allow=options.sip_allow,
        rtp_ports=options.rtp_ports,
        ring_timeout_s=options.sip_ring_timeout_s,
        trunks=trunks,
        register=register,
        auth=auth,
        dns_server=options.sip_dns_server,
        srtp=options.sip_srtp,
        tls=tls,
    )


def _sip_tls(options: ServeOptions, default_host: str) -> SipTls | None:
    """``--sip-tls``'s settings, the certificate and key checked; raises ConfigError."""
    if options.sip_tls is None:
        if options.sip_tls_cert or options.sip_tls_key:
            raise ConfigError("--sip-tls-cert and --sip-tls-key need --sip-tls [HOST:]PORT")
        return None
    if options.sip_tls_cert is None or options.sip_tls_key is None:
        raise ConfigError("--sip-tls needs --sip-tls-cert and --sip-tls-key")
    host, port = options.sip_tls
    tls = SipTls(host or default_host, port, options.sip_tls_cert, options.sip_tls_key)
    tls.context()
    return tls


def _remote_stt(options: ServeOptions) -> RemoteTranscriberSettings | None:
    if options.stt_url is None:
        return None
    return RemoteTranscriberSettings(
        base_url=options.stt_url, model=options.stt_remote_model, api_key=options.inference_api_key
    )


def _remote_tts(options: ServeOptions) -> RemoteSynthesizerSettings | None:
    if options.tts_url is None:
        return None
    return RemoteSynthesizerSettings(
        base_url=options.tts_url,
        model=options.tts_remote_model,
        voice=options.tts_remote_voice,
        response_format=options.tts_remote_format,
        api_key=options.inference_api_key,
    )
