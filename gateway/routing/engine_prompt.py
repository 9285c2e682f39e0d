"""Prompt an engine reads from body fields other than the API's own (`messages`, `input`, `tools`, ...),
for the estimate of what the engine prefills (`RoutingRequest.prompt_tokens`): a key's token
reservation and the context fit must see it, or a client could have a large prompt prefilled while
being charged for a small one.

Token ids that replace the rendered prompt (`PROMPT_ID_FIELDS`), counted one token an id:

- chat, SGLang: `input_ids` (`ChatCompletionRequest.input_ids` in
  python/sglang/srt/entrypoints/openai/protocol.py, 0.5.23): `OpenAIServingChat._process_messages`
  (serving_chat.py) skips the chat template and sends these ids to the model; the messages only
  give the stop strings and the tool-call constraint;
- chat, vLLM: `kv_transfer_params.prompt_token_ids` (0.32; `_reused_prompt_token_ids` in
  vllm/renderers/online_renderer.py): ids a prefill stage forwards to its decode stage, fed to the
  engine instead of the rendered messages unless `echo` is set or the messages hold media. The
  gateway passes `kv_transfer_params` on only to pools with `allow_kv_transfer_fields`
  (`protocol.body.KV_TRANSFER_FIELDS`).

The estimate takes the larger of the rendered prompt's and the ids' (an engine renders the messages
instead in the cases above, and the other engine ignores the field).

Text the chat template renders into the prompt (`PROMPT_TEXT_FIELDS`), counted as the UTF-8 text of
their JSON and added to the estimate:

- chat, vLLM: `documents` (`ChatCompletionRequest.documents`, passed to the template for RAG);
- chat and Responses, vLLM and SGLang: `chat_template_kwargs` (the template's own variables, which
  it may render: `ChatCompletionRequest.chat_template_kwargs`, `ResponsesRequest.chat_template_kwargs`);
- Responses, vLLM: `previous_input_messages` (earlier turns in the Harmony format, rendered before
  the input: `construct_harmony_previous_input_messages` in
  vllm/entrypoints/openai/responses/harmony.py).

None of these is refused for being there: the engine judges its own fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.dialects.names import CHAT, RESPONSES, Api
from gateway.routing.tokens import TokenEstimator

PROMPT_ID_FIELDS: Mapping[Api, tuple[tuple[str, ...], ...]] = {
    CHAT: (("input_ids",), ("kv_transfer_params", "prompt_token_ids")),
}
"""Per API, the paths (body field, then keys of nested objects) of token-id lists an engine
prefills instead of the prompt it renders (module docstring)."""

PROMPT_TEXT_FIELDS: Mapping[Api, tuple[str, ...]] = {
    CHAT: ("documents", "chat_template_kwargs"),
    RESPONSES: ("previous_input_messages", "chat_template_kwargs"),
}
"""Per API, the body fields whose content an engine's chat template renders into the prompt."""


def prompt_ids(api: Api, extra: Mapping[str, Any] | None) -> int:
    """The length of the longest token-id list among the request's `PROMPT_ID_FIELDS` (tokens), 0
    when it sends none. A list's items are not checked (the engine refuses a list that is not of
    token ids; the reservation is then given back)."""
    if not extra:
        return 0
    longest = 0
    for path in PROMPT_ID_FIELDS.get(api, ()):
        value: Any = extra
        for name in path:
            value = value.get(name) if isinstance(value, dict) else None
        if isinstance(value, list):
            longest = max(longest, len(value))
    return longest


def prompt_text_tokens(api: Api, extra: Mapping[str, Any] | None, estimator: TokenEstimator) -> int:
    """Estimated tokens of the request's `PROMPT_TEXT_FIELDS` (their JSON text), 0 without any. A
    value nested deeper than the body can be forwarded counts nothing: that request is refused
    when its engine body is written (`parsing.upstream_body`)."""
    if not extra:
        return 0
    texts = []
    for name in PROMPT_TEXT_FIELDS.get(api, ()):
        value = extra.get(name)
        if value is not None:
            try:
                texts.append(orjson.dumps(value))
            except TypeError:
                continue
    return estimator.utf8_tokens(b"".join(texts)) if texts else 0
