"""The real coding agents, from the npm registry, run non-interactively through the gateway to a
simulated vLLM or SGLang worker that follows a script (`POST /sim/script`, gateway.sim.script): the model asks
for one shell command, the agent runs it and sends its output back, the model answers with text.

- Claude Code (`claude -p`, Anthropic Messages API on `/v1/messages?beta=true`; it sends a `system`
  turn mid-conversation), its `Bash` tool;
- Codex CLI (`codex exec`, a custom model provider on the Responses API), its `exec_command` tool.

Each asserts what the agent printed, that the command really ran (the file it wrote) and what the
worker received back (the `tool_result` / `function_call_output` with the command's output).

The agents are installed by `scripts/install-agents` (versions pinned in tests/agents/package.json)
into `.agents/` (or `$KIMI_AGENTS_PREFIX`); `.ci/run` runs it, `scripts/bootstrap` does not. Without
them these tests are skipped, except under CI (`CI` set), where that is a failure. The agents reach
nothing but the gateway on loopback: their update checks, telemetry and other traffic are off by
their environment variables and flags below, and each run is bounded by a subprocess timeout.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import REPO_ROOT, RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

AGENT_TIMEOUT = 90  # seconds for one agent run (a few seconds normally; the first start reads its binary)
COMMAND = "echo kimi-tool-ran-$((6*7)) | tee marker.txt"  # the shell computes 42: proof it ran
MARKER = "kimi-tool-ran-42"
FINAL = "The command printed the marker."


def agent(name: str) -> str:
    """The installed agent's executable; skips the test when it is missing (fails under CI)."""
    prefix = Path(os.environ.get("KIMI_AGENTS_PREFIX") or REPO_ROOT / ".agents")
    path = prefix / "node_modules" / ".bin" / name
    if not path.exists():
        message = f"{name} is not installed in {prefix}: run scripts/install-agents"
        if os.environ.get("CI"):
            pytest.fail(message + " (.ci/run must install it)")
        pytest.skip(message)
    return str(path)


_ADDRESS = re.compile(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"')


def run_agent(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run an agent to completion with no standard input and only `env` (plus PATH), under
    `strace` (its socket calls), then assert it addressed nothing but loopback: no update check,
    telemetry, plugin sync or DNS lookup (a resolver is a non-loopback address). Without strace
    that check is skipped, except under CI (`.ci/run` installs it)."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "NO_COLOR": "1"}
    strace = shutil.which("strace")
    if strace is None and os.environ.get("CI"):
        pytest.fail("strace is not installed; .ci/run must install it")
    trace = cwd.parent / "sockets.strace"
    prefix = [strace, "-f", "-qq", "-e", "trace=connect,sendto,sendmsg,sendmmsg", "-o", str(trace)] if strace else []
    done = subprocess.run([*prefix, *args], cwd=cwd, env={**base, **env}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=AGENT_TIMEOUT)
    if strace:
        addressed = {a or b for a, b in _ADDRESS.findall(trace.read_text(errors="replace"))}
        assert addressed, "strace saw no socket call: the agent cannot have reached the gateway"
        assert all(ipaddress.ip_address(a).is_loopback for a in addressed), addressed
    return done


@pytest.fixture(params=["vllm", "sglang"])
def scripted(request: pytest.FixtureRequest, start_sim: StartSim,
             start_gateway: StartGateway) -> tuple[RunningGateway, RunningSim]:
    """A gateway in front of one simulated vLLM or SGLang worker (each refuses the shapes its engine
    refuses; 262K context: the agents ask for 32K output)."""
    engine = request.param
    sim = start_sim(engine, max_context_tokens=262144)
    gw = start_gateway([pool(f"{engine}-256k", engine, [sim.url], 262144)])
    return gw, sim


def script(sim: RunningSim, tool: str, arguments: dict[str, Any]) -> None:
    steps = [{"text": "Running it.", "tool_calls": [{"name": tool, "arguments": arguments}]}, {"text": FINAL}]
    answer = httpx.post(f"{sim.url}/sim/script", json={"steps": steps}, timeout=5)
    assert answer.status_code == 200, answer.text


def received(sim: RunningSim, path: str) -> list[dict[str, Any]]:
    return [r.body for r in sim.engine.records if r.path.split("?")[0] == path and isinstance(r.body, dict)]


def test_claude_code_runs_a_tool_through_the_gateway(scripted: tuple[RunningGateway, RunningSim],
                                                      tmp_path: Path) -> None:
    gw, sim = scripted
    claude = agent("claude")
    script(sim, "Bash", {"command": COMMAND, "description": "Print the marker"})
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": gw.url,  # no /v1: the SDK adds it
        "ANTHROPIC_API_KEY": "sk-kimi-test",
        "ANTHROPIC_MODEL": "kimi-k3", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "kimi-k3",
        "ANTHROPIC_DEFAULT_SONNET_MODEL": "kimi-k3", "ANTHROPIC_DEFAULT_OPUS_MODEL": "kimi-k3",
        "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
    }
    done = run_agent([claude, "-p", "Run the marker command.", "--allowedTools", "Bash"], work, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert FINAL in done.stdout
    assert (work / "marker.txt").read_text().strip() == MARKER
    bodies = received(sim, "/v1/messages")
    assert any(m.get("role") == "system" for m in bodies[0]["messages"])  # its mid-conversation system turn
    results = [block for body in bodies for turn in body["messages"] if isinstance(turn.get("content"), list)
               for block in turn["content"] if block.get("type") == "tool_result"]
    assert results and results[-1]["tool_use_id"] == "toolu_sim_0_0"
    content = results[-1]["content"]
    text = content if isinstance(content, str) else "".join(b.get("text", "") for b in content)
    assert MARKER in text and results[-1].get("is_error") is not True


def test_codex_runs_a_tool_through_the_gateway(scripted: tuple[RunningGateway, RunningSim], tmp_path: Path) -> None:
    gw, sim = scripted
    codex = agent("codex")
    script(sim, "exec_command", {"cmd": COMMAND})
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    (home / "codex").mkdir(parents=True)
    provider = [  # a custom model provider on the Responses API (codex-rs/core/src/model_provider_info.rs)
        "-c", "model_provider=kimi", "-c", "model=kimi-k3",
        "-c", 'model_providers.kimi.name="Kimi gateway"',
        "-c", f'model_providers.kimi.base_url="{gw.v1}"',
        "-c", "model_providers.kimi.env_key=KIMI_API_KEY",
        "-c", "model_providers.kimi.wire_api=responses",
        "-c", "analytics.enabled=false", "-c", "check_for_update_on_startup=false",
        "-c", "features.plugins=false",  # else it syncs its plugin marketplace from GitHub at start
    ]
    env = {"HOME": str(home), "CODEX_HOME": str(home / "codex"), "KIMI_API_KEY": "sk-kimi-test"}
    done = run_agent([codex, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                      *provider, "Run the marker command."], work, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert FINAL in done.stdout
    assert (work / "marker.txt").read_text().strip() == MARKER
    outputs = [item for body in received(sim, "/v1/responses") if isinstance(body.get("input"), list)
               for item in body["input"] if item.get("type") == "function_call_output"]
    assert outputs and outputs[-1]["call_id"] == "call_sim_0_0"
    output = outputs[-1]["output"]
    assert MARKER in (output if isinstance(output, str) else str(output))
