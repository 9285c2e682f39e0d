"""One engine contract, two implementations: every case of `contract.py` against the simulator's vLLM mode
(always) and against the real vLLM (marker `vllm`), each compared with the real engine's recorded answers
(`vllm-<version>.json`), so the simulator is held to the engine even where no real engine is installed.
`contract.tool_parser_cases` run the same way against an engine started with a tool parser
(`contract.TOOL_PARSER_ARGS`) and a simulator configured alike (`tool_sim`).

Re-record after a vLLM upgrade: `KIMI_RECORD_CONTRACT=1 .venv/bin/pytest -n 0 tests/real_vllm/test_contract.py
-m vllm` rewrites the file from the real engine; review its diff, then fix the simulator until the
other half of this file passes, or name the deliberate difference in `DELIBERATE`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.backends.engine_kinds import ENGINES
from tests.real_vllm import contract
from tests.real_vllm.engine import VERSION, VllmEngine, models_dir
from tests.support import RunningSim

RECORDED = Path(__file__).with_name(f"vllm-{VERSION}.json")
RECORDING = bool(os.environ.get("KIMI_RECORD_CONTRACT"))
SPEC = ENGINES["vllm"]
METRICS = [m for m in (SPEC.running_metric, SPEC.waiting_metric, SPEC.kv_usage_metrics[0]) if m]
CASES = contract.all_cases(METRICS, lora_path="LORA")
TOOL_CASES = contract.tool_parser_cases()

# Cases whose real answer depends on a race the tiny model's speed decides: checked on the simulator only.
RACES = {"responses background cancel": "the tiny model may finish the background response before the cancel "
                                        "arrives (vLLM then answers 400 'Cannot cancel a synchronous response.')"}

# Where the simulator knowingly differs from vLLM: case → {observation path → why}. The path is dropped
# from both sides before comparing (`events:finish`: the stream's finish reasons).
_JUNK = ("the tiny model never closes a guided answer (it writes whitespace or a free string until "
         "max_tokens); the simulator's model answers the least JSON the format allows and stops")
_CALL = {f"shape:choices[].message.tool_calls[].{k}": _JUNK for k in ("id", "type", "function.name",
                                                                        "function.arguments")}
DELIBERATE: dict[str, dict[str, str]] = {
    **{name: {"json": _JUNK, "shape:choices[].finish_reason": _JUNK, **_CALL}
       for name in ("tools: chat tool_choice required", "tools: chat tool_choice named",
                    "chat response_format json_object", "chat response_format json_schema")},
    **{name: {"events:finish": _JUNK}
       for name in ("tools: chat tool_choice required stream", "tools: chat tool_choice named stream",
                    "chat response_format json_schema stream")},
    **{name: {"json": _JUNK, "shape:status": _JUNK, "shape:incomplete_details.reason": _JUNK}
       for name in ("responses text.format json_schema", "responses text.format json_object")},
    "messages output_config format": {"json": _JUNK, "shape:stop_reason": _JUNK},
    "tools: messages tool_choice any": {f"shape:{k}": _JUNK for k in (
        "stop_reason", "content[].type", "content[].text", "content[].id", "content[].name", "content[].input.city")},
}


def _recorded() -> dict[str, Any]:
    return json.loads(RECORDED.read_text()) if RECORDED.exists() else {}


def _without(seen: list[dict[str, Any]], drop: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for obs in seen:
        obs = json.loads(json.dumps(obs))
        for path in drop:
            top, _, rest = path.partition(":")
            if path == "events:finish" and isinstance(obs.get("events"), list):
                obs["events"] = [re.sub(r"/finish=\w+", "/finish", sig) for sig in obs["events"]]
            elif rest and isinstance(obs.get(top), dict):
                obs[top].pop(rest, None)
            elif not rest:
                obs.pop(top, None)
        out.append(obs)
    return out


def _check(name: str, seen: list[dict[str, Any]]) -> None:
    recorded = _recorded()
    assert name in recorded, f"no recorded answer for {name!r} in {RECORDED.name}: re-record (module docstring)"
    drop = DELIBERATE.get(name, {})
    assert _without(seen, drop) == _without(recorded[name], drop)


def _run(name: str, url: str, lora_path: str) -> list[dict[str, Any]]:
    cases = contract.all_cases(METRICS, lora_path=lora_path)
    with httpx.Client(base_url=url, timeout=120) as http:
        return cases[name](http)


def _running_sim(**extra: Any) -> Iterator[RunningSim]:
    from gateway.serving.server import ThreadedServer
    from gateway.sim.app import create_sim_app
    from gateway.sim.config import SimConfig
    from gateway.sim.keepalive import sim_http_options

    config = SimConfig.model_validate({
        "engine": "vllm", "max_context_tokens": contract.CONTEXT, "served_model_names": [contract.MODEL],
        "lora_modules": [f"{contract.ADAPTER}=/loras/sql"], "kv_capacity_tokens": 1 << 20,
        "kv_block_tokens": contract.BLOCK, "ttft_s": 0.0, "tpot_s": 0.0, "runtime_lora_updating": True,
        "default_output_tokens": None, **extra})
    app = create_sim_app(config)
    server = ThreadedServer(app, **sim_http_options(config, app.engine)).start()
    yield RunningSim(server, app.engine)
    server.server.should_exit = True
    server.stop(10)


@pytest.fixture(scope="module")
def sim(_stopping_servers: Any) -> Iterator[RunningSim]:
    """The simulator as the contract's engine runs: no tool parser."""
    yield from _running_sim(tool_call_parser=None, enable_auto_tool_choice=False)


@pytest.fixture(scope="module")
def tool_sim(_stopping_servers: Any) -> Iterator[RunningSim]:
    """The simulator with a tool parser (`contract.TOOL_PARSER_ARGS`)."""
    yield from _running_sim(tool_call_parser="hermes", enable_auto_tool_choice=True)


@pytest.mark.parametrize("name", list(TOOL_CASES))
def test_simulator_with_a_tool_parser_keeps_the_contract(name: str, tool_sim: RunningSim) -> None:
    with httpx.Client(base_url=tool_sim.url, timeout=120) as http:
        _check(name, TOOL_CASES[name](http))


@pytest.mark.parametrize("name", list(CASES))
def test_simulator_keeps_the_contract(name: str, sim: RunningSim) -> None:
    _check(name, _run(name, sim.url, "/loras/extra"))


@pytest.fixture(scope="module")
def engine() -> Iterator[VllmEngine]:
    models = models_dir()
    vllm = VllmEngine(models / "dense", [contract.MODEL], max_model_len=contract.CONTEXT, args=[
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
        "--lora-modules", f"{contract.ADAPTER}={models / 'lora'}"]).start()
    yield vllm
    vllm.stop()


@pytest.fixture(scope="module")
def recorder() -> Iterator[Callable[[str, list[dict[str, Any]]], None]]:
    fresh: dict[str, Any] = {}
    yield fresh.__setitem__
    if RECORDING and fresh:
        RECORDED.write_text(json.dumps({**_recorded(), **fresh}, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def tool_engine() -> Iterator[VllmEngine]:
    """The engine of `contract.tool_parser_cases`: the contract's, with a tool parser."""
    vllm = VllmEngine(models_dir() / "dense", [contract.MODEL], max_model_len=contract.CONTEXT,
                      args=contract.TOOL_PARSER_ARGS).start()
    yield vllm
    vllm.stop()


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(TOOL_CASES))
def test_real_vllm_with_a_tool_parser_keeps_the_contract(
        name: str, tool_engine: VllmEngine, recorder: Callable[[str, list[dict[str, Any]]], None]) -> None:
    with httpx.Client(base_url=tool_engine.url, timeout=120) as http:
        seen = TOOL_CASES[name](http)
    if RECORDING:
        recorder(name, seen)
    else:
        _check(name, seen)


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(CASES))
def test_real_vllm_keeps_the_contract(name: str, engine: VllmEngine,
                                      recorder: Callable[[str, list[dict[str, Any]]], None]) -> None:
    if name in RACES:
        pytest.skip(RACES[name])
    seen = _run(name, engine.url, str(models_dir() / "lora"))
    if RECORDING:
        recorder(name, seen)
    else:
        _check(name, seen)
