"""The deployment files agree with the code: the Dockerfile, the Kubernetes manifest, the coturn
example and docs/deployment.md. Fast: no models, no network, no Docker."""

from __future__ import annotations

import argparse
import fnmatch
import http.server
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from server.config.llm import ENV_NAMES as LLM_ENV_NAMES
from server.config.serve_options import OPTIONS
from server.config.server import ServerConfig, add_serve_arguments
from server.http.app import create_app
from tests.conftest import REPO

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
MANIFEST = REPO / "deploy" / "kubernetes" / "vocable.yaml"
COTURN = REPO / "deploy" / "coturn" / "turnserver.conf"
DEPLOYMENT_DOC = REPO / "docs" / "deployment.md"

SHUTDOWN_MARGIN_S = 5
"""After the drain: closing the HTTP runner (aiohttp's shutdown timeout) and the models."""


# -- readers -------------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    out = []
    for line in lines:
        instruction, _, rest = line.partition(" ")
        out.append((instruction.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile()
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    return instructions[last_from:]


def image_command() -> list[str]:
    [cmd] = [json.loads(rest) for name, rest in final_stage() if name == "CMD"]
    assert isinstance(cmd, list)
    return [str(part) for part in cmd]


def manifest() -> dict[str, dict[str, Any]]:
    """The manifest's objects by kind."""
    documents = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    return {doc["kind"]: doc for doc in documents}


def container() -> dict[str, Any]:
    [vocable] = manifest()["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert isinstance(vocable, dict)
    return vocable


def manifest_env() -> dict[str, str]:
    """The container's environment; a secret's value is a stand-in naming its key."""
    env: dict[str, str] = {}
    for item in container()["env"]:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            env[item["name"]] = "secret-" + item["valueFrom"]["secretKeyRef"]["key"]
    return env


def coturn_settings() -> dict[str, list[str]]:
    """Active ``key=value`` (or bare flag) lines of the coturn example."""
    settings: dict[str, list[str]] = {}
    for raw in COTURN.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key, []).append(value)
    return settings


def env_names_read() -> set[str]:
    """The ``VOCABLE_*`` variables the server reads: one per ``vocable serve`` option (the model
    the parser is built from), and the LLM endpoint's."""
    serve = {option.env for option in OPTIONS}
    llm = {name for names in LLM_ENV_NAMES.values() for name in names}
    return {name for name in serve | llm if name.startswith("VOCABLE_")}


def serve_parser(env: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vocable serve")
    add_serve_arguments(parser, env)
    return parser


def config_from(env: dict[str, str]) -> ServerConfig:
    """What ``vocable serve`` would run with: the image's CMD and this environment."""
    command = image_command()
    assert command[:2] == ["vocable", "serve"]
    args = serve_parser(env).parse_args(command[2:])
    return ServerConfig.from_args(args, env)


def get_routes() -> set[str]:
    app = create_app(ServerConfig())  # routes only: models load on startup, which never runs
    return {
        route.resource.canonical
        for route in app.router.routes()
        if route.method == "GET" and route.resource is not None
    }


# -- the Kubernetes manifest ----------------------------------------------------------------------


def test_the_manifest_holds_a_deployment_and_its_service() -> None:
    objects = manifest()
    assert {"Deployment", "Service"} <= objects.keys()
    labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert objects["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert objects["Service"]["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_probes_ask_a_route_of_the_app(probe: str) -> None:
    check = container()[probe]["httpGet"]
    assert check["path"] == "/healthz"
    assert check["path"] in get_routes()
    assert check["port"] in {port["name"] for port in container()["ports"]}


def test_ports_agree_across_manifest_dockerfile_and_config() -> None:
    [http] = container()["ports"]
    exposed = [rest for name, rest in final_stage() if name == "EXPOSE"]
    assert exposed == [str(http["containerPort"])]
    assert ServerConfig().port == http["containerPort"]
    assert serve_parser({}).parse_args([]).port == http["containerPort"]
    [service_port] = manifest()["Service"]["spec"]["ports"]
    assert service_port["targetPort"] == http["name"]
    annotations = manifest()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(http["containerPort"])
    assert annotations["prometheus.io/path"] in get_routes()


def test_the_manifest_sets_only_variables_the_server_reads() -> None:
    read = env_names_read()
    assert {"VOCABLE_PORT", "VOCABLE_LLM_API_KEY", "VOCABLE_DRAIN_TIMEOUT_S"} <= read  # sanity
    unknown = set(manifest_env()) - read
    assert not unknown, (
        f"not read by server/config/server.py or server/config/llm.py: {sorted(unknown)}"
    )


def test_secrets_come_from_a_secret() -> None:
    by_name = {item["name"]: item for item in container()["env"]}
    for name in ("VOCABLE_LLM_API_KEY", "VOCABLE_AUTH_TOKEN", "VOCABLE_TURN_CREDENTIAL"):
        assert "secretKeyRef" in by_name[name]["valueFrom"], name


def test_the_manifest_environment_is_a_valid_configuration() -> None:
    env = manifest_env()
    config = config_from(env)
    assert config.host == "0.0.0.0"
    assert config.port == container()["ports"][0]["containerPort"]
    assert config.auth_token == "secret-auth-token"
    assert config.llm is not None
    assert config.llm.api_key == "secret-llm-api-key"
    assert config.trusted_proxies
    assert config.log_format == "json"
    turn = [server for server in config.ice_servers if server.urls.startswith("turn")]
    assert turn
    assert all(server.credential == "secret-turn-credential" for server in turn)


def test_the_grace_period_outlasts_the_pre_stop_pause_and_the_drain() -> None:
    spec = manifest()["Deployment"]["spec"]["template"]["spec"]
    pre_stop = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = config_from(manifest_env()).drain_timeout_s
    assert drain >= ServerConfig().drain_timeout_s
    needed = float(pre_stop[1]) + drain + SHUTDOWN_MARGIN_S
    assert spec["terminationGracePeriodSeconds"] >= needed


def test_the_pod_runs_as_the_images_unprivileged_user() -> None:
    pod_security = manifest()["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    [user] = [rest for name, rest in final_stage() if name == "USER"]
    assert pod_security["runAsNonRoot"] is True
    assert str(pod_security["runAsUser"]) == user.split(":")[0]
    # A read-only root needs writable /tmp (control sockets, ONNX Runtime) and home (its cache).
    if container()["securityContext"].get("readOnlyRootFilesystem"):
        mounted = {mount["mountPath"] for mount in container()["volumeMounts"]}
        assert {"/tmp", "/home/vocable"} <= mounted


# -- the Dockerfile ------------------------------------------------------------------------------


def test_the_dockerfile_builds_in_stages_and_runs_unprivileged() -> None:
    instructions = dockerfile()
    assert sum(name == "FROM" for name, _ in instructions) >= 2
    final = final_stage()
    assert any(name == "COPY" and rest.startswith("--from=") for name, rest in final)
    [user] = [rest for name, rest in final if name == "USER"]
    assert user.split(":")[0] not in {"root", "0"}
    assert ("STOPSIGNAL", "SIGTERM") in final
    assert any(name == "RUN" and "libgomp1" in rest for name, rest in final)
    assert image_command()[:2] == ["vocable", "serve"]
    assert "--host" in image_command()


def healthcheck_command() -> list[str]:
    [check] = [rest for name, rest in final_stage() if name == "HEALTHCHECK"]
    options, _, command = check.partition("CMD")
    assert "--start-period" in options
    parsed = json.loads(command)
    assert isinstance(parsed, list)
    return [str(part) for part in parsed]


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_healthcheck_asks_healthz_on_the_configured_port(
    health_server: http.server.HTTPServer,
) -> None:
    command = healthcheck_command()
    assert command[0] == "python"  # the image's venv Python; curl is not in slim images
    assert "/healthz" in " ".join(command)
    env = {**os.environ, "VOCABLE_PORT": str(health_server.server_address[1])}

    def check() -> int:
        return subprocess.run(
            [sys.executable, *command[1:]], env=env, capture_output=True, timeout=30
        ).returncode

    _Health.status = 200
    assert check() == 0
    _Health.status = 503  # draining
    assert check() != 0


def test_the_build_context_keeps_what_the_image_copies() -> None:
    ignored = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".venv", ".git", "tests", "benchmarks/results"} <= set(ignored)
    copied = [
        source
        for name, rest in dockerfile()
        if name == "COPY" and not rest.startswith("--from=")
        for source in shlex.split(rest)[:-1]
    ]
    assert "server" in copied
    for source in copied:
        assert (REPO / source).exists(), source
        hits = [pattern for pattern in ignored if fnmatch.fnmatch(source, pattern)]
        assert not hits, f"{source} is copied but .dockerignore drops it ({hits})"


def test_stop_timeouts_in_the_docs_outlast_the_drain() -> None:
    drain = ServerConfig().drain_timeout_s
    for path in (DOCKERFILE, DEPLOYMENT_DOC):
        timeouts = re.findall(r"--stop-timeout (\d+)", path.read_text())
        assert timeouts, path
        assert all(int(t) >= drain + SHUTDOWN_MARGIN_S for t in timeouts), path


# -- coturn and the deployment guide --------------------------------------------------------------


def test_the_coturn_example_has_one_credential_mechanism() -> None:
    settings = coturn_settings()
    assert ("lt-cred-mech" in settings) != ("use-auth-secret" in settings)
    if "lt-cred-mech" in settings:
        assert settings["user"]
        assert all(":" in user for user in settings["user"])
    assert settings["realm"]


def test_the_coturn_ports_are_documented() -> None:
    settings = coturn_settings()
    listening = settings.get("listening-port", ["3478"])[0]
    relay = f"{settings['min-port'][0]}-{settings['max-port'][0]}"
    tls = re.search(r"^#?tls-listening-port=(\d+)", COTURN.read_text(), re.MULTILINE)
    assert tls is not None
    doc = DEPLOYMENT_DOC.read_text()
    for port in (listening, relay, tls.group(1)):
        assert port in doc, port


def test_the_manifest_points_at_the_coturn_port() -> None:
    listening = coturn_settings().get("listening-port", ["3478"])[0]
    urls = manifest_env()["VOCABLE_ICE_SERVERS"].split(",")
    assert any(url.startswith("turn:") for url in urls)
    for url in urls:
        host_port = url.split(":", 1)[1].split("?")[0]
        assert host_port.endswith(f":{listening}"), url


def test_the_documented_variables_and_flags_exist() -> None:
    texts = {path: path.read_text() for path in (DEPLOYMENT_DOC, COTURN, MANIFEST, DOCKERFILE)}
    read = env_names_read()
    for path, text in texts.items():
        unknown = set(re.findall(r"\bVOCABLE_[A-Z0-9_]+", text)) - read
        assert not unknown, f"{path.name}: {sorted(unknown)}"
    flags = {
        option
        for action in serve_parser({})._actions
        for option in action.option_strings
        if option.startswith("--")
    }
    # Flags of other tools the guide shows (docker, kubectl, the benchmark harness).
    foreign = {
        "--build-arg",
        "--cpu-percent",
        "--env-file",
        "--from-literal",
        "--from-file",
        "--init",
        "--max",
        "--min",
        "--name",
        "--network",
        "--read-only",
        "--stop-timeout",
        "--tmpfs",
        "--url",
        "--no-cache-dir",
    }
    for path in (DEPLOYMENT_DOC, COTURN):
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", texts[path]))
        unknown = named - flags - foreign
        assert not unknown, f"{path.name}: {sorted(unknown)}"
