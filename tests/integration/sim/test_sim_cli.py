"""`kimi-gateway sim` as an operator starts it, in a subprocess: the engines' own flags for what the
docs ask of a simulated pool (several served names in vLLM's `--served-model-name a b` form, an
embedding model with vLLM's `--runner pooling` or SGLang's `--is-embedding`, LoRA adapters)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.support import REPO_ROOT

StartSimCli = Callable[..., str]


@pytest.fixture
def run_sim_cli(unused_port: int) -> Iterator[StartSimCli]:
    """Start `python -m gateway.cli sim ARGS... --port P`; yields a function of ARGS returning its URL."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> str:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "sim", *args, "--port", str(unused_port)],
                                cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(proc)
        url = f"http://127.0.0.1:{unused_port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                stderr = proc.stderr.read().decode() if proc.stderr else ""
                raise AssertionError(f"sim exited {proc.returncode}: {stderr}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:  # SGLang answers after its 1 s look
                    return url
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError("the sim subprocess never listened")

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)
        if proc.stderr:
            proc.stderr.close()


def _ids(url: str) -> list[tuple[str, str | None]]:
    return [(m["id"], m.get("parent")) for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]]


def test_several_served_names_in_vllms_form_and_a_lora_adapter(run_sim_cli: StartSimCli) -> None:
    url = run_sim_cli("--engine", "vllm", "--served-model-name", "moonshotai/Kimi-K3", "kimi-k3",
                      "--served-model-name", "Kimi-K3", "--lora-modules", "sql-lora=/loras/sql")
    assert _ids(url) == [("moonshotai/Kimi-K3", None), ("kimi-k3", None), ("Kimi-K3", None),
                         ("sql-lora", "moonshotai/Kimi-K3")]
    # A generative worker (the default runner) serves no pooling API, as vLLM's does not.
    assert httpx.post(url + "/v1/embeddings", json={"model": "kimi-k3", "input": "x"}, timeout=5).status_code == 404


@pytest.mark.parametrize(("engine", "flag"), [("vllm", ["--runner", "pooling"]), ("sglang", ["--is-embedding"])])
def test_an_embedding_worker(run_sim_cli: StartSimCli, engine: str, flag: list[str]) -> None:
    url = run_sim_cli("--engine", engine, "--served-model-name", "BAAI/bge-m3", "--max-context", "8192", *flag)
    got = httpx.post(url + "/v1/embeddings", json={"model": "BAAI/bge-m3", "input": ["a", "b"],
                                                   "encoding_format": "float"}, timeout=5)
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["model"] == "BAAI/bge-m3" and len(body["data"]) == 2 and len(body["data"][0]["embedding"]) == 64
    assert httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["max_model_len"] == 8192
