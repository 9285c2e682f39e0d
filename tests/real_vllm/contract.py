"""The engine contract: what the gateway relies on in a vLLM worker's answers, as cases that run the same
against the real vLLM and against the simulator's vLLM mode, and a view of each answer that keeps only
what matters to the gateway.

A case sends one or more requests to an engine serving `MODEL` (and the LoRA adapter `ADAPTER`) with a
`CONTEXT`-token context and returns one *observation* per answer:

- `status`, and for JSON bodies a *shape*: every non-null field's path with its JSON type, or its value
  where the gateway reads the value (`KEEP`: `object`, `finish_reason`, `status`, error `type`/`code`,
  SSE event types...); error messages with their numbers replaced by `N`.
- For SSE bodies: the sequence of event signatures (the event's type and its non-null top-level keys;
  a chat chunk's delta keys), runs of one signature collapsed, and `[DONE]` where the engine sends it.
- Usage facts the gateway bills on: `total = prompt + completion`, cached tokens in whole blocks.

Generated text, ids, timestamps and token counts are not compared (the simulator's filler text is not
the tiny model's). `tests/real_vllm/vllm-<version>.json` holds the real engine's observations;
`test_contract.py` checks both implementations against it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx

MODEL = "kimi-k3"
ADAPTER = "sql-lora"
CONTEXT = 2048
BLOCK = 128  # vLLM's CPU block size (vllm/platforms/cpu.py); the simulator runs with the same
KEEP = {"object", "type", "role", "finish_reason", "status", "code", "stop_reason", "reason", "event"}
LONG_TEXT = " ".join(f"word{i} and the quiet river runs" for i in range(120))  # ~700 tokens of the tiny vocab

Observation = dict[str, Any]
Case = Callable[[httpx.Client], list[Observation]]


def _normalise(text: str) -> str:
    return re.sub(r"\d+", "N", text.replace(MODEL, "MODEL").replace(ADAPTER, "ADAPTER"))


def shape(value: Any, path: str = "") -> dict[str, Any]:
    """Each non-null leaf's path → its JSON type, its value for `KEEP` keys, or its normalised text for an
    error's `message`; list items merged under `path[]`; an empty list is `[]`."""
    out: dict[str, Any] = {}
    key = path.rsplit(".", 1)[-1]
    if isinstance(value, dict):
        for k, v in value.items():
            if v is not None:
                out.update(shape(v, f"{path}.{k}" if path else k))
        if not value:
            out[path] = "{}"
    elif isinstance(value, list):
        if not value:
            out[path] = "[]"
        for item in value:
            out.update(shape(item, path + "[]"))
    elif key in KEEP or (key == "message" and ".error" in "." + path) or (key == "detail" and path == "detail"):
        out[path] = _normalise(value) if isinstance(value, str) else value
    else:
        out[path] = type(value).__name__
    return out


def usage_facts(body: dict[str, Any]) -> dict[str, Any]:
    """The billing relations of a body's `usage` (OpenAI or Anthropic names), where it has one."""
    usage = body.get("usage") or (body.get("message") or {}).get("usage") or (body.get("response") or {}).get("usage")
    if not isinstance(usage, dict):
        return {}
    facts: dict[str, Any] = {}
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if isinstance(prompt, int) and isinstance(completion, int) and "total_tokens" in usage:
        facts["total=prompt+completion"] = usage["total_tokens"] == prompt + completion
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens", usage.get("cache_read_input_tokens"))
    if isinstance(cached, int):
        facts["cached"] = "none" if cached == 0 else ("whole blocks" if cached % BLOCK == 0 else "partial block")
    return facts


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event in `text`."""
    events = []
    for block in re.split(r"\r?\n\r?\n", text):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if data or name:
            events.append((name, "\n".join(data)))
    return events


def signature(name: str | None, data: str) -> str:
    if data == "[DONE]":
        return "[DONE]"
    try:
        body = json.loads(data)
    except ValueError:
        return f"{name}:<not json>"
    kind = name or body.get("type") or body.get("object") or "?"
    keys = sorted(k for k, v in body.items() if v is not None and k not in {"id", "created", "model"})
    sig = f"{kind}{{{','.join(keys)}}}"
    for choice in body.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            sig += "/delta{" + ",".join(sorted(k for k, v in delta.items() if v not in (None, [], ""))) + "}"
        if choice.get("finish_reason"):
            sig += f"/finish={choice['finish_reason']}"
    return sig


def observe(response: httpx.Response) -> Observation:
    """The contract view of one answer (see the module docstring)."""
    seen: Observation = {"status": response.status_code}
    kind = response.headers.get("content-type", "").split(";")[0]
    if kind == "text/event-stream":
        sigs: list[str] = []
        facts: dict[str, Any] = {}
        for name, data in sse_events(response.text):
            sig = signature(name, data)
            if not sigs or sigs[-1] != sig:
                sigs.append(sig)
            try:
                body = json.loads(data)
            except ValueError:
                continue
            if isinstance(body, dict):
                facts.update(usage_facts(body))
        seen["events"] = sigs
        seen["usage"] = facts
    elif kind == "application/json":
        body = response.json()
        seen["shape"] = shape(body)
        if isinstance(body, dict):
            seen["usage"] = usage_facts(body)
    else:
        seen["content-type"] = kind
    return seen


def send(http: httpx.Client, method: str, path: str, **kwargs: Any) -> Observation:
    """One request's observation; an answer the engine breaks off is `{"broken": <the error's class>}`."""
    try:
        return observe(http.request(method, path, **kwargs))
    except httpx.TransportError as exc:
        return {"broken": type(exc).__name__}


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> Observation:
    """POST `body` without its None fields (a case's way to leave a field out)."""
    return send(http, "POST", path, json={k: v for k, v in body.items() if v is not None})


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river."}],
            "temperature": 0, "max_tokens": 8, **extra}


def _messages(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river."}],
            "max_tokens": 8, "temperature": 0, **extra}


def _responses(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "Tell me about the river.", "max_output_tokens": 8, "temperature": 0, **extra}


TOO_LONG = " ".join(["river"] * (CONTEXT + 100))


def chat_cases() -> dict[str, Case]:
    return {
        "chat": lambda h: [_post(h, "/v1/chat/completions", _chat())],
        "chat stream with usage": lambda h: [_post(h, "/v1/chat/completions", _chat(
            stream=True, stream_options={"include_usage": True}))],
        "chat stream without usage": lambda h: [_post(h, "/v1/chat/completions", _chat(stream=True))],
        "chat adapter": lambda h: [_post(h, "/v1/chat/completions", _chat(model=ADAPTER))],
        "chat prompt too long": lambda h: [_post(h, "/v1/chat/completions", _chat(
            messages=[{"role": "user", "content": TOO_LONG}]))],
        "chat max_tokens past the context": lambda h: [_post(h, "/v1/chat/completions", _chat(max_tokens=CONTEXT * 4))],
        "chat max_tokens fits, not with the prompt": lambda h: [_post(h, "/v1/chat/completions", _chat(
            max_tokens=CONTEXT - 4))],
        "chat without max_tokens": lambda h: [_post(h, "/v1/chat/completions", _chat(max_tokens=None))],
        "chat bad temperature": lambda h: [_post(h, "/v1/chat/completions", _chat(temperature=-1))],
        "chat unknown model": lambda h: [_post(h, "/v1/chat/completions", _chat(model="no-such-model"))],
        "chat continue_final_message": lambda h: [_post(h, "/v1/chat/completions", _chat(
            messages=[{"role": "user", "content": "Go on."}, {"role": "assistant", "content": "The river"}],
            continue_final_message=True, add_generation_prompt=False))],
        "chat cached prefix": lambda h: [
            _post(h, "/v1/chat/completions", _chat(messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=2)),
            _post(h, "/v1/chat/completions", _chat(messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=2))],
    }


def completion_cases() -> dict[str, Case]:
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 8, "temperature": 0}
    return {
        "completions": lambda h: [_post(h, "/v1/completions", body)],
        "completions stream": lambda h: [_post(h, "/v1/completions", {**body, "stream": True})],
        "completions token ids": lambda h: [_post(h, "/v1/completions", {**body, "prompt": [5, 6, 7, 8]})],
        "completions prompt too long": lambda h: [_post(h, "/v1/completions", {**body, "prompt": TOO_LONG})],
        "completions max_tokens past the context": lambda h: [_post(h, "/v1/completions", {
            **body, "max_tokens": CONTEXT * 4})],
        "completions max_tokens fits, not with the prompt": lambda h: [_post(h, "/v1/completions", {
            **body, "max_tokens": CONTEXT - 2})],
        "completions without max_tokens": lambda h: [_post(h, "/v1/completions", {
            k: v for k, v in body.items() if k != "max_tokens"})],
    }


def messages_cases() -> dict[str, Case]:
    return {
        "messages": lambda h: [_post(h, "/v1/messages", _messages())],
        "messages stream": lambda h: [_post(h, "/v1/messages", _messages(stream=True))],
        "messages stream cached": lambda h: [
            _post(h, "/v1/messages", _messages(messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=2)),
            _post(h, "/v1/messages", _messages(messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=2,
                                               stream=True))],
        "messages prompt too long": lambda h: [_post(h, "/v1/messages", _messages(
            messages=[{"role": "user", "content": TOO_LONG}]))],
        "messages max_tokens fits, not with the prompt": lambda h: [_post(h, "/v1/messages", _messages(
            max_tokens=CONTEXT - 4))],
        "messages count_tokens": lambda h: [_post(h, "/v1/messages/count_tokens", {
            "model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river."}]})],
    }


def _stored(h: httpx.Client) -> list[Observation]:
    created = h.post("/v1/responses", json=_responses(store=True))
    seen = [observe(created)]
    rid = created.json().get("id", "missing")
    seen.append(send(h, "GET", f"/v1/responses/{rid}"))
    seen.append(send(h, "GET", f"/v1/responses/{rid}", params={"stream": "true"}))
    seen.append(send(h, "DELETE", f"/v1/responses/{rid}"))
    seen.append(send(h, "GET", "/v1/responses/resp_does_not_exist"))
    return seen


def _background(h: httpx.Client) -> list[Observation]:
    created = h.post("/v1/responses", json=_responses(store=True, background=True, max_output_tokens=CONTEXT))
    rid = created.json().get("id", "missing")
    return [observe(created), send(h, "POST", f"/v1/responses/{rid}/cancel")]


def responses_cases() -> dict[str, Case]:
    return {
        "responses": lambda h: [_post(h, "/v1/responses", _responses())],
        "responses stream": lambda h: [_post(h, "/v1/responses", _responses(stream=True))],
        "responses stored, replayed, deleted": _stored,
        "responses background cancel": _background,
        "responses without max_output_tokens": lambda h: [_post(h, "/v1/responses", _responses(
            max_output_tokens=None))],
        "responses prompt too long": lambda h: [_post(h, "/v1/responses", _responses(input=TOO_LONG))],
    }


def engine_cases(metric_names: list[str], lora_path: str) -> dict[str, Case]:
    """`/v1/models`, `/health`, the `/metrics` names the gateway scrapes, `/tokenize`, and loading and
    unloading an adapter from `lora_path` (twice each: the second load and unload are refusals)."""
    def lora(h: httpx.Client) -> list[Observation]:
        load = {"lora_name": "extra-lora", "lora_path": lora_path}
        answers = [h.post("/v1/load_lora_adapter", json=load), h.post("/v1/load_lora_adapter", json=load),
                   h.post("/v1/unload_lora_adapter", json={"lora_name": "extra-lora"}),
                   h.post("/v1/unload_lora_adapter", json={"lora_name": "extra-lora"})]
        return [{"status": r.status_code} for r in answers]

    def metrics(h: httpx.Client) -> list[Observation]:
        text = h.get("/metrics").text
        return [{"present": {name: any(line.startswith(name) for line in text.splitlines()) for name in metric_names}}]

    return {
        "models": lambda h: [send(h, "GET", "/v1/models")],
        "health": lambda h: [{"status": h.get("/health").status_code}],
        "metrics the gateway scrapes": metrics,
        "tokenize": lambda h: [_post(h, "/tokenize", {"model": MODEL, "prompt": "The river"}),
                               _post(h, "/detokenize", {"model": MODEL, "tokens": [5, 6, 7]})],
        "lora load and unload": lora,
    }


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                "sunny": {"type": "boolean"}},
               "required": ["city", "sunny"], "additionalProperties": False}
"""Closed value sets, so that even the tiny model's guided answer ends (a free string need not)."""
GUIDED = 200  # room for a guided answer to close its JSON


def _parses(text: Any) -> bool:
    try:
        json.loads(text)
    except (TypeError, ValueError):
        return False
    return True


def json_facts(response: httpx.Response) -> Observation:
    """Whether a structured answer is what was asked for: the chat message's `content` and each tool
    call's `arguments`, the Responses output text, the Messages text parse as JSON (a guided answer
    the token budget cut off does not)."""
    seen = observe(response)
    try:
        body = response.json()
    except ValueError:
        return seen
    facts: dict[str, Any] = {}
    for choice in body.get("choices") or []:
        message = choice.get("message") or {}
        if message.get("content"):
            facts["content parses"] = _parses(message["content"])
        for call in message.get("tool_calls") or []:
            facts["arguments parse"] = _parses((call.get("function") or {}).get("arguments"))
    for item in body.get("output") or []:
        for part in item.get("content") or []:
            if part.get("type") == "output_text":
                facts["output_text parses"] = _parses(part.get("text"))
    if body.get("type") == "message":
        for block in body.get("content") or []:
            if block.get("type") == "text":
                facts["text parses"] = _parses(block.get("text"))
    if facts:
        seen["json"] = facts
    return seen


def _guided(http: httpx.Client, path: str, body: dict[str, Any]) -> list[Observation]:
    try:
        return [json_facts(http.post(path, json={k: v for k, v in body.items() if v is not None}))]
    except httpx.TransportError as exc:
        return [{"broken": type(exc).__name__}]


def _count_tokens_grows(h: httpx.Client) -> list[Observation]:
    """count_tokens of one conversation, then with a tool, then with a system prompt: the observations, and
    whether each addition counted more tokens."""
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river."}]}
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": WEATHER["function"]["parameters"]}  # type: ignore[index]
    answers = [h.post("/v1/messages/count_tokens", json=body)
               for body in (base, {**base, "tools": [tool]}, {**base, "system": "You are terse."})]
    counts = [r.json().get("input_tokens", 0) if r.status_code == 200 else 0 for r in answers]
    return [*(observe(r) for r in answers),
            {"tools add tokens": counts[1] > counts[0], "system adds tokens": counts[2] > counts[0]}]


def _forced_tool_calls(prefix: str, **named_stream: Any) -> dict[str, Case]:
    """`tool_choice` required and named, streamed and not, under names starting with `prefix`;
    `named_stream`: more fields of the streamed named case."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    return {
        f"{prefix}chat tool_choice required": lambda h: _guided(h, "/v1/chat/completions", _chat(
            tools=[WEATHER], tool_choice="required", max_tokens=GUIDED)),
        f"{prefix}chat tool_choice required stream": lambda h: [_post(h, "/v1/chat/completions", _chat(
            tools=[WEATHER], tool_choice="required", max_tokens=GUIDED, stream=True))],
        f"{prefix}chat tool_choice named": lambda h: _guided(h, "/v1/chat/completions", _chat(
            tools=[WEATHER], tool_choice=named, max_tokens=GUIDED)),
        f"{prefix}chat tool_choice named stream": lambda h: [_post(h, "/v1/chat/completions", _chat(
            tools=[WEATHER], tool_choice=named, max_tokens=GUIDED, stream=True, **named_stream))],
    }


def feature_cases() -> dict[str, Case]:
    """Tool calls, structured output and token counting with tools (an engine started without a tool
    parser, as the contract's is)."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    return {
        **_forced_tool_calls(""),
        "chat tool_choice auto": lambda h: [_post(h, "/v1/chat/completions", _chat(
            tools=[WEATHER], tool_choice="auto"))],
        "chat tool_choice named, unknown tool": lambda h: [_post(h, "/v1/chat/completions", _chat(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}))],
        "chat tool_choice without tools": lambda h: [_post(h, "/v1/chat/completions", _chat(
            tool_choice="required"))],
        "chat tools, tool_choice none": lambda h: [_post(h, "/v1/chat/completions", _chat(
            tools=[WEATHER], tool_choice="none"))],
        "chat response_format json_object": lambda h: _guided(h, "/v1/chat/completions", _chat(
            response_format={"type": "json_object"}, max_tokens=GUIDED)),
        "chat response_format json_schema": lambda h: _guided(h, "/v1/chat/completions", _chat(
            response_format=schema_format, max_tokens=GUIDED)),
        "chat response_format json_schema stream": lambda h: [_post(h, "/v1/chat/completions", _chat(
            response_format=schema_format, max_tokens=GUIDED, stream=True))],
        "chat response_format json_schema without schema": lambda h: [_post(h, "/v1/chat/completions", _chat(
            response_format={"type": "json_schema"}))],
        "chat response_format schema not an object": lambda h: [_post(h, "/v1/chat/completions", _chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}))],
        "chat response_format unknown type": lambda h: [_post(h, "/v1/chat/completions", _chat(
            response_format={"type": "yaml"}))],
        "responses text.format json_schema": lambda h: _guided(h, "/v1/responses", _responses(
            text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA}},
            max_output_tokens=GUIDED)),
        "responses text.format json_object": lambda h: _guided(h, "/v1/responses", _responses(
            text={"format": {"type": "json_object"}}, max_output_tokens=GUIDED)),
        "messages output_config format": lambda h: _guided(h, "/v1/messages", _messages(
            output_config={"format": {"type": "json_schema", "schema": CITY_SCHEMA}}, max_tokens=GUIDED)),
        "messages count_tokens with tools and system": _count_tokens_grows,
    }


TOOL_PARSER_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
"""The flags of the engine `tool_parser_cases` run against (the tiny model's ChatML suits Hermes' parser)."""


def tool_parser_cases() -> dict[str, Case]:
    """Tool calls on an engine started with `TOOL_PARSER_ARGS`: `required` and named choices, which vLLM
    answers with guided decoding (so even the tiny model's answer is a call), streamed and not; `auto`;
    Messages with tools (served as `auto`) and their token count."""
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": WEATHER["function"]["parameters"]}  # type: ignore[index]
    return {
        **_forced_tool_calls("tools: ", stream_options={"include_usage": True}),
        "tools: chat tool_choice auto": lambda h: [_post(h, "/v1/chat/completions", _chat(
            tools=[WEATHER], tool_choice="auto"))],
        "tools: messages with tools": lambda h: [_post(h, "/v1/messages", _messages(tools=[tool]))],
        "tools: messages tool_choice any": lambda h: [_post(h, "/v1/messages", _messages(
            tools=[tool], tool_choice={"type": "any"}, max_tokens=GUIDED))],
        "tools: messages count_tokens with tools": lambda h: [_post(h, "/v1/messages/count_tokens", {
            "model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river."}],
            "tools": [tool]})],
    }


def all_cases(metric_names: list[str], lora_path: str) -> dict[str, Case]:
    return {**chat_cases(), **completion_cases(), **messages_cases(), **responses_cases(),
            **engine_cases(metric_names, lora_path), **feature_cases()}
