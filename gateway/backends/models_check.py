"""What a worker says it serves (`GET /v1/models`) against what its pool was configured with.

vLLM and SGLang list every served model name as an entry of `data` (`id`) and give each entry the
engine's context window as `max_model_len` in tokens (vLLM's `ModelCard`; SGLang's
`available_models` sets it from `model_config.context_len`). A worker whose list lacks the name
the gateway sends (the pool's `served_model_name`, else the model's name) answers every request
with an unknown-model error; one whose `max_model_len` differs from the pool's
`max_context_tokens` refuses long requests the router sent there (smaller) or hides capacity the
router never uses (larger). LoRA adapters loaded in the engine are listed there too, each as an entry whose `id` is the
adapter's name, `root` its path and `parent` the base model's served name (vLLM:
`OpenAIServingModels.show_available_models` in vllm/entrypoints/openai/serving_models.py, for
`--lora-modules` and runtime-loaded ones alike; SGLang: `available_models` in
python/sglang/srt/entrypoints/http_server.py, from its `lora_registry`); `listed_adapters` reads
them. llama.cpp is not checked: it accepts any `model` in a request, and its
`meta.n_ctx` means the whole server's or one slot's window depending on the version.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import orjson

from gateway.backends.params import EngineKind

MODELS_PATH = "/v1/models"
CHECKED_ENGINES: frozenset[EngineKind] = frozenset({"vllm", "sglang", "ascend"})


class UnreadableModels(ValueError):
    """A `/v1/models` body that is not OpenAI's list shape (`{"data": [{"id": ...}, ...]}`)."""


MAX_ADAPTERS = 1024
"""LoRA adapters read from one worker's list at most (the rest are not routed to it)."""


def _entries(body: bytes) -> list[dict[str, Any]]:
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise UnreadableModels(f"/v1/models answered no JSON ({exc})") from None
    entries = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("id"), str)
                                                for e in entries):
        raise UnreadableModels("/v1/models answered no OpenAI model list ({\"data\": [{\"id\": ...}]})")
    return entries


def listed_adapters(body: bytes, served_names: Collection[str],
                    reserved: Collection[str] = frozenset()) -> frozenset[str]:
    """The LoRA adapter names a `/v1/models` body lists: entries with a string `parent` (the
    base model they adapt) that are not one of `served_names` (the pool's models) themselves nor,
    in lower case, one of `reserved` (the gateway's names of models it routes elsewhere, lower case:
    `GatewayConfig.pool_reserved_names`), at most `MAX_ADAPTERS`. Raises UnreadableModels for a
    body that is not a model list."""
    return frozenset(listed_adapter_roots(body, served_names, reserved))


def listed_adapter_roots(body: bytes, served_names: Collection[str],
                         reserved: Collection[str] = frozenset()) -> dict[str, str | None]:
    """`listed_adapters` with each one's `root`: the path the engine loaded it from (vLLM: the
    `lora_path` of its load or `--lora-modules`; SGLang: the `lora_path` of its `lora_registry`
    entry), None when not a string. The base model's entry has no `parent` (SGLang before it listed
    adapters) or a null one (vLLM; SGLang since). Raises UnreadableModels as `listed_adapters`."""
    found: dict[str, str | None] = {}
    for entry in _entries(body):
        if (isinstance(entry.get("parent"), str) and entry["id"] not in served_names
                and entry["id"].lower() not in reserved and len(found) < MAX_ADAPTERS):
            root = entry.get("root")
            found.setdefault(entry["id"], root if isinstance(root, str) else None)
    return found


def models_verdict(body: bytes, served_names: Sequence[str], max_context_tokens: int) -> str | None:
    """None when the list names every one of `served_names` (the pool's models, as the gateway
    sends them) and each one's `max_model_len` (tokens) is absent or equals `max_context_tokens`;
    else the reason the worker is misconfigured, in words (a missing name first: without it there
    is no entry to read a length from). Raises UnreadableModels for a body that is not a model list."""
    entries = _entries(body)
    ids = [entry["id"] for entry in entries]
    for served_name in served_names:
        entry = next((e for e in entries if e["id"] == served_name), None)
        if entry is None:
            listed = ", ".join(repr(i) for i in ids[:8]) or "nothing"
            return (f"serves {listed}, not {served_name!r} (the name the gateway sends): every request for it "
                    "would be refused as an unknown model")
        reported = entry.get("max_model_len")
        if isinstance(reported, int) and not isinstance(reported, bool) and reported != max_context_tokens:
            which = f" for {served_name!r}" if len(served_names) > 1 else ""
            return (f"reports max_model_len {reported} tokens{which} but the pool's "
                    f"max_context_tokens is {max_context_tokens}")
    return None
