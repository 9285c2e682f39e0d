"""What differs per engine kind, in one table (design §6).

Sources: vLLM's metrics (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`) and SGLang's (`sglang:num_running_reqs`, `sglang:num_queue_reqs`,
`sglang:token_usage`) as those engines export them on `/metrics`; llama.cpp's server exports
`llamacpp:requests_processing` / `llamacpp:requests_deferred` with `--metrics`. vllm-ascend keeps
vLLM's API and names. The "prompt too long" wordings are the engines' own 400 messages (vLLM 0.32's
renderer, `vllm/renderers/params.py`, its input processor and Responses serving; SGLang's tokenizer
manager; llama.cpp's `exceed_context_size_error`). What each kind serves near its context is
`EngineSpec.accepts` (docs/routing.md "Context fit").
Which APIs honour `max_completion_tokens`: vLLM's and SGLang's `CompletionRequest` (their
`entrypoints/openai/protocol.py`) have only `max_tokens` (default 16), their `ChatCompletionRequest`
both; llama.cpp's server (xllamacpp 2026.10, measured) reads it on both APIs.

Which APIs each kind serves (`EngineSpec.apis`): every kind serves OpenAI chat and completions.
Anthropic's Messages API (`/v1/messages`, streamed with `event:` lines) is served by vLLM's
`vllm/entrypoints/anthropic` layer (since v0.11.1; `/v1/messages/count_tokens` since PR #35588,
2026-03), by SGLang (PR #18630, 2026-02: both endpoints) and by llama.cpp's server (xllamacpp
2026.10, measured with gateway/llamacpp_worker: both endpoints). Ascend pools run vllm-ascend, a plugin
under vLLM's own API server, so they serve what vLLM serves. A pool on an engine version older
than those, or on another server (MindIE has no Messages API), lists what it serves in its config
(`PoolConfig.apis`). OpenAI's Responses API (`/v1/responses`): vLLM serves it with GET and cancel by
id and stores responses in its process memory (with `VLLM_ENABLE_RESPONSES_API_STORE=1`;
entrypoints/openai/serving_responses.py), SGLang's serving_responses (adapted from vLLM's) the same
way; llama.cpp's server answers it statelessly and refuses `previous_response_id` (xllamacpp
2026.10, measured), hence `stores_responses=False`.

The pooling APIs (`names.POOLING_APIS`: `/v1/embeddings`, `/v1/rerank`, `/v1/score`) are served by
no kind by default: an engine serves them only when it runs a pooling model. vLLM registers their
routes only for a model whose supported tasks include `embed` / `score` (`--runner pooling`;
`vllm/entrypoints/pooling/__init__.py` and the routers in `vllm/entrypoints/pooling/*/api_router.py`;
older releases answered "The model does not support Embeddings API"), SGLang embeds only with
`--is-embedding` (`python/sglang/srt/entrypoints/http_server.py`), llama.cpp's server only with
`--embeddings` / `--reranking` (`tools/server/server.cpp`). A generative Kimi K3 pool serves none of
them, so a pool that does lists them in its `apis` (`PoolConfig.apis`).

Health probes (`EngineSpec.probe`, the table `PROBES` below; `gateway/backends/health.py` uses it,
and deployment probes can read it): each kind is probed on an endpoint that answers at once without
running a generation, so a worker busy with a long prefill stays healthy.

- vllm, ascend: `/health`, answers at once. `EngineClient.check_health()`: the engine core process
  is alive, no generation; 503 once it died (`vllm/entrypoints/serve/instrumentator/health.py`).
- sglang: `/ready`, answers at once: 200 while the tokenizer manager is ready (the warm-up request
  set it Up), 503 while it starts, is paused or shuts down; no scheduler round trip
  (`python/sglang/srt/entrypoints/http_server.py` `ready`, SGLang 0.5.23).
- llamacpp: `/health`, answers at once: 200 once the model is loaded, 503 while it loads
  (`tools/server/server.cpp`).

SGLang's own `/health` is `/health_generate` (unless the engine runs with
`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`, `python/sglang/srt/environ.py`): it submits a
one-token generation (`input_ids=[0]`, `max_new_tokens=1`) and polls once a second for any output
of the scheduler after it started, so it never answers in under 1 s, and answers 503 after
`SGLANG_HEALTH_CHECK_TIMEOUT` (20 s) without output: a busy scheduler answers it only at the end of
its current forward step, so a long prefill step fails it. `/get_model_info` is a deprecated alias
of `/model_info` that logs a warning per call; `/server_info` (`/get_server_info`) asks the
scheduler for its internal state, so it waits for the current step too.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.backends.params import EngineKind
from gateway.dialects.names import APIS, CHAT, COMPLETIONS, POOLING_APIS


@dataclass(frozen=True, slots=True)
class HealthProbe:
    """How one engine kind is probed for health (the module docstring's table).

    `path` is the endpoint (GET, 200 = healthy); `latency_s` how long the engine itself takes to
    answer it when healthy (seconds; 0 = at once), added to `health.timeout` (`timeout`); `source`
    the engine file its behaviour is read from.
    """

    path: str
    latency_s: float
    source: str

    def timeout(self, configured: float) -> float:
        """The probe's deadline (seconds): the configured `health.timeout` plus the engine's own
        answer time."""
        return configured + self.latency_s


PROBES: dict[str, HealthProbe] = {
    "vllm": HealthProbe("/health", 0.0, "vllm/entrypoints/serve/instrumentator/health.py"),
    "ascend": HealthProbe("/health", 0.0, "vllm/entrypoints/serve/instrumentator/health.py"),
    "sglang": HealthProbe("/ready", 0.0, "python/sglang/srt/entrypoints/http_server.py"),
    "llamacpp": HealthProbe("/health", 0.0, "tools/server/server.cpp"),
}
"""Engine kind -> its health probe (module docstring)."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Per-engine facts: health probe, load metric names, context-error wordings (lower case)."""

    kind: EngineKind
    probe: HealthProbe
    running_metric: str | None
    waiting_metric: str | None
    kv_usage_metrics: tuple[str, ...]  # first one present wins (renamed across engine versions)
    too_long_markers: tuple[str, ...]
    supports_include_usage: bool = True
    # Tokens of its context the engine will not fill with a prompt that generates nothing (the
    # pooling APIs): SGLang refuses an input of context_len tokens or more on every path
    # (TokenizerManager._validate_one_request), vLLM only a prompt over max_model_len.
    context_slack_tokens: int = 0
    # Whether the engine shortens an output limit the context cannot hold after the prompt to what it
    # can (the answer ends with finish_reason "length") instead of refusing the request; see `accepts`.
    clamps_output: bool = True
    # Whether it refuses an output limit larger than its whole context even so (vLLM).
    output_within_context: bool = False
    # The output limit of a completions request that sets no `max_tokens` (their CompletionRequest's
    # default, 16); None: it generates to the end of the context (llama.cpp's n_predict -1).
    completions_default_output: int | None = 16
    # APIs (chat, completions) on which the engine reads `max_completion_tokens`; elsewhere it
    # ignores the field and generates its default (16 tokens), so the gateway sends `max_tokens`.
    max_completion_tokens_apis: frozenset[str] = frozenset({CHAT})
    # The proxied APIs the engine serves (`gateway.dialects.names.Api`) by default: all but the pooling
    # APIs, which a pool running a pooling model lists in its `apis`; see the module docstring.
    apis: frozenset[str] = frozenset(APIS) - POOLING_APIS
    # Whether the engine keeps stored responses (`store`, `previous_response_id`, GET/cancel by id):
    # the gateway records a response's worker only on such engines.
    stores_responses: bool = True
    # Whether its Messages usage counts the cached prompt inside `input_tokens` and again as
    # `cache_read_input_tokens` (SGLang's `srt/entrypoints/anthropic/serving.py`), not apart as
    # Anthropic does and vLLM 0.32 does (`vllm/entrypoints/anthropic/serving.py`
    # `_build_anthropic_usage`: `input_tokens` the uncached part; in a stream only `message_delta`
    # splits it, `message_start` has the whole prompt): `gateway.protocol.anthropic.openai_usage`,
    # `merge_stream_usage`.
    messages_cache_in_input: bool = False

    def accepts(self, prompt: int, output: int | None, context: int) -> bool:
        """Whether the engine serves a prompt of `prompt` tokens with output limit `output` (tokens;
        None: no limit, 0: a request that generates nothing) on a context of `context` tokens.

        Every kind refuses a prompt that leaves no token of its context for output. vLLM 0.32
        refuses a prompt over max_model_len (`vllm/renderers/params.py` `TokenizeParams._token_len_check`:
        `max_input_tokens` is the whole context, the output limit no longer taken off it) and one of
        exactly max_model_len (`get_max_tokens` in `vllm/entrypoints/serve/utils/api_utils.py` leaves it
        0 output tokens, which `SamplingParams._verify_args` refuses), refuses an output limit over
        max_model_len (`TokenizeParams.__post_init__`) and otherwise clamps the limit to max_model_len
        - prompt (`get_max_tokens`). SGLang 0.5.23 refuses an input of context_len tokens or more and
        input + max_new_tokens over context_len (`TokenizerManager._validate_one_request` in
        `python/sglang/srt/managers/tokenizer_manager.py`). llama.cpp's server refuses a prompt of
        n_ctx tokens or more (`exceed_context_size_error`) and stops the output where prompt + output
        reach n_ctx (`tools/server/server-context.cpp`; measured, gateway/llamacpp_worker/README.md)."""
        if output == 0:
            return prompt + self.context_slack_tokens <= context
        if prompt >= context:
            return False
        if output is None:
            return True
        if self.clamps_output:
            return not self.output_within_context or output <= context
        return prompt + output <= context

    def default_output(self, api: str, prompt: int, context: int) -> int:
        """The output limit (tokens) the engine applies to a request of `api` that sets none: what is
        left of the context after the prompt (vLLM: `get_max_tokens`, and the engine core's
        `max_model_len - prompt_len` in `vllm/v1/engine/input_processor.py`; SGLang: `max_new_tokens`
        left None by its chat and Responses layers, which the scheduler clamps to the context,
        `Scheduler.init_req_max_new_tokens`; its `SamplingParams` default of 128 is the native
        `/generate` API's), except on completions (`completions_default_output`)."""
        if api == COMPLETIONS and self.completions_default_output is not None:
            return self.completions_default_output
        return max(context - prompt, 0)


_VLLM_TOO_LONG = (
    # 0.32: "This model's maximum context length is N tokens. However, your prompt contains at least M
    # input tokens, which exceeds this limit even without any output tokens." (renderers/params.py);
    # before: "... However, you requested M output tokens and your prompt contains ..."
    "maximum context length",
    # "The decoder prompt (length N) is longer than the maximum model length of M"
    "longer than the maximum model length",
    # Responses API: "The engine prompt length N exceeds the max_model_len M. Please reduce prompt."
    "exceeds the max_model_len",
    # 0.32, an output limit over the whole context: "max_tokens=N cannot be greater than max_model_len=M."
    "cannot be greater than max_model_len",
)

# vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (v1 engine); accept both.
_VLLM_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")

ENGINES: dict[str, EngineSpec] = {
    "vllm": EngineSpec("vllm", PROBES["vllm"], "vllm:num_requests_running", "vllm:num_requests_waiting",
                       _VLLM_KV, _VLLM_TOO_LONG, output_within_context=True),
    "ascend": EngineSpec("ascend", PROBES["ascend"], "vllm:num_requests_running", "vllm:num_requests_waiting",
                         _VLLM_KV, _VLLM_TOO_LONG, output_within_context=True),
    "sglang": EngineSpec("sglang", PROBES["sglang"], "sglang:num_running_reqs", "sglang:num_queue_reqs",
                         ("sglang:token_usage",), (
                             "longer than the model's context length",  # "The input (N tokens) is longer than ..."
                             "exceeds the model's maximum context length",
                             "maximum context length",
                         ), context_slack_tokens=1, clamps_output=False, messages_cache_in_input=True),
    # llama.cpp's server (xllamacpp 2026.10) exports no KV usage gauge.
    "llamacpp": EngineSpec("llamacpp", PROBES["llamacpp"], "llamacpp:requests_processing",
                           "llamacpp:requests_deferred", (), (
                               "exceed_context_size_error",
                               "exceeds the available context size",
                           ), max_completion_tokens_apis=frozenset({CHAT, COMPLETIONS}),
                           stores_responses=False, completions_default_output=None),
}

# Any engine's wording counts: a pool mislabelled in config still gets the right retry.
_ALL_TOO_LONG = tuple(sorted({m for spec in ENGINES.values() for m in spec.too_long_markers}))


def is_context_too_long(status: int, body: bytes) -> bool:
    """True when an engine's error answer says the prompt does not fit its context (any engine)."""
    if status not in (400, 413, 422):
        return False
    text = body[:8192].decode("utf-8", "replace").lower()
    return any(marker in text for marker in _ALL_TOO_LONG)
