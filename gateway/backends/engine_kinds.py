"""What differs per engine kind, in one table (design §6).

Sources: vLLM's metrics (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`) and SGLang's (`sglang:num_running_reqs`, `sglang:num_queue_reqs`,
`sglang:token_usage`) as those engines export them on `/metrics`; llama.cpp's server exports
`llamacpp:requests_processing` / `llamacpp:requests_deferred` with `--metrics`. vllm-ascend keeps
vLLM's API and names. The "prompt too long" wordings are the engines' own 400 messages (vLLM's
serving_engine / input processor, SGLang's tokenizer manager, llama.cpp's `exceed_context_size_error`).
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
- sglang: `/model_info`, answers at once: the tokenizer manager's model facts, no scheduler round
  trip (`python/sglang/srt/entrypoints/http_server.py` `model_info`).
- llamacpp: `/health`, answers at once: 200 once the model is loaded, 503 while it loads
  (`tools/server/server.cpp`).

SGLang's own `/health` is `/health_generate` (unless the engine runs with
`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`, `python/sglang/srt/environ.py`): it submits a
one-token generation (`input_ids=[0]`, `max_new_tokens=1`) and polls once a second for any output
of the scheduler after it started, so it never answers in under 1 s, and answers 503 after
`SGLANG_HEALTH_CHECK_TIMEOUT` (20 s) without output: a busy scheduler answers it only at the end of
its current forward step, so a long prefill step fails it. `/get_model_info` is a deprecated alias
of `/model_info` that logs a warning per call; `/server_info` (`/get_server_info`) asks the
scheduler for its internal state, so it waits for the current step too. SGLang has no `/ready`.
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
    "sglang": HealthProbe("/model_info", 0.0, "python/sglang/srt/entrypoints/http_server.py"),
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
    # Tokens of its max context the engine will not fill: SGLang refuses prompt + max_new_tokens
    # >= context_len (TokenizerManager._validate_one_request), vLLM only > max_model_len.
    context_slack_tokens: int = 0
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


_VLLM_TOO_LONG = (
    "maximum context length",  # "This model's maximum context length is N tokens. However, you requested M"
    # "The decoder prompt (length N) is longer than the maximum model length of M"
    "longer than the maximum model length",
    # Responses API: "The engine prompt length N exceeds the max_model_len M. Please reduce prompt."
    "exceeds the max_model_len",
)

# vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (v1 engine); accept both.
_VLLM_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")

ENGINES: dict[str, EngineSpec] = {
    "vllm": EngineSpec("vllm", PROBES["vllm"], "vllm:num_requests_running", "vllm:num_requests_waiting",
                       _VLLM_KV, _VLLM_TOO_LONG),
    "ascend": EngineSpec("ascend", PROBES["ascend"], "vllm:num_requests_running", "vllm:num_requests_waiting",
                         _VLLM_KV, _VLLM_TOO_LONG),
    "sglang": EngineSpec("sglang", PROBES["sglang"], "sglang:num_running_reqs", "sglang:num_queue_reqs",
                         ("sglang:token_usage",), (
                             "longer than the model's context length",  # "The input (N tokens) is longer than ..."
                             "exceeds the model's maximum context length",
                             "maximum context length",
                         ), context_slack_tokens=1, messages_cache_in_input=True),
    # llama.cpp's server (xllamacpp 2026.10) exports no KV usage gauge.
    "llamacpp": EngineSpec("llamacpp", PROBES["llamacpp"], "llamacpp:requests_processing",
                           "llamacpp:requests_deferred", (), (
                               "exceed_context_size_error",
                               "exceeds the available context size",
                           ), max_completion_tokens_apis=frozenset({CHAT, COMPLETIONS}),
                           stores_responses=False),
}

# Any engine's wording counts: a pool mislabelled in config still gets the right retry.
_ALL_TOO_LONG = tuple(sorted({m for spec in ENGINES.values() for m in spec.too_long_markers}))


def is_context_too_long(status: int, body: bytes) -> bool:
    """True when an engine's error answer says the prompt does not fit its context (any engine)."""
    if status not in (400, 413, 422):
        return False
    text = body[:8192].decode("utf-8", "replace").lower()
    return any(marker in text for marker in _ALL_TOO_LONG)
