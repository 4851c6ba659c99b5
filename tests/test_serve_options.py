"""``vocable serve``'s options: one model checks flags and ``VOCABLE_*`` variables alike, and
holds each default once (``vocable chat`` reads those it shares). Fast: no server starts (the two
subprocesses stop at the check)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import fields, replace
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest

from playbooks import OrchestratorOptions, RetryPolicy
from server.call.recordings import RecordingSettings
from server.commands.chat import CHAT_TURN_FLAGS, add_chat_arguments
from server.config.llm import ConfigError
from server.config.option_values import parse_port_range
from server.config.serve_flags import add_serve_arguments, parse_serve_options
from server.config.serve_options import OPTIONS, ServeOptions
from server.config.server import (
    BUILT_ALIKE,
    OPTION_FIELDS,
    IceServer,
    LocalLLMSettings,
    ServerConfig,
    SipSettings,
)
from server.config.sip_trunks import Secret
from tests.conftest import REPO

BY_NAME = {option.name: option for option in OPTIONS}


def refusal(argv: list[str], env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as refused:
        parse_serve_options(argv, env)
    return str(refused.value)


# -- the same refusal from a flag and from its variable ------------------------------------------


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("max_sessions", "0", "must be at least 1, not 0"),  # int with a bound
        ("port", "eighty", "'eighty' is not a whole number"),
        ("port", "70000", "must be 0 to 65535, not 70000"),
        ("preempt_lead_ms", "400", "must be 0 to 399, not 400"),
        ("question_lead_ms", "-5", "must be 0 to 399, not -5"),
        ("idle_timeout_s", "-1", "must be a number above 0, not -1"),  # float with a bound
        ("max_call_s", "nan", "must be a number above 0, not nan"),
        ("rate_limit", "lots", "'lots' is not a number"),
        (
            "barge_in",  # a choice
            "Immediate",
            "must be one of immediate, confirmed, pause_resume, disabled, not 'Immediate'",
        ),
        ("vad_aggressiveness", "7", "must be one of 0, 1, 2, 3, not 7"),
        ("log_format", "xml", "must be one of text, json, not 'xml'"),
        ("ice_servers", "http://stun.example.org", "'http://stun.example.org' is not a stun:"),
        ("sip", "x:y", "'x:y' is not HOST:PORT"),  # an address
        ("audiosocket", "host:99999", "'host:99999': port out of range"),
        ("rtp_ports", "99-5", "'99-5': need 1024 <= LOW < HIGH <= 65535"),  # a port range
        ("rtp_ports", "10000", "'10000' is not LOW-HIGH"),
        ("trusted_proxies", "10.0.0.0/33", "'10.0.0.0/33' does not appear to be an IPv4"),
        ("sip_allow", "example.org", "'example.org' does not appear to be an IPv4"),
        ("stt_url", "gpu-host:8000", "must be an http:// or https:// base URL"),  # a URL
        ("record_retention_days", "-1", "must be at least 0, not -1"),
        ("turn_hold_ms", "900", "must be 1500 to 10000, not 900"),
    ],
)
def test_a_bad_value_is_refused_alike_from_flag_and_variable(
    name: str, bad: str, message: str
) -> None:
    option = BY_NAME[name]
    from_flag = refusal([option.flag, bad], {})
    from_env = refusal([], {option.env: bad})
    assert from_flag == from_env
    assert from_flag.startswith(f"{option.flag} / {option.env}: {message}"), from_flag
    assert "\n" not in from_flag


def test_a_switch_variable_takes_yes_and_no_words_and_refuses_others() -> None:
    for word in ("1", "true", "yes", "on", "TRUE", "On"):
        assert parse_serve_options([], {"VOCABLE_OTEL": word})[0].otel is True
        assert parse_serve_options([], {"VOCABLE_NO_SPECULATION": word})[0].no_speculation
    for word in ("0", "false", "no", "off", "", "Off"):
        assert parse_serve_options([], {"VOCABLE_OTEL": word})[0].otel is False
    assert refusal([], {"VOCABLE_OTEL": "maybe"}) == (
        "--otel / VOCABLE_OTEL: must be 1, true, yes, on or 0, false, no, off, not 'maybe'"
    )
    assert parse_serve_options(["--otel"], {"VOCABLE_OTEL": "0"})[0].otel is True


def test_every_bad_value_is_named_on_one_line() -> None:
    message = refusal(["--workers", "0"], {"VOCABLE_LOG_FORMAT": "xml"})
    assert message == (
        "--workers / VOCABLE_WORKERS: must be at least 1, not 0; "
        "--log-format / VOCABLE_LOG_FORMAT: must be one of text, json, not 'xml'"
    )


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (
            [],
            {"VOCABLE_BARGE_IN": "Immediate"},
            "vocable: --barge-in / VOCABLE_BARGE_IN: must be one of immediate, confirmed, "
            "pause_resume, disabled, not 'Immediate'",
        ),
        (
            ["--vad-aggressiveness", "7"],
            {},
            "vocable: --vad-aggressiveness / VOCABLE_VAD_AGGRESSIVENESS: must be one of 0, 1, 2, "
            "3, not 7",
        ),
        (  # checked before any model loads
            ["--turn-model", "/nonexistent/turn.onnx", "--llm", "none"],
            {},
            "vocable: turn model /nonexistent/turn.onnx: no such file",
        ),
        (
            ["--sip", "5060", "--sip-trunks", "/nonexistent/trunks.yaml", "--llm", "none"],
            {},
            "vocable: --sip-trunks: cannot read /nonexistent/trunks.yaml: FileNotFoundError",
        ),
    ],
)
def test_vocable_serve_refuses_in_one_line_with_status_2(
    argv: list[str], env: dict[str, str], line: str
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VOCABLE_", "OPENAI_"))}
    done = subprocess.run(
        [sys.executable, "-m", "server", "serve", *argv],
        env={**clean, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [line]
    assert done.stdout == ""


# -- merging -------------------------------------------------------------------------------------


def test_a_flag_overrides_the_variable() -> None:
    env = {"VOCABLE_PORT": "9090", "VOCABLE_BARGE_IN": "disabled", "VOCABLE_RATE_LIMIT": "5"}
    options, _ = parse_serve_options(["--port", "7000", "--barge-in", "immediate"], env)
    assert (options.port, options.barge_in, options.rate_limit) == (7000, "immediate", 5.0)
    # a bad variable under a good flag is never used, so never refused
    assert parse_serve_options(["--port", "7000"], {"VOCABLE_PORT": "x"})[0].port == 7000


def test_repeated_flags_add_to_the_comma_separated_variable() -> None:
    options, _ = parse_serve_options(
        ["--cors-origin", "https://c.example"],
        {"VOCABLE_CORS_ORIGINS": "https://a.example, ,https://b.example"},
    )
    assert options.cors_origins == ("https://a.example", "https://b.example", "https://c.example")


def test_valid_values_are_accepted_from_the_environment() -> None:
    options, args = parse_serve_options(
        [],
        {
            "VOCABLE_BARGE_IN": "immediate",
            "VOCABLE_SIP": "[::1]:5080",
            "VOCABLE_AUDIOSOCKET": "9092",
            "VOCABLE_RTP_PORTS": "20000-20099",
            "VOCABLE_STT_URL": "http://gpu:8000/v1/",
            "VOCABLE_MAX_CALL_S": "inf",
            "VOCABLE_AUTH_TOKEN": "",  # empty: unset
        },
    )
    config = ServerConfig.from_args(args, env={})
    assert config.session.barge_in == "immediate"
    assert config.sip == SipSettings(host="::1", port=5080, rtp_ports=(20000, 20100))
    assert config.audiosocket == ("127.0.0.1", 9092)
    assert config.remote_stt is not None
    assert config.remote_stt.base_url == "http://gpu:8000/v1"
    assert config.max_call_s == float("inf")
    assert config.auth_token is None
    assert options.session() == config.session


def test_recording_options_make_the_recording_settings(tmp_path: Path) -> None:
    assert ServerConfig.from_options(ServeOptions()).recording is None
    _, args = parse_serve_options(
        ["--record", str(tmp_path), "--record-retention-days", "30"],
        {"VOCABLE_RECORD_NOTICE": "This call is recorded."},
    )
    assert ServerConfig.from_args(args, env={}).recording == RecordingSettings(
        tmp_path, notice="This call is recorded.", retention_days=30.0
    )


def test_secrets_stay_out_of_the_repr() -> None:
    options, args = parse_serve_options(
        [
            *("--auth-token", "tok-1", "--turn-credential", "cred-2", "--ice-server", "turn:t"),
            *("--inference-api-key", "key-3", "--sip", "5060", "--sip-username", "trunk"),
            *("--sip-auth", "pbx", "--sip-register", "sip:agent@pbx.example"),
        ],
        {"VOCABLE_SIP_PASSWORD": "pass-4", "VOCABLE_SIP_AUTH_PASSWORD": "pass-5"},
    )
    assert options.auth_token == "tok-1"
    config = ServerConfig.from_args(args, env={})
    assert config.sip is not None
    assert config.sip.trunks["default"].password == Secret("pass-4")
    assert config.sip.auth is not None
    assert config.sip.auth.password.reveal() == "pass-5"
    for secret in ("tok-1", "cred-2", "key-3", "pass-4", "pass-5"):
        assert secret not in repr(options)
        assert secret not in repr(config)
        assert secret not in str(config.sip.trunks)


@pytest.mark.parametrize(
    ("argv", "trunks", "line"),
    [
        (["--sip-trunks", "{trunks}"], "trunks: {pbx: {proxy: pbx, passwrd: x}}", (
            "--sip-trunks: {trunks}: trunks.pbx.passwrd: Extra inputs are not permitted"
        )),
        (["--sip-trunks", "{trunks}"], "trunks: {pbx: {proxy: pbx, username: u}}", (
            "--sip-trunks: {trunks}: trunks.pbx: Value error, a username needs a password "
            "(password, password_env or _file)"
        )),
        (["--sip-trunks", "{trunks}"], "trunks: {pbx: {username: u, password_env: NO_SUCH}}", (
            "trunk 'pbx': the environment variable NO_SUCH is not set"
        )),
        (["--sip-trunks", "{trunks}"], "trunks: [", "--sip-trunks: {trunks} is not YAML: "),
        (["--sip-username", "u"], None, (
            "trunk 'default': give the password once, as one of --sip-password, "
            "VOCABLE_SIP_PASSWORD or --sip-password-file"
        )),
        (["--sip-username", "u", "--sip-password-file", "/nonexistent/pw"], None, (
            "trunk 'default': cannot read /nonexistent/pw: FileNotFoundError"
        )),
        (["--sip-outbound-proxy", "sip:pbx:99999"], None, (
            "trunk 'default': proxy: port 99999 is out of range"
        )),
        (["--sip-register", "agent@pbx"], None, (
            "--sip-register: 'agent@pbx' is not a sip:user@registrar URI"
        )),
        (["--sip-register", "sip:agent@pbx;transport=tls", "--sip-username", "a",
          "--sip-password", "pw"], None, (
            "--sip-register over TLS (transport=tls) needs --sip-tls"
        )),
        (["--sip-auth", "pbx"], None, (
            "--sip-auth: give the password once, as one of --sip-auth-password, "
            "VOCABLE_SIP_AUTH_PASSWORD or --sip-auth-password-file"
        )),
    ],
)  # fmt: skip
def test_sip_settings_that_cannot_be_used_are_refused_in_one_line(
    tmp_path: Path, argv: list[str], trunks: str | None, line: str
) -> None:
    path = tmp_path / "trunks.yaml"
    if trunks is not None:
        path.write_text(trunks)
    argv = [arg.replace("{trunks}", str(path)) for arg in argv]
    _, args = parse_serve_options(["--sip", "5060", *argv], {})
    with pytest.raises(ConfigError) as refused:
        ServerConfig.from_args(args, env={})
    assert str(refused.value).startswith(line.replace("{trunks}", str(path)))
    assert "\n" not in str(refused.value)


# -- one default each ----------------------------------------------------------------------------


def test_the_config_defaults_are_the_options_defaults() -> None:
    """ServerConfig's defaults and those of the options it is built from cannot disagree."""
    assert ServerConfig.from_options(ServeOptions()) == ServerConfig()
    options, args = parse_serve_options([], {})
    assert options == ServeOptions()
    # the command, given no LLM, finds or runs one (--llm auto); a config built in code has none
    auto = ServerConfig.from_args(args, env={})
    assert auto.local_llm == LocalLLMSettings(gguf=None, search=True)
    assert replace(auto, local_llm=None) == ServerConfig()
    sip = ServerConfig.from_options(ServeOptions(sip=("127.0.0.1", 5060))).sip
    assert sip == SipSettings(port=5060)


# The config fields that are options, found here apart from the code's own table: those named
# like an option, and the one named otherwise.
SHARED = {f.name: f.name for f in fields(ServerConfig) if f.name in ServeOptions.model_fields}
SHARED |= {"rate_limit_per_min": "rate_limit"}

NON_DEFAULT: dict[str, Any] = {  # by option: a value other than its default
    "host": "0.0.0.0",
    "port": 9000,
    "playbook": Path("elsewhere.yaml"),
    "tools_module": Path("tools.py"),
    "llm_retries": 0,
    "llm_timeout_s": 2.5,
    "ice_servers": ("stun:stun.example.org:3478",),
    "max_sessions": 3,
    "auth_token": "tok",
    "cors_origins": ("https://a.example",),
    "idle_timeout_s": 60.0,
    "max_call_s": 600.0,
    "webrtc_media_timeout_s": 10.0,
    "audiosocket": ("0.0.0.0", 9092),
    "sip": ("0.0.0.0", 5080),
    "rate_limit": 5.0,
    "rate_limit_burst": 2,
    "trusted_proxies": (ip_network("10.0.0.0/8"),),
    "drain_timeout_s": 5.0,
    "workers": 2,
    "log_format": "json",
    "otel": True,
    "redis_url": "redis://127.0.0.1:6380/0",
    "internal_url": "http://10.0.0.7:8080",
    "noise_suppression": "all",
    "echo_cancellation": "off",
}


def test_the_config_fields_that_are_options_default_alike() -> None:
    defaults = ServeOptions()
    config = ServerConfig()
    assert {"port", "max_sessions", "workers", "playbook", "rate_limit_per_min"} <= set(SHARED)
    for name, option in SHARED.items():
        assert getattr(config, name) == getattr(defaults, option), name


def test_every_option_a_config_field_stands_for_is_carried_through() -> None:
    """A field added to both ServeOptions and ServerConfig, but left out of the derivation (or
    built from the wrong option), fails here: each non-default option changes its field."""
    assert set(NON_DEFAULT) == set(SHARED.values()), "give each shared option a NON_DEFAULT value"
    defaults = ServeOptions()
    options = ServeOptions(**NON_DEFAULT)
    config = ServerConfig.from_options(options)
    for name, option in SHARED.items():
        assert getattr(options, option) != getattr(defaults, option), option  # a real change
        assert getattr(config, name) != getattr(ServerConfig(), name), name
        if name not in BUILT_ALIKE:  # taken as it is
            assert getattr(config, name) == getattr(options, option), name
    assert {name: o for name, o in SHARED.items() if name not in BUILT_ALIKE} == OPTION_FIELDS
    assert config.ice_servers == (IceServer("stun:stun.example.org:3478"),)
    assert config.sip == SipSettings(host="0.0.0.0", port=5080)


def test_chat_defaults_are_those_of_serve_and_the_library() -> None:
    parser = argparse.ArgumentParser(prog="vocable chat", formatter_class=_OneLineHelp)
    add_chat_arguments(parser)
    args = parser.parse_args(["support.yaml"])
    serve, _ = parse_serve_options([], {})
    assert args.llm_retries == serve.llm_retries == RetryPolicy().retries
    library = OrchestratorOptions()
    assert set(CHAT_TURN_FLAGS) == {"history_limit", "max_tool_calls_per_turn", "phase1_timeout_ms"}
    for name in CHAT_TURN_FLAGS:
        assert getattr(args, name) == getattr(library, name), name
    # each flag sets its field of the orchestrator's options, and --help says its default
    given = parser.parse_args(["support.yaml", "--max-tool-calls", "3", "--history-limit", "7"])
    assert (given.max_tool_calls_per_turn, given.history_limit) == (3, 7)
    text = parser.format_help()
    flags = {flag: getattr(library, name) for name, (flag, _) in CHAT_TURN_FLAGS.items()}
    for flag, value in (flags | {"--llm-retries": serve.llm_retries}).items():
        [line] = [line for line in text.splitlines() if line.strip().startswith(flag + " ")]
        assert line.endswith(f"(default {value})"), line


class _OneLineHelp(argparse.HelpFormatter):
    """Each option and its help on one line, for reading the help back."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=10_000, width=10_000)


def test_the_defaults_in_help_are_the_model_defaults() -> None:
    parser = argparse.ArgumentParser(prog="vocable serve", formatter_class=_OneLineHelp)
    add_serve_arguments(parser, env={"VOCABLE_PORT": "9090"})  # the variable is no default
    text = parser.format_help()
    defaults = ServeOptions()
    for option in OPTIONS:
        [line] = [line for line in text.splitlines() if line.strip().startswith(option.flag + " ")]
        assert f"[{option.env}" in line, line
        value = getattr(defaults, option.name)
        shown = re.search(r"; default: ([^\]]+)\]$", line)
        if option.cli.default_text is not None:  # a description, for a value that says too little
            assert shown is not None
            assert shown[1] == option.cli.default_text
            assert value in (None, ()) or option.name in ("playbook", "turn_model_file")
        elif shown is None:  # nothing to say: off, or empty
            assert value in (None, (), False), option.name
        elif option.name == "rtp_ports":
            assert parse_port_range(shown[1]) == value
        elif isinstance(value, float):
            assert float(shown[1]) == value, option.name
        else:
            assert shown[1] == str(value), option.name
    assert "[VOCABLE_PORT; default: 8080]" in text


def test_every_option_has_its_flag_and_variable() -> None:
    flags = [option.flag for option in OPTIONS]
    assert len(set(flags)) == len(flags)
    for option in OPTIONS:
        assert option.env == "VOCABLE_" + option.name.upper()
    assert {BY_NAME[name].flag for name in ("ice_servers", "cors_origins", "trusted_proxies")} == {
        "--ice-server",
        "--cors-origin",
        "--trusted-proxy",
    }
