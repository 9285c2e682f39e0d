"""Body fields by which an engine picks a LoRA adapter: the gateway's to set, never the client's.

Which adapter a request runs with is the gateway's decision: its `model` names the adapter, the
key's allow-list and per-model limits are checked against that name, and the request is routed to a
worker that has it. An engine field that picks an adapter on its own would bypass all three, so:

- SGLang's `lora_path` (`ChatCompletionRequest`, `CompletionRequest` and `EmbeddingRequest` in
  python/sglang/srt/entrypoints/openai/protocol.py; `GenerateReqInput.lora_path` in
  python/sglang/srt/managers/io_struct.py for `/generate`) holds adapter *names*: the tokenizer
  manager looks each one up in its registry (python/sglang/srt/lora/lora_registry.py `acquire`).
  The OpenAI routes resolve the adapter as `model`'s `base:adapter` suffix, else `lora_path`
  (python/sglang/srt/entrypoints/openai/serving_base.py `_resolve_lora_path`): a bare adapter name in
  `model` selects none there. A client's `lora_path` is checked (`check_adapter_fields`) and never
  forwarded; an SGLang pool's engine body gets the gateway's own (`ENGINE_ADAPTER_FIELD`).
- llama.cpp's server takes `lora`, a list of `{"id", "scale"}` applied to that request alone
  (tools/server/README.md, "lora"; `params_from_json_cmpl` reads it with `parse_lora_request`,
  tools/server/server-common.cpp, utils.hpp in older releases): it switches on or off, by index,
  the adapters the server was started with (`--lora`; one not listed gets scale 0). Indices name no
  adapter the allow-list could check, so it is never forwarded: the worker's own `--lora` set applies.
- vLLM picks the adapter by `model` alone (vllm/entrypoints/openai/models/serving.py
  `OpenAIServingModels`, `lora_requests` by name), which the gateway writes for every engine body.

Both fields are removed from every engine body (`STRIPPED_ADAPTER_FIELDS`, gateway/parsing.py).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest

SGLANG_LORA_FIELD = "lora_path"
"""SGLang's body field naming the adapter (or a list of them, one per prompt of a batch)."""

STRIPPED_ADAPTER_FIELDS = (SGLANG_LORA_FIELD, "lora")
"""Body fields that select a LoRA adapter on some engine (module docstring): never forwarded."""

ENGINE_ADAPTER_FIELD: dict[str, str] = {"sglang": SGLANG_LORA_FIELD}
"""Engine kind -> the body field through which the gateway names the adapter a request was routed
for, beside `model` (SGLang reads no adapter from a bare name in `model`)."""


def engine_adapter_field(engine: str, adapter: str | None) -> tuple[str, str] | None:
    """(field, adapter name) that an engine body for `engine` (an engine kind) carries for a request
    routed for LoRA `adapter`; None for the base model or an engine that reads `model` alone."""
    field = ENGINE_ADAPTER_FIELD.get(engine)
    return (field, adapter) if field is not None and adapter is not None else None


def check_adapter_fields(payload: dict[str, Any], adapter: str | None) -> None:
    """Refuse a client's `lora_path` that picks another adapter than the request's `model` names
    (for a body of an API whose SGLang request reads it: gateway/parsing.py `LORA_PATH_APIS`).

    `adapter` is the LoRA adapter `model` resolved to (None: the base model). Accepted: no
    `lora_path`, null, the adapter's own name, or a list of those (SGLang's per-prompt form), and
    null entries when `model` is the base model; the field is then dropped from the engine body
    (the gateway sets its own). Anything else is 400 `invalid_request_error` with param
    `lora_path`: the client asked for an adapter that only `model` may choose here (a silently
    ignored field would answer with another model than the one asked for). llama.cpp's `lora` is
    not checked: it is dropped whatever it holds (module docstring)."""
    value = payload.get(SGLANG_LORA_FIELD)
    if value is None:
        return
    entries = value if isinstance(value, list) else [value]
    if all(entry is None or (adapter is not None and entry == adapter) for entry in entries):
        return
    raise InvalidRequest("`lora_path` cannot choose a LoRA adapter on this gateway: name the adapter as the "
                         "request's `model` (GET /v1/models lists the adapters this key may use), and leave "
                         "`lora_path` out.", param=SGLANG_LORA_FIELD, code="unsupported_parameter")
