"""Issue 37 §4, the engine fields that pick a LoRA adapter (gateway/protocol/adapter_fields.py): a
client's SGLang `lora_path` is accepted only where it agrees with `model` (else 400 in OpenAI's
shape), on the APIs where SGLang reads it; no engine body carries the client's `lora_path` or
llama.cpp's `lora`, and an SGLang pool's carries the gateway's own (gateway/parsing.py, for a
decoded body and for one encoded in a parse process alike)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.config import parse_config
from gateway.dialects.names import CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, RESPONSES, Api
from gateway.errors import InvalidRequest
from gateway.parsing import LORA_PATH_APIS, BodyParser, ForwardBody, encode_for
from gateway.protocol.adapter_fields import check_adapter_fields, engine_adapter_field


@pytest.mark.parametrize(("lora_path", "adapter"), [
    (None, None), (None, "sql"), ("sql", "sql"), (["sql", "sql"], "sql"), ([None, "sql"], "sql"), ([None], None),
])
def test_a_lora_path_that_agrees_with_the_model_is_accepted(lora_path: Any, adapter: str | None) -> None:
    check_adapter_fields({"model": adapter or "kimi-k3", "lora_path": lora_path}, adapter)


@pytest.mark.parametrize(("lora_path", "adapter"), [
    ("sql", None), ("other", "sql"), (["sql", "other"], "sql"), ([None, "sql"], None), ("", None), (5, None),
    ({"name": "sql"}, "sql"),
])
def test_a_lora_path_that_picks_another_adapter_is_refused(lora_path: Any, adapter: str | None) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_adapter_fields({"model": adapter or "kimi-k3", "lora_path": lora_path}, adapter)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "lora_path",
                                                                               "unsupported_parameter")


CONFIG = parse_config({"pools": [{"name": "p", "engine": "sglang", "workers": ["http://127.0.0.1:1"],
                                  "max_context_tokens": 8192, "lora_adapters": ["sql"]}]}, environ={})


@pytest.mark.parametrize(("api", "body"), [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}]}), (COMPLETIONS, {"prompt": "hi"}),
])
def test_the_parser_checks_lora_path_where_sglang_reads_it(api: Api, body: dict[str, Any]) -> None:
    parser = BodyParser(CONFIG)
    with pytest.raises(InvalidRequest):
        parser.validate(api, {"model": "kimi-k3", "lora_path": "sql", **body}, {"sql"})
    parser.validate(api, {"model": "sql", "lora_path": "sql", **body}, {"sql"})


def test_lora_path_is_only_dropped_where_no_engine_reads_it() -> None:
    """SGLang's Messages and Responses requests have no `lora_path`: refusing it there would be
    stricter than the engine; it is dropped all the same."""
    parser = BodyParser(CONFIG)
    assert MESSAGES not in LORA_PATH_APIS and RESPONSES not in LORA_PATH_APIS and EMBEDDINGS in LORA_PATH_APIS
    parser.validate(RESPONSES, {"model": "kimi-k3", "lora_path": "sql", "input": "hi"}, {"sql"})
    parser.validate(MESSAGES, {"model": "kimi-k3", "lora_path": "sql", "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]}, {"sql"})


def test_only_sglang_takes_the_adapter_in_a_body_field() -> None:
    assert engine_adapter_field("sglang", "sql") == ("lora_path", "sql")
    assert engine_adapter_field("sglang", None) is None
    for engine in ("vllm", "ascend", "llamacpp"):
        assert engine_adapter_field(engine, "sql") is None


PAYLOAD = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "lora_path": "sql",
           "lora": [{"id": 0, "scale": 1.0}], "temperature": 0.5}


@pytest.mark.parametrize("offloaded", [False, True])
def test_no_engine_body_carries_the_clients_adapter_fields(offloaded: bool) -> None:
    payload = ForwardBody.of(PAYLOAD, "sql", False) if offloaded else PAYLOAD
    for key, expected in [(("sql", False), None), (("sql", False, False, False, ("lora_path", "sql")), "sql"),
                          (("kimi-k3", True), None)]:
        body = orjson.loads(encode_for(payload, *key))  # type: ignore[arg-type]
        assert "lora" not in body and body.get("lora_path") == expected and body["temperature"] == 0.5
        assert body["model"] == key[0]


def test_a_parse_processs_first_body_carries_the_pools_adapter_field() -> None:
    forward = ForwardBody.of(PAYLOAD, "sql", False, False, False, ("lora_path", "sql"))
    assert orjson.loads(forward.first)["lora_path"] == "sql"
    assert "lora_path" not in orjson.loads(forward.encode("sql", False))  # another pool: a vLLM one
