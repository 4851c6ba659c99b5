"""``vocable serve``'s options as one validated model: each option's default, constraints and help
are written here once, and flags and ``VOCABLE_*`` variables are both checked by it.

A field is flag ``--`` + its name with dashes (unless :class:`Cli` names another) and variable
``VOCABLE_`` + its name in capitals; :mod:`server.config.serve_flags` builds the parser from
them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from media import FRAME_MS, TranscriberSettings, VadSettings
from media.remote import RemoteSynthesizerSettings, RemoteTranscriberSettings
from media.tts import SynthesizerSettings
from media.turn_model import BUNDLED_TURN_MODEL
from playbooks import BargeInPolicy, OrchestratorOptions, RetryPolicy
from server.admission.overload import OverloadSettings
from server.call.endpointing import EndpointSettings
from server.call.session import SessionSettings

from .bundled import EXAMPLES
from .llm import LLM_GROUP, ConfigError
from .option_values import (
    DEFAULT_HOST,
    Address,
    BaseUrl,
    IceUrls,
    Nameserver,
    Networks,
    Number,
    PortRange,
    ReadWhole,
    RedisUrl,
    Switch,
    Text,
    Texts,
    Whole,
    format_port_range,
)

__all__ = [
    "ENV_PREFIX",
    "OPTIONS",
    "Cleanup",
    "Cli",
    "Line",
    "Option",
    "ServeOptions",
    "validate_options",
]

ENV_PREFIX = "VOCABLE_"

Line = Literal["browser", "phone"]
"""What kind of line a call comes in on: a browser (WebRTC: it cleans its own microphone) or a
phone line (SIP, AudioSocket, media streams)."""
Cleanup = Literal["phone", "all", "off"]
"""Where a cleanup of the caller's audio runs: on phone lines, on every line, nowhere."""

# library defaults the options share, so that each is written once
_SESSION = SessionSettings()
_OVERLOAD = OverloadSettings()
_VAD = _SESSION.vad
_ENDPOINT = _SESSION.endpoint


@dataclass(frozen=True)
class Cli:
    """How a :class:`ServeOptions` field is given on the command line."""

    group: str
    """Its --help group."""
    metavar: str | None = None
    flag: str | None = None
    """When not ``--`` + the field name with dashes."""
    repeat: bool = False
    """The flag is repeatable and the variable comma-separated; flags add to the variable's."""
    default_text: str | None = None
    """The default as --help says it, where the value (None, empty, a path) would say too little."""
    show: Callable[[Any], str] | None = None
    """The default in the form the flag takes, where ``str()`` is not it."""


NETWORK, SIP, CALLS, OPERATIONS, SPEECH = "network", "SIP", "calls", "operations", "speech"
TRANSFERS = "transfers (media streams)"
REMOTE = "remote speech (OpenAI-compatible /v1/audio APIs, e.g. on a GPU server; default: local)"
RECORDING = "recording (a stereo WAV and a JSON Lines transcript per call)"
REPLICAS = "replicas (a call reachable from any of them, through a call directory in Redis)"


class ServeOptions(BaseModel):
    """The options of ``vocable serve``, flat, as flags and variables give them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # -- network
    host: Annotated[str, Cli(NETWORK), Field(description="HTTP address to listen on")] = (
        DEFAULT_HOST
    )
    port: Annotated[
        Whole, Cli(NETWORK), Field(ge=0, le=65535, description="HTTP port to listen on")
    ] = 8080
    ice_servers: Annotated[
        IceUrls,
        Cli(
            NETWORK,
            "URL",
            "--ice-server",
            repeat=True,
            default_text="none, which suits calls on one network",
        ),
        Field(description="STUN/TURN URL, repeatable, e.g. stun:stun.example.org:3478"),
    ] = ()
    turn_username: Annotated[
        Text,
        Cli(NETWORK, "NAME"),
        Field(description="TURN user name, sent with each turn: URL of --ice-server"),
    ] = None
    turn_credential: Annotated[
        Text,
        Cli(NETWORK, "SECRET"),
        Field(description="TURN password, sent with each turn: URL of --ice-server", repr=False),
    ] = None
    auth_token: Annotated[
        Text,
        Cli(NETWORK, "TOKEN", default_text="none, anyone may call"),
        Field(
            description="require 'Authorization: Bearer TOKEN' on POST /offer, DELETE "
            "/sessions/ID and the /twilio/media WebSocket (there ?token=TOKEN also works)",
            repr=False,
        ),
    ] = None
    cors_origins: Annotated[
        Texts,
        Cli(NETWORK, "ORIGIN", "--cors-origin", repeat=True),
        Field(description="allowed cross-origin page, repeatable"),
    ] = ()
    rate_limit: Annotated[
        Number,
        Cli(NETWORK, "PER_MIN"),
        Field(
            ge=0,
            description="new calls per client address and minute, /offer and SIP INVITE; "
            "0: no limit",
        ),
    ] = 60.0
    rate_limit_burst: Annotated[
        Whole,
        Cli(NETWORK, "N"),
        Field(ge=1, description="new calls one address may open at once"),
    ] = 20
    trusted_proxies: Annotated[
        Networks,
        Cli(NETWORK, "CIDR", "--trusted-proxy", repeat=True),
        Field(description="load balancer whose X-Forwarded-For names the client, repeatable"),
    ] = ()
    audiosocket: Annotated[
        Address,
        Cli(NETWORK, "[HOST:]PORT"),
        Field(description=f"accept Asterisk AudioSocket calls here (host default {DEFAULT_HOST})"),
    ] = None

    # -- SIP
    sip: Annotated[
        Address,
        Cli(SIP, "[HOST:]PORT"),
        Field(description=f"answer SIP calls (UDP and TCP) here; host default {DEFAULT_HOST}"),
    ] = None
    sip_allow: Annotated[
        Networks,
        Cli(SIP, "CIDR", repeat=True, default_text="any source"),
        Field(description="answer SIP only from these networks, repeatable, e.g. 10.0.0.0/8"),
    ] = ()
    sip_advertise: Annotated[
        Text,
        Cli(SIP, "IP"),
        Field(
            description="address to put in SDP and Contact when peers reach this host by "
            "another (NAT, or --sip 0.0.0.0:PORT)"
        ),
    ] = None
    rtp_ports: Annotated[
        PortRange,
        Cli(SIP, "LOW-HIGH", show=format_port_range),
        Field(description="UDP ports for call audio"),
    ] = (10000, 20000)
    sip_ring_timeout_s: Annotated[
        Number,
        Cli(SIP, "S"),
        Field(
            gt=0,
            le=600,
            description="how long an outbound call (POST /calls) rings before it is given up",
        ),
    ] = 30.0

    sip_trunks: Annotated[
        Path | None,
        Cli(SIP, "PATH"),
        Field(
            description="a YAML file of named trunks for outbound calls: proxy, credentials, "
            "caller ID (docs/telephony.md, 'Trunks')"
        ),
    ] = None
    sip_outbound_proxy: Annotated[
        Text,
        Cli(SIP, "URI", default_text="none: straight to the callee's host"),
        Field(description="send outbound INVITEs through this proxy, e.g. sip:trunk.example.com"),
    ] = None
    sip_username: Annotated[
        Text,
        Cli(SIP, "USER"),
        Field(description="digest user name answering the trunk's 401/407 challenges"),
    ] = None
    sip_password: Annotated[
        Text,
        Cli(SIP, "SECRET"),
        Field(
            description="digest password for --sip-username (better: VOCABLE_SIP_PASSWORD or "
            "--sip-password-file)",
            repr=False,
        ),
    ] = None
    sip_password_file: Annotated[
        Path | None,
        Cli(SIP, "PATH"),
        Field(description="a file whose first line is the --sip-username password"),
    ] = None
    sip_caller_id: Annotated[
        Text,
        Cli(SIP, "NUMBER", default_text="the playbook id"),
        Field(description="the From user of outbound calls, e.g. +15551230000"),
    ] = None

    sip_register: Annotated[
        Text,
        Cli(SIP, "URI", default_text="none"),
        Field(
            description="register as this PBX extension, e.g. sip:agent@pbx.example.com "
            "(password: --sip-password, VOCABLE_SIP_PASSWORD or --sip-password-file)"
        ),
    ] = None
    sip_register_expires_s: Annotated[
        Whole,
        Cli(SIP, "S"),
        Field(ge=1, le=86400, description="the registration lifetime asked for"),
    ] = 300

    sip_auth: Annotated[
        Text,
        Cli(SIP, "USER", default_text="none: sources outside --sip-allow get no answer"),
        Field(description="answer INVITEs from outside --sip-allow that prove this digest user"),
    ] = None
    sip_auth_password: Annotated[
        Text,
        Cli(SIP, "SECRET"),
        Field(
            description="the --sip-auth user's password (better: VOCABLE_SIP_AUTH_PASSWORD or "
            "--sip-auth-password-file)",
            repr=False,
        ),
    ] = None
    sip_auth_password_file: Annotated[
        Path | None,
        Cli(SIP, "PATH"),
        Field(description="a file whose first line is the --sip-auth password"),
    ] = None
    sip_auth_algorithm: Annotated[
        Literal["MD5", "SHA-256"],
        Cli(SIP, "NAME"),
        Field(description="the digest algorithm --sip-auth challenges with"),
    ] = "MD5"

    sip_dns_server: Annotated[
        Nameserver,
        Cli(SIP, "IP[:PORT]", default_text="the system's resolver"),
        Field(description="the DNS server SIP hosts are looked up in (NAPTR, SRV, then A)"),
    ] = None

    sip_srtp: Annotated[
        Literal["required", "optional", "off"],
        Cli(SIP, "MODE"),
        Field(
            description="SRTP (SDES keys) on inbound calls: required (plain RTP gets 488), "
            "optional (when offered) or off"
        ),
    ] = "optional"

    sip_tls: Annotated[
        Address,
        Cli(SIP, "[HOST:]PORT"),
        Field(description="also take SIP over TLS here (with --sip-tls-cert and --sip-tls-key)"),
    ] = None
    sip_tls_cert: Annotated[
        Path | None,
        Cli(SIP, "PATH"),
        Field(description="the PEM certificate (chain) SIP over TLS shows"),
    ] = None
    sip_tls_key: Annotated[
        Path | None,
        Cli(SIP, "PATH"),
        Field(description="the PEM private key of --sip-tls-cert"),
    ] = None

    # -- transfers of media-stream calls (docs/telephony.md, "Transfers")
    transfer_api_url: Annotated[
        BaseUrl,
        Cli(TRANSFERS, "URL", default_text="none: the stream's transfer event only"),
        Field(description="the provider's REST API base, e.g. https://api.twilio.com"),
    ] = None
    transfer_api_username: Annotated[
        Text,
        Cli(TRANSFERS, "USER", default_text="the stream's accountSid"),
        Field(description="basic-auth user for --transfer-api-url (an account or API key SID)"),
    ] = None
    transfer_api_password: Annotated[
        Text,
        Cli(TRANSFERS, "SECRET"),
        Field(description="basic-auth password for --transfer-api-url", repr=False),
    ] = None

    # -- calls
    playbook: Annotated[
        Path,
        Cli(CALLS, "PATH", default_text="the examples"),
        Field(description="a playbook file or a folder of them"),
    ] = EXAMPLES
    tools_module: Annotated[
        Path | None,
        Cli(CALLS, "PATH"),
        Field(
            description="Python tools module for playbook files that name none (like llmrtc's "
            "JSON playbooks): their tools and hook functions by name"
        ),
    ] = None
    max_sessions: Annotated[
        Whole,
        Cli(CALLS, "N"),
        Field(
            ge=1,
            description="calls this process holds at once, all transports together; more are "
            "refused (HTTP or SIP 503 with Retry-After)",
        ),
    ] = 8
    overload_loop_lag_ms: Annotated[
        Number,
        Cli(CALLS, "MS"),
        Field(
            ge=0,
            description="refuse new calls (503 with Retry-After) while the event loop runs "
            "this late, the median over 2 s; 0: never for this",
        ),
    ] = _OVERLOAD.max_loop_lag_ms
    overload_decode_backlog: Annotated[
        Whole,
        Cli(CALLS, "N"),
        Field(
            ge=0,
            description="refuse new calls while more utterances than this wait for Whisper, "
            "throughout 2 s; 0: never for this",
        ),
    ] = _OVERLOAD.max_decode_backlog
    overload_synthesis_backlog: Annotated[
        Whole,
        Cli(CALLS, "N"),
        Field(
            ge=0,
            description="refuse new calls while more answers than this wait for speech "
            "synthesis to start, throughout 2 s; 0: never for this",
        ),
    ] = _OVERLOAD.max_synthesis_backlog
    overload_cpu_percent: Annotated[
        Number,
        Cli(CALLS, "PERCENT"),
        Field(
            ge=0,
            description="refuse new calls while the process uses more CPU than this share of "
            "its cores over 2 s; 0: never for this",
        ),
    ] = _OVERLOAD.max_cpu_percent
    overload_capacity_cpu_percent: Annotated[
        Number,
        Cli(CALLS, "PERCENT"),
        Field(
            ge=0,
            le=100,
            description="refuse a new call when the live calls, each at its measured CPU cost, "
            "fill this share of the cores (a burst is refused before its load shows); 0: never "
            "for this",
        ),
    ] = _OVERLOAD.capacity_cpu_percent
    idle_timeout_s: Annotated[
        Number,
        Cli(CALLS, "S"),
        Field(
            gt=0,
            description="hang up a call (any transport) after this long without caller speech "
            "or input (keypad, typed text) while the agent is quiet; a playbook's 'idle' "
            "setting (a prompt, then a goodbye) replaces it for its calls",
        ),
    ] = 300.0
    max_call_s: Annotated[
        Number,
        Cli(CALLS, "S"),
        Field(gt=0, description="hang up a call (any transport) this long after it started"),
    ] = 3600.0
    webrtc_media_timeout_s: Annotated[
        Number,
        Cli(CALLS, "S"),
        Field(
            gt=0,
            description="hang up a browser call whose audio has stopped arriving for this long "
            "(a browser closed by force, a network gone); browsers send audio without pause, "
            "silence included",
        ),
    ] = 3.0
    drain_timeout_s: Annotated[
        Number,
        Cli(CALLS, "S"),
        Field(ge=0, description="on SIGTERM, let live calls go on this long before hanging up"),
    ] = 30.0

    # -- replicas
    redis_url: Annotated[
        RedisUrl,
        Cli(REPLICAS, "URL", default_text="none: each server answers for its own calls"),
        Field(
            description="record this server's live calls in Redis, so that GET /calls/ID, its "
            "events and DELETE /sessions/ID answer on any replica sharing it",
            repr=False,
        ),
    ] = None
    internal_url: Annotated[
        BaseUrl,
        Cli(REPLICAS, "URL", default_text="http://HOST:PORT of --host and --port"),
        Field(
            description="how the other replicas reach this one (never shown to clients), e.g. "
            "http://10.0.0.7:8080; needed with --redis-url when --host is 0.0.0.0 or ::"
        ),
    ] = None

    # -- recording
    record: Annotated[
        Path | None,
        Cli(RECORDING, "DIR", default_text="calls are not recorded"),
        Field(
            description="record every call (caller left, agent right) into this directory, "
            "created 0700, files 0600; a playbook's recording: false or a request's "
            "X-Vocable-Record: off header opts a call out"
        ),
    ] = None
    record_notice: Annotated[
        Text,
        Cli(RECORDING, "TEXT"),
        Field(description="said at the start of each recorded call, before the greeting"),
    ] = None
    record_retention_days: Annotated[
        Number,
        Cli(RECORDING, "DAYS"),
        Field(
            ge=0,
            description="delete recordings older than this, at start-up and hourly; 0: keep them",
        ),
    ] = 0.0

    # -- operations
    workers: Annotated[
        Whole,
        Cli(OPERATIONS, "N"),
        Field(ge=1, description="processes sharing the port, each with its own models"),
    ] = 1
    log_format: Annotated[
        Literal["text", "json"],
        Cli(OPERATIONS),
        Field(description="json: one JSON object per line, with the call's session id"),
    ] = "text"
    otel: Annotated[
        Switch,
        Cli(OPERATIONS),
        Field(
            description="export a trace per turn (stage spans) over OTLP/HTTP to "
            "OTEL_EXPORTER_OTLP_ENDPOINT; needs pip install 'vocable[otel]'"
        ),
    ] = False

    # -- LLM (its endpoint flags are server.config.llm's, shared with `vocable chat`)
    llm_retries: Annotated[
        Whole,
        Cli(LLM_GROUP, "N"),
        Field(ge=0, description="retries of a failed LLM call, backoff 1 s, 2 s, 4 s..."),
    ] = RetryPolicy().retries
    llm_timeout_s: Annotated[
        Number,
        Cli(LLM_GROUP, "S"),
        Field(
            gt=0,
            description="longest LLM silence (to the first token, or between chunks) before "
            "the agent apologizes",
        ),
    ] = OrchestratorOptions().llm_timeout_ms / 1000

    # -- speech
    stt_model: Annotated[
        Text,
        Cli(SPEECH, "MODEL", default_text="tiny.en"),
        Field(description="CTranslate2 Whisper folder or size name"),
    ] = TranscriberSettings().model
    stt_threads: Annotated[
        Whole,
        Cli(SPEECH, "N"),
        Field(ge=0, description="CPU threads of each Whisper transcription (0: CTranslate2's)"),
    ] = TranscriberSettings().cpu_threads
    tts_voice: Annotated[
        Text,
        Cli(SPEECH, "VOICE", default_text="en_US-joe-medium"),
        Field(description="Piper .onnx voice"),
    ] = SynthesizerSettings().voice
    tts_threads: Annotated[
        Whole,
        Cli(SPEECH, "N"),
        Field(
            ge=0,
            description="CPU threads of each Piper synthesis (0: one per usable core, "
            "within the CPU quota, and one while other work competes)",
        ),
    ] = SynthesizerSettings().threads
    vad_aggressiveness: Annotated[
        Literal[0, 1, 2, 3],
        Cli(SPEECH),
        ReadWhole,
        Field(description="how readily the VAD calls audio non-speech, 0 (least) to 3 (most)"),
    ] = _VAD.aggressiveness  # type: ignore[assignment]  # an int to mypy, one of the Literal
    end_silence_ms: Annotated[
        Whole,
        Cli(SPEECH, "MS"),
        Field(ge=FRAME_MS, description="silence after which the VAD ends an utterance"),
    ] = _VAD.end_silence_ms
    barge_in_min_ms: Annotated[
        Whole,
        Cli(SPEECH, "MS"),
        Field(ge=0, description="voiced caller speech needed to interrupt the busy agent"),
    ] = _SESSION.barge_in_min_ms
    barge_in: Annotated[
        BargeInPolicy,
        Cli(SPEECH),
        Field(description="policy of stages that set none"),
    ] = _SESSION.barge_in
    no_speculation: Annotated[
        Switch,
        Cli(SPEECH),
        Field(description="transcribe only after the end of the turn, not at each pause"),
    ] = not _ENDPOINT.speculate
    speculation_pause_ms: Annotated[
        Whole,
        Cli(SPEECH, "MS"),
        Field(
            ge=0,
            description="silence inside an utterance at which Whisper starts on the words so "
            "far and the answer is prepared",
        ),
    ] = _VAD.pause_ms
    preempt_lead_ms: Annotated[
        Whole,
        Cli(SPEECH, "MS"),
        Field(
            ge=0,
            lt=_ENDPOINT.complete_silence_ms,  # a lead as long as the end-of-turn silence is none
            description="how long before the end of the turn the answer may start on the words "
            "so far: longer answers sooner and wastes more LLM requests on callers who go on; "
            "0: only at the end of the turn",
        ),
    ] = _ENDPOINT.preempt_lead_ms
    question_lead_ms: Annotated[
        Whole,
        Cli(SPEECH, "MS"),
        Field(
            ge=0,
            lt=_ENDPOINT.complete_silence_ms,
            description="--preempt-lead-ms after a question, until a caller goes on after a "
            "preemptive answer (then --preempt-lead-ms for the rest of the call); never less "
            "than --preempt-lead-ms",
        ),
    ] = _ENDPOINT.question_lead_ms
    quick_pause_ms: Annotated[
        Whole,
        Cli(SPEECH, "MS"),
        Field(
            ge=0,
            description="--speculation-pause-ms while a Whisper worker is idle of other calls' "
            "decodes (0: always --speculation-pause-ms)",
        ),
    ] = _ENDPOINT.quick_pause_ms

    turn_model_file: Annotated[
        Path,
        Cli(
            SPEECH,
            "FILE",
            "--turn-model",
            default_text="the bundled Smart Turn v3.2 (BSD-2-Clause)",
        ),
        Field(
            description="audio end-of-turn model (ONNX, Smart Turn v3 inputs): whether the "
            "caller's voice sounds finished, beside their words"
        ),
    ] = BUNDLED_TURN_MODEL
    no_turn_model: Annotated[
        Switch,
        Cli(SPEECH),
        Field(description="end turns on the words and the silence alone"),
    ] = False
    turn_hold_ms: Annotated[
        Whole,
        Cli(SPEECH, "MS"),
        Field(
            ge=_ENDPOINT.listing_silence_ms,
            le=10_000,
            description="the longest the agent waits for a caller whose words or voice say "
            "they will go on ('a table for ...', a phone number in groups), then answers",
        ),
    ] = _ENDPOINT.hold_ms

    noise_suppression: Annotated[
        Cleanup,
        Cli(SPEECH),
        Field(
            description="suppress steady noise (car, street, fan) in the caller's audio before "
            "the VAD and Whisper: on phone lines, on all lines (browsers suppress their own), "
            "or off"
        ),
    ] = "phone"
    echo_cancellation: Annotated[
        Cleanup,
        Cli(SPEECH),
        Field(
            description="cancel the agent's own voice coming back in the caller's audio "
            "(WebRTC's AEC3, fed with what the agent sent): on phone lines, on all lines "
            "(browsers cancel their own), or off (then a level gate holds back faint echo)"
        ),
    ] = "phone"

    # -- remote speech: each direction is local unless its URL is given
    stt_url: Annotated[
        BaseUrl,
        Cli(REMOTE, "URL", default_text="local Whisper"),
        Field(
            description="transcribe with this server's /audio/transcriptions, e.g. "
            "http://gpu-host:8000/v1"
        ),
    ] = None
    stt_remote_model: Annotated[
        str, Cli(REMOTE, "NAME"), Field(description="model name at --stt-url")
    ] = RemoteTranscriberSettings.model
    tts_url: Annotated[
        BaseUrl,
        Cli(REMOTE, "URL", default_text="local Piper"),
        Field(description="synthesize with this server's /audio/speech"),
    ] = None
    tts_remote_model: Annotated[
        str, Cli(REMOTE, "NAME"), Field(description="model name at --tts-url")
    ] = RemoteSynthesizerSettings.model
    tts_remote_voice: Annotated[
        str, Cli(REMOTE, "NAME"), Field(description="voice name at --tts-url")
    ] = RemoteSynthesizerSettings.voice
    tts_remote_format: Annotated[
        Literal["pcm", "wav"],
        Cli(REMOTE),
        Field(
            description="pcm: raw 24 kHz PCM16 as OpenAI sends it; wav: for servers whose raw "
            "audio has another rate"
        ),
    ] = RemoteSynthesizerSettings.response_format
    inference_api_key: Annotated[
        Text,
        Cli(REMOTE, "KEY", default_text="none, which self-hosted servers accept"),
        Field(description="bearer token for --stt-url and --tts-url", repr=False),
    ] = None

    def session(self) -> SessionSettings:
        """The audio options as per-call session settings."""
        return SessionSettings(
            vad=VadSettings(
                aggressiveness=self.vad_aggressiveness,
                end_silence_ms=self.end_silence_ms,
                pause_ms=self.speculation_pause_ms,
            ),
            barge_in_min_ms=self.barge_in_min_ms,
            barge_in=self.barge_in,
            endpoint=EndpointSettings(
                speculate=not self.no_speculation,
                preempt_lead_ms=self.preempt_lead_ms,
                question_lead_ms=self.question_lead_ms,
                quick_pause_ms=self.quick_pause_ms,
                hold_ms=self.turn_hold_ms,
            ),
        )

    @model_validator(mode="after")
    def _session_accepts(self) -> ServeOptions:
        # the field bounds mirror the session's own checks; this keeps any it adds later a
        # one-line refusal too
        try:
            self.session()
        except ValueError as exc:
            raise ValueError(f"audio settings: {exc}") from None
        return self

    @model_validator(mode="after")
    def _replicas_reach_each_other(self) -> ServeOptions:
        if self.redis_url and not self.internal_url and self.host in ("0.0.0.0", "::", ""):
            raise ValueError(
                "--redis-url needs --internal-url when --host listens on every address: "
                "the other replicas must know which one reaches this server"
            )
        return self


@dataclass(frozen=True)
class Option:
    """A :class:`ServeOptions` field as the command line and the environment give it."""

    name: str
    flag: str
    env: str
    cli: Cli
    field: FieldInfo

    @property
    def switch(self) -> bool:
        """A store_true flag (the variable takes 1/true/yes/on, 0/false/no/off)."""
        return self.field.annotation is bool

    @property
    def choices(self) -> tuple[Any, ...]:
        """The values of a Literal field; empty for the others."""
        annotation = self.field.annotation
        return get_args(annotation) if get_origin(annotation) is Literal else ()

    @property
    def metavar(self) -> str | None:
        if self.choices:
            return "{" + ",".join(str(choice) for choice in self.choices) + "}"
        return self.cli.metavar

    def shown_default(self) -> str | None:
        """The default as --help shows it; None when it goes without saying (off, empty)."""
        default = self.field.default
        if self.cli.default_text is not None:
            return self.cli.default_text
        if self.switch or default is None or default == ():
            return None
        if self.cli.show is not None:
            return self.cli.show(default)
        return f"{default:g}" if isinstance(default, float) else str(default)

    def help(self) -> str:
        """``description [VOCABLE_X; default: D]``."""
        if self.switch:
            where = f"{self.env}=1"
        else:
            where = self.env + (", comma-separated" if self.cli.repeat else "")
            shown = self.shown_default()
            where += f"; default: {shown}" if shown is not None else ""
        text = f"{self.field.description} [{where}]" if self.field.description else f"[{where}]"
        return text.replace("%", "%%")  # argparse formats help with %

    def bounds(self) -> str:
        """A bounded number's range: ``at least 1``, ``0 to 399``, ``a number above 0``..."""
        low: Any = None
        high: Any = None
        above = below = False
        for bound in self.field.metadata:
            if isinstance(bound, Ge):
                low = bound.ge
            elif isinstance(bound, Gt):
                low, above = bound.gt, True
            elif isinstance(bound, Le):
                high = bound.le
            elif isinstance(bound, Lt):
                high, below = bound.lt, True
        if self.field.annotation is int:  # whole numbers: say the closed range
            low, above = (low + 1 if above and low is not None else low), False
            high, below = (high - 1 if below and high is not None else high), False
        kind = "" if self.field.annotation is int else "a number "
        if low is not None and high is not None:
            return f"{low} to {high}"
        if low is not None:
            return f"{kind}above {low}" if above else f"at least {low}"
        return f"{kind}below {high}" if below else f"at most {high}"


def _option(name: str, field: FieldInfo) -> Option:
    [cli] = [item for item in field.metadata if isinstance(item, Cli)]
    flag = cli.flag or "--" + name.replace("_", "-")
    return Option(name, flag, ENV_PREFIX + name.upper(), cli, field)


OPTIONS: tuple[Option, ...] = tuple(
    _option(name, field) for name, field in ServeOptions.model_fields.items()
)
"""Every option, in --help order."""
_BY_NAME = {option.name: option for option in OPTIONS}


def validate_options(raw: Mapping[str, Any]) -> ServeOptions:
    """The options from raw values by field name (flag or variable text, or typed values);
    raises ConfigError with one line naming the flag and variable of each value refused."""
    try:
        return ServeOptions.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("; ".join(_explain(error) for error in exc.errors())) from None


def _explain(error: ErrorDetails) -> str:
    option = _BY_NAME.get(str(error["loc"][0])) if error["loc"] else None
    value, context = error["input"], error.get("ctx", {})
    if error["type"] == "value_error":
        reason = str(context["error"])
    elif error["type"] == "literal_error" and option is not None:
        listed = ", ".join(str(choice) for choice in option.choices)
        reason = f"must be one of {listed}, not {value!r}"
    elif error["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        reason = f"must be {option.bounds() if option else error['msg']}, not {value}"
    else:
        reason = error["msg"]
    return f"{option.flag} / {option.env}: {reason}" if option is not None else reason
