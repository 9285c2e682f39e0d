"""Issue 11 §4: judging a worker's `GET /v1/models` body against its pool (shapes of vLLM and SGLang)."""

from __future__ import annotations

import orjson
import pytest

from gateway.backends.models_check import (
    MAX_ADAPTERS,
    UnreadableModels,
    listed_adapter_roots,
    listed_adapters,
    models_verdict,
)
from gateway.config import parse_config
from gateway.sim.responses import models_list


def body(names: list[str], max_model_len: int | None, owned_by: str = "vllm") -> bytes:
    payload = models_list(names, max_model_len or 0, owned_by, 1_700_000_000)
    if max_model_len is None:
        for entry in payload["data"]:
            del entry["max_model_len"]
    return orjson.dumps(payload)


@pytest.mark.parametrize("owned_by", ["vllm", "sglang"])
def test_the_served_name_with_the_pool_context_passes(owned_by: str) -> None:
    assert models_verdict(body(["moonshotai/Kimi-K3", "kimi-k3"], 524288, owned_by), ("kimi-k3",), 524288) is None


def test_a_missing_name_is_named_with_what_is_served() -> None:
    verdict = models_verdict(body(["kimi-k3"], 131072), ("moonshotai/Kimi-K3",), 131072)
    assert verdict is not None
    assert verdict.startswith("serves 'kimi-k3', not 'moonshotai/Kimi-K3'")


@pytest.mark.parametrize("reported", [131071, 262144])
def test_another_max_model_len_either_way_is_reported(reported: int) -> None:
    assert models_verdict(body(["kimi-k3"], reported), ("kimi-k3",), 131072) == (
        f"reports max_model_len {reported} tokens but the pool's max_context_tokens is 131072")


def test_an_engine_that_reports_no_length_is_judged_by_name_only() -> None:
    assert models_verdict(body(["kimi-k3"], None), ("kimi-k3",), 131072) is None
    weird = orjson.dumps({"data": [{"id": "kimi-k3", "max_model_len": True}]})
    assert models_verdict(weird, ("kimi-k3",), 131072) is None  # not a number of tokens


@pytest.mark.parametrize("raw", [b"<html>", b"[]", b'{"data": {}}', b'{"data": [{"name": "x"}]}', b"{}"])
def test_a_body_that_is_no_model_list_is_unreadable(raw: bytes) -> None:
    with pytest.raises(UnreadableModels):
        models_verdict(raw, ("kimi-k3",), 131072)


@pytest.mark.parametrize("owned_by", ["vllm", "sglang"])
def test_listed_adapters_are_the_entries_with_a_parent(owned_by: str) -> None:
    """Issue 22 §2: a loaded LoRA adapter is listed with `parent` (the base model), the base model
    without one (a null `parent`, or none in SGLang before it listed adapters), and its
    `max_model_len` is null."""
    listed = orjson.dumps(models_list(["kimi-k3", "K3"], 131072, owned_by, 1,
                                      {"sql-lora": "/loras/sql", "chat": "/loras/chat"}))
    assert listed_adapters(listed, ("kimi-k3",)) == {"sql-lora", "chat"}
    assert models_verdict(listed, ("kimi-k3",), 131072) is None  # the adapters' null length judges nothing
    assert listed_adapters(body(["kimi-k3"], 131072, owned_by), ("kimi-k3",)) == frozenset()
    with pytest.raises(UnreadableModels):
        listed_adapters(b'{"data": "no"}', ("kimi-k3",))


def test_listed_adapters_are_capped() -> None:
    many = {f"lora-{i}": f"/loras/{i}" for i in range(MAX_ADAPTERS + 5)}
    listed = orjson.dumps(models_list(["kimi-k3"], 1, "vllm", 1, many))
    assert len(listed_adapters(listed, ("kimi-k3",))) == MAX_ADAPTERS


@pytest.mark.parametrize("owned_by", ["vllm", "sglang"])
def test_listed_adapters_come_with_their_root_path(owned_by: str) -> None:
    """Both engines give a loaded adapter's path as its `root` (vLLM: `lora_path`; SGLang: its
    registry's `lora_path`): how the gateway tells its own load from an operator's."""
    listed = orjson.dumps(models_list(["kimi-k3"], 131072, owned_by, 1, {"sql-lora": "/loras/sql"}))
    assert listed_adapter_roots(listed, ("kimi-k3",)) == {"sql-lora": "/loras/sql"}
    odd = orjson.dumps({"data": [{"id": "kimi-k3", "parent": None, "root": "kimi-k3"},
                                 {"id": "x", "parent": "kimi-k3", "root": 7}, {"id": "y", "parent": "kimi-k3"}]})
    assert listed_adapter_roots(odd, ("kimi-k3",)) == {"x": None, "y": None}


def test_an_adapter_may_not_take_the_name_of_a_model_routed_elsewhere() -> None:
    """Issue 22: an engine listing an adapter named like another model (its alias, any case) or
    like any model's canonical name would take that model's requests to its pool; only an alias of
    the pool's own model is left to the adapter (the field case). `pool_reserved_names` says which."""
    config = parse_config({"pools": [{"name": name, "engine": "vllm", "workers": [f"http://{name}:1"],
                                      "max_context_tokens": 8192} for name in ("k3", "small")],
                           "models": [{"name": "kimi-k3", "aliases": ["Kimi-K3", "k3-sql"], "pools": ["k3"],
                                       "served_model_name": "moonshotai/Kimi-K3"},
                                      {"name": "qwen3-8b", "aliases": ["small"], "pools": ["small"]}]}, environ={})
    reserved = config.pool_reserved_names()
    assert reserved == {"k3": {"kimi-k3", "qwen3-8b", "small"}, "small": {"kimi-k3", "k3-sql", "qwen3-8b"}}
    listed = orjson.dumps(models_list(["moonshotai/Kimi-K3"], 8192, "vllm", 1,
                                      {n: f"/loras/{n}" for n in ("SMALL", "qwen3-8b", "Kimi-K3", "k3-sql", "sql")}))
    assert listed_adapters(listed, ("moonshotai/Kimi-K3",), reserved["k3"]) == {"k3-sql", "sql"}
