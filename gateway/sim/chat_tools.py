"""Tool calls in the simulator's chat completions (vLLM family), and the fixed answers chat shares with
Messages and Responses: a scripted step (`gateway.sim.script`), a forced tool call, a structured answer.

Which answer (`fixed_answer`): the script's step for the conversation, else with `tool_choice`
"required" or a named function one call of that tool (the first tool for "required"), its arguments
the least JSON its `parameters` allow (`structured.instance`), as vLLM's guided decoding makes even a
weak model call a tool (vllm/tool_parsers/abstract_tool_parser.py `adjust_request`: a JSON schema from
the tools, or the parser's structural tag); else with a `response_format` the least JSON of its schema
(`gateway.sim.structured`); else None (the filler answer).

Refusals (`check_tools`), vLLM 0.32.0's, in its order:
- the request model's validators (vllm/entrypoints/openai/chat_completion/protocol.py
  `check_tool_usage`: `VLLMValidationError`, a 400 `BadRequestError` whose message ends in
  ` (parameter=...)` and whose `param` names the field): `tools: []`; a `tool_choice` without
  `tools`; a `tool_choice` that is no object and not auto/required/none; a named choice without a
  `function` object, without a `name`, with an empty name, or naming no tool in `tools`;
- the renderer (vllm/renderers/online_renderer.py): without a tool parser (`SimConfig.tool_call_parser`),
  `auto` (also tools without a `tool_choice`) unless `enable_auto_tool_choice`, and `required` / a named
  function always: a 400 `BadRequestError` without `param`.

Answer shapes (vllm/entrypoints/openai/chat_completion/serving.py; the parser's
`extract_named_tool_call_streaming` / auto streaming in vllm/tool_parsers/streaming.py):
- not streamed: `message.tool_calls` `[{"id", "type": "function", "function": {"name", "arguments"}}]`,
  `content` the text ("" with a forced choice: `content or ""`); `finish_reason` "tool_calls" when a
  call was made, except for a named choice, which keeps "stop";
- streamed: after the role chunk, the text's `content` deltas, then per call a delta
  `{"content": null, "tool_calls": [{"id", "type": "function", "index": j, "function": {"name"}}]}` (the
  tokens that name it, one output token here) and then its arguments, `{"index": j, "function":
  {"arguments": piece}}`, one per output token; the last carries the `finish_reason` (as recorded
  from vLLM 0.32.0 with the Hermes parser).
- cut by `max_tokens` (`finish_reason` "length"): a call whose arguments did not close is not parsed
  (the parsers return the unparsed text as content), so the answer has the text only.
"""

from __future__ import annotations

import uuid
from typing import Any

from gateway.sim import script as sc
from gateway.sim import structured
from gateway.sim.config import SimConfig
from gateway.sim.dialects import EngineDialect, ErrorReply
from gateway.sim.script import ScriptedCall, ScriptStep, SimScript

_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def _invalid(dialect: EngineDialect, message: str, parameter: str) -> ErrorReply:
    return dialect.bad_request(f"{message} (parameter={parameter})", parameter)


def check_tools(body: dict[str, Any], config: SimConfig, dialect: EngineDialect) -> ErrorReply | None:
    """vLLM's refusal of a chat request's `tools` / `tool_choice` (module docstring), else None."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools == []:
        return _invalid(dialect, "`tools` must not be an empty array. Either provide at least one tool or omit "
                                 "the field entirely.", "tools")
    if choice is None and tools:
        choice = "auto"
    if choice is None or choice == "none":
        return None
    if tools is None:
        return _invalid(dialect, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        return _invalid(dialect, f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" "
                                 "or \"required\" are supported.", "tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        if not isinstance(function, dict):
            return _invalid(dialect, f"Invalid value for `function`: `{function}` in `tool_choice`! {_USAGE}",
                            "tool_choice.function")
        if "name" not in function:
            return _invalid(dialect, f"Expected field `name` in `function` in `tool_choice`! {_USAGE}",
                            "tool_choice.function.name")
        name = function["name"]
        if not isinstance(name, str) or not name:
            return _invalid(dialect, f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}",
                            "tool_choice.function.name")
        if name not in _tool_names(tools):
            return _invalid(dialect, "The tool specified in `tool_choice` does not match any of the specified "
                                     "`tools`", "tool_choice")
    if config.tool_call_parser is None:
        if choice == "auto" and not config.enable_auto_tool_choice:
            return dialect.bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                                       "--tool-call-parser to be set")
        if choice != "auto":
            described = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
            return dialect.bad_request(f"tool_choice={described} requires --tool-call-parser to be set")
    return None


def check_sglang_tools(body: dict[str, Any], dialect: EngineDialect, messages: bool = False) -> ErrorReply | None:
    """SGLang's refusals of a chat request's tools and format (python/sglang/srt/entrypoints/openai/
    serving_chat.py `_validate_request`, a 400 `BadRequestError` in its flat shape): `required` or a
    named choice without tools, a named tool not among them, a `json_schema` format without its
    schema. (Its check of each tool's `parameters` against JSON Schema's meta-schema is not simulated.)
    On Messages (`messages`) the same checks run on the converted request, answered with type
    `invalid_request_error` (python/sglang/srt/entrypoints/anthropic/serving.py `_handle_non_streaming`)."""
    reply = _sglang_refusal(body)
    if reply is None:
        return None
    return dialect.error(reply, "invalid_request_error", 400) if messages else dialect.bad_request(reply)


def _sglang_refusal(body: dict[str, Any]) -> str | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if isinstance(choice, str) and choice.lower() == "required" and not tools:
        return "Tools cannot be empty if tool choice is set to required."
    if isinstance(choice, dict):
        if not tools:
            return "Tools cannot be empty if tool choice is set to a specific tool."
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if name not in _tool_names(tools):
            return f"Tool '{name}' not found in tools list."
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            return "schema_ is required for json_schema response format request."
    return None


def from_anthropic(body: dict[str, Any]) -> dict[str, Any]:
    """The chat `tools` and `tool_choice` a Messages request's stand for (vLLM 0.32.0
    vllm/entrypoints/anthropic/serving.py `_convert_tools`, `_convert_tool_choice`): each tool as a
    function with `input_schema` as its parameters, `tool_choice` any → "required", tool → named,
    auto / none alike, and "auto" for tools without a choice; `{}` without tools."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return {}
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    chat_choice: Any = {"any": "required", "auto": "auto", "none": "none"}.get(str(kind), "auto")
    if kind == "tool":
        chat_choice = {"type": "function", "function": {"name": choice.get("name")}}  # type: ignore[union-attr]
    return {"tools": [{"type": "function", "function": {
        "name": t.get("name"), "description": t.get("description"), "parameters": t.get("input_schema")}}
        for t in tools if isinstance(t, dict)], "tool_choice": chat_choice}


def _tool_names(tools: Any) -> list[str]:
    return [str((t.get("function") or {}).get("name")) for t in tools if isinstance(t, dict)] \
        if isinstance(tools, list) else []


def _tool_schema(tools: Any, name: str) -> Any:
    for tool in tools if isinstance(tools, list) else []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            return function.get("parameters") or {"type": "object"}
    return {"type": "object"}


def forced_call(body: dict[str, Any], sglang: bool = False) -> tuple[ScriptStep, bool] | None:
    """The call a `required` or named `tool_choice` forces (and whether it was named), else None; its
    id vLLM's `chatcmpl-tool-<uuid>` or SGLang's `call_<24 hex>` (serving_chat.py `_process_tool_call_id`)."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    if isinstance(choice, dict):
        name = str((choice.get("function") or {}).get("name"))
    elif choice == "required" and _tool_names(tools):
        name = _tool_names(tools)[0]
    else:
        return None
    arguments = structured.instance(_tool_schema(tools, name))
    call = ScriptedCall(name=name, arguments=arguments if isinstance(arguments, dict) else {},
                        id=f"call_{uuid.uuid4().hex[:24]}" if sglang else f"chatcmpl-tool-{uuid.uuid4().hex}")
    return ScriptStep(tool_calls=[call]), isinstance(choice, dict)


def fixed_answer(script: SimScript, body: dict[str, Any], schema: Any, config: SimConfig) -> tuple[int, ScriptStep,
                                                                                                   str] | None:
    """The chat answer that is not filler (module docstring): (step index, step, finish reason when the
    whole step is generated), or None. `schema`: the request's structured format
    (`structured.chat_format`). SGLang (python/sglang/srt/entrypoints/openai/serving_chat.py) parses
    calls only with a tool parser, and then says `tool_calls` for a named choice too
    (`_process_tool_calls`); without one a forced choice is only a JSON constraint
    (`get_json_schema_constraint`: an array of `{"name", "parameters"}` for `required`, the tool's
    parameters for a named one), answered as text."""
    sglang = config.engine == "sglang"
    step = sc.next_step(script, "chat", body)
    if step is not None:
        return step[0], step[1], "tool_calls" if step[1].tool_calls else "stop"
    forced = forced_call(body, sglang)
    if forced is not None and sglang and config.tool_call_parser is None:
        [call] = forced[0].tool_calls
        text = structured.answer_text(call.arguments if forced[1] else [{"name": call.name,
                                                                          "parameters": call.arguments}])
        return -1, ScriptStep(text=text), "stop"
    if forced is not None:
        return -1, forced[0], "stop" if forced[1] and not sglang else "tool_calls"
    if schema is not None:
        return -1, ScriptStep(text=structured.answer_text(structured.instance(schema))), "stop"
    return None


def tokens(step: ScriptStep) -> list[tuple[int | None, str | None]]:
    """A chat answer's output tokens: `(None, word)` for its text, then per call j `(j, None)` for the
    tokens that name it and `(j, piece)` for its arguments (`script.tokens`)."""
    out: list[tuple[int | None, str | None]] = []
    for j, piece in sc.tokens(step):
        if j is not None and (not out or out[-1][0] != j):
            out.append((j, None))
        out.append((j, piece))
    return out


def message_fields(step: tuple[int, ScriptStep], sent: int, forced: bool) -> dict[str, Any]:
    """`content` and `tool_calls` of a non-streamed chat message holding the first `sent` tokens of
    `step`; a call cut short is left out (module docstring)."""
    toks = tokens(step[1])[:sent]
    text = "".join(piece or "" for j, piece in toks if j is None)
    calls = []
    for j, call in enumerate(step[1].tool_calls):
        arguments = "".join(piece or "" for k, piece in toks if k == j)
        if arguments == sc.arguments_json(call):
            calls.append({"id": sc.call_id("chat", step[0], j, call), "type": "function",
                          "function": {"name": call.name, "arguments": arguments}})
    fields: dict[str, Any] = {"content": text or ("" if forced else None)}
    if calls:
        fields["tool_calls"] = calls
    return fields


def delta(step: tuple[int, ScriptStep], i: int) -> dict[str, Any]:
    """The chat stream delta of output token `i` of `step`."""
    j, piece = tokens(step[1])[i]
    if j is None:
        return {"content": piece}
    if piece is not None:
        return {"content": None, "tool_calls": [{"index": j, "function": {"arguments": piece}}]}
    call = step[1].tool_calls[j]
    return {"content": None, "tool_calls": [{"id": sc.call_id("chat", step[0], j, call), "type": "function",
                                             "index": j, "function": {"name": call.name}}]}
