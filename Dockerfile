# Vocable: real-time voice agent server. CPU-only; models ship inside Python packages.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app

# Wheels exist for every dependency; these libraries are what the wheels expect at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md LICENSE ./
COPY server ./server
COPY media ./media
COPY playbooks ./playbooks
COPY web-client ./web-client
RUN pip install .

RUN useradd --create-home --uid 10001 vocable
USER vocable

EXPOSE 8080
# Configure the LLM with VOCABLE_LLM_BASE_URL, VOCABLE_LLM_MODEL and VOCABLE_LLM_API_KEY.
CMD ["vocable", "serve", "--host", "0.0.0.0"]
