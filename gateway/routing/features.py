"""Build the frozen `RoutingRequest` a request is routed by (design §2 step 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.errors import InvalidRequest
from gateway.protocol.openai import PART_MODALITY, ChatCompletionRequest, CompletionRequest
from gateway.routing.tokens import TokenEstimator

Api = Literal["chat", "completions"]

_TEMPLATE_FIELDS = frozenset({"tools", "tool_calls", "functions", "response_format"})


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What routing needs to know about one request.

    `prompt_tokens` is an estimate (tokens); `output_tokens` is what the client asked for
    (`max_completion_tokens`, else `max_tokens`), None when it set neither, in which case each pool's
    `default_output_tokens` is reserved. `estimate_method` says how the prompt was counted:
    `bytes`, `bytes+pixels`, `bytes+default` or `token_ids`.
    """

    api: Api
    model: str
    prompt_tokens: int
    output_tokens: int | None
    stream: bool
    modalities: frozenset[str]
    estimate_method: str
    session_key: str | None = None
    image_count: int = 0
    include_usage: bool = False

    def context_tokens(self, default_output_tokens: int) -> int:
        """Tokens of context needed on a pool that reserves `default_output_tokens` by default."""
        out = self.output_tokens if self.output_tokens is not None else default_output_tokens
        return self.prompt_tokens + out


def chat_features(wire: ChatCompletionRequest, model: str, estimator: TokenEstimator,
                  session_key: str | None = None) -> RoutingRequest:
    """Features of a chat request: text and image tokens, template overhead, modalities.

    Raises InvalidRequest for an image data URI that cannot be read.
    """
    tokens = estimator.config.tokens_per_request
    modalities = {"text"}
    methods = {"bytes"}
    images = 0
    per_message = estimator.config.tokens_per_message
    for i, message in enumerate(wire.messages):
        tokens += per_message
        content = message.content
        if content is None:
            continue
        if isinstance(content, str):
            tokens += estimator.text_tokens(content)
            continue
        for j, part in enumerate(content):
            modalities.add(PART_MODALITY[part.type])
            if part.type == "text" or part.type == "refusal":
                tokens += estimator.text_tokens(part.text if part.type == "text" else part.refusal)
            elif part.type == "image_url":
                images += 1
                estimate = estimator.image_tokens(part.image_url.url,
                                                  param=f"messages[{i}].content[{j}].image_url.url")
                tokens += estimate.tokens
                methods.add(estimate.method)
    # Tool schemas and tool calls are rendered into the prompt by the chat template too.
    for holder in (wire, *wire.messages):
        for key in _TEMPLATE_FIELDS.intersection(holder.model_extra or ()):
            tokens += estimator.text_tokens(str(holder.model_extra[key]))  # type: ignore[index]
    output = wire.max_completion_tokens if wire.max_completion_tokens is not None else wire.max_tokens
    method = "+".join(sorted(methods, key=["bytes", "pixels", "default"].index))
    return RoutingRequest(
        api="chat", model=model, prompt_tokens=tokens, output_tokens=output, stream=bool(wire.stream),
        modalities=frozenset(modalities), estimate_method=method, session_key=session_key or wire.user,
        image_count=images,
        include_usage=bool(wire.stream_options and wire.stream_options.include_usage),
    )


def completion_features(wire: CompletionRequest, model: str, estimator: TokenEstimator,
                        session_key: str | None = None) -> RoutingRequest:
    """Features of a legacy completions request (text prompt(s) or token ids)."""
    prompt = wire.prompt
    method = "bytes"
    if isinstance(prompt, str):
        tokens = estimator.text_tokens(prompt)
    elif not prompt:
        raise InvalidRequest("'prompt' must not be empty", param="prompt")
    elif isinstance(prompt[0], str):
        # A batch of prompts: each is its own sequence, so the longest decides the context.
        tokens = max(estimator.text_tokens(p) for p in prompt)  # type: ignore[arg-type]
    elif isinstance(prompt[0], int):
        tokens, method = len(prompt), "token_ids"
    else:
        tokens, method = max(len(p) for p in prompt), "token_ids"  # type: ignore[arg-type]
    return RoutingRequest(
        api="completions", model=model, prompt_tokens=tokens, output_tokens=wire.max_tokens,
        stream=bool(wire.stream), modalities=frozenset({"text"}), estimate_method=method,
        session_key=session_key or wire.user,
        include_usage=bool(wire.stream_options and wire.stream_options.include_usage),
    )
