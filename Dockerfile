# kimi-gateway container image. Build from the repository root:
#   docker build -t kimi-gateway .
# For amd64 and arm64 at once (the NVL72's Grace trays are arm64), one multi-arch manifest:
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/kimi-gateway:VERSION --push .
# Nothing here is arch-specific: the base is the official multi-arch Python image, and every
# dependency installs from a wheel (--only-binary, so a missing aarch64 wheel fails the build
# instead of compiling under emulation); deploy/README.md says how the wheels were checked.
# Two stages: `build` installs the gateway into a virtualenv with pip from pyproject.toml and the
# pinned constraints.txt (as scripts/bootstrap, which CI runs, does; without the test and llama.cpp
# extras); `runtime` copies only that virtualenv and the example configs onto a slim Python and
# runs as an unprivileged user.
# uvloop, httptools and hiredis are plain dependencies (manylinux wheels, no compiler needed); the
# build fails if one of them does not import. Linted by hadolint (tests/deploy/test_dockerfile.py).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/kimi-gateway
# constraints.txt pins the versions CI tested (scripts/bootstrap installs with it); the [t] makes
# the COPY work before that file exists, and `touch` then leaves pip an empty constraints file.
COPY pyproject.toml README.md constraints.tx[t] ./
COPY gateway/ gateway/
# A regular (not editable) install: the runtime stage gets no source tree. The tracing extra is
# included so `tracing.otlp_endpoint` works in the image.
RUN touch constraints.txt \
 && /opt/kimi-gateway/bin/python -m pip install --only-binary=:all: -c constraints.txt '.[tracing]' \
 && /opt/kimi-gateway/bin/python -c "import uvloop, httptools, hiredis, gateway.cli"

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kimi-gateway" \
      org.opencontainers.image.description="OpenAI-compatible gateway and router for Kimi K3 pools" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/kimi-gateway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KIMI_GATEWAY_HOST=0.0.0.0 \
    KIMI_GATEWAY_PORT=8000
# A fixed numeric uid/gid so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
RUN groupadd --system --gid 10001 kimi \
 && useradd --system --uid 10001 --gid kimi --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kimi
COPY --from=build /opt/kimi-gateway /opt/kimi-gateway
COPY config/ /etc/kimi-gateway/
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
# /health answers 200 while the process lives (it does not depend on the engines: /ready does).
# No curl in a slim image: the venv's Python makes the call; KIMI_GATEWAY_PORT follows the port.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KIMI_GATEWAY_PORT', '8000'), timeout=2)"]
# SIGTERM starts the graceful drain (gateway/serving/lifecycle.py): /ready turns 503, in-flight streams finish.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kimi-gateway"]
CMD ["serve", "-c", "/etc/kimi-gateway/k3-production.yaml"]
