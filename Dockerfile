# Vocable: real-time voice agent server. CPU-only; models ship inside Python packages.
#
#   docker build -t vocable .
#   docker run --rm --init --network host --stop-timeout 45 \
#     -e VOCABLE_LLM_BASE_URL=http://127.0.0.1:11434/v1 -e VOCABLE_LLM_MODEL=llama3.1 vocable
#
# Build arguments: PYTHON_VERSION (3.11 or newer, major.minor) and EXTRAS ("[otel]" for OTLP
# traces). Networking, TURN, load balancers and Kubernetes: docs/deployment.md.

ARG PYTHON_VERSION=3.11

# -- builder: a virtual environment with Vocable and its dependencies --------------------------
FROM python:${PYTHON_VERSION}-slim AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/vocable
ENV PATH=/opt/vocable/bin:$PATH

WORKDIR /src

# Dependencies first, from pyproject.toml alone, so a source change does not reinstall them.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

ARG EXTRAS=""
COPY README.md LICENSE ./
COPY server ./server
COPY media ./media
COPY playbooks ./playbooks
COPY web-client ./web-client
RUN pip install ".${EXTRAS}"

# -- runtime: the environment (web client and examples are package data), no build tools ----
FROM python:${PYTHON_VERSION}-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/vocable/bin:$PATH

# Every dependency comes as a wheel; CTranslate2 (Whisper) needs OpenMP at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

COPY --from=builder /opt/vocable /opt/vocable

RUN groupadd --gid 10001 vocable \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin vocable
USER 10001:10001
WORKDIR /home/vocable

# HTTP: the web client, signalling (/offer), /healthz, /metrics, /twilio/media.
EXPOSE 8080
# Not exposed by default, published only when enabled:
#   SIP (--sip 0.0.0.0:5060)            5060/udp and 5060/tcp
#   SIP call audio (--rtp-ports)        10000-19999/udp
#   Asterisk AudioSocket (--audiosocket) a TCP port of your choice, private networks only
# WebRTC media uses ephemeral UDP ports that cannot be published one by one: run with host
# networking or relay calls through TURN (docs/deployment.md).

# The port opens once the models are loaded (seconds; longer from a cold disk): failures in the
# start period do not count. /healthz answers 503 while the server drains.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('VOCABLE_PORT', '8080'), timeout=4)"]

# SIGTERM drains: no new calls, live ones go on for --drain-timeout-s (default 30 s), then the
# process exits. Give the container longer than that to stop (docker run --stop-timeout 45).
STOPSIGNAL SIGTERM
# The LLM: VOCABLE_LLM_BASE_URL, VOCABLE_LLM_MODEL, VOCABLE_LLM_API_KEY for an endpoint; else a
# model in process: VOCABLE_LLM_GGUF (a mounted GGUF file), or the default model, downloaded into
# HF_HOME (mount a volume there so it is fetched once); VOCABLE_LLM=none for none. Every flag has
# a VOCABLE_* variable (vocable serve --help).
CMD ["vocable", "serve", "--host", "0.0.0.0"]
