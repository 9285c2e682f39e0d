"""What differs between the simulated engines, in one table: error wording and shape, metric names.

Sources of the exact strings (only the wording and names are taken from the engines):

- vLLM, current (renderer/`VLLMValidationError`, `{"error": {...}}` envelope since ~0.10): context
  error as returned by vllm-ascend in vllm-project/vllm-ascend#11557 (2026-07) and in many client
  reports; the prompt count is a lower bound ("at least") because vLLM stops tokenizing one token
  past the room left, so it reports `min(prompt, limit - output + 1)`. `VLLMValidationError.__str__`
  appends ` (parameter=input_tokens, value=N)`. Unknown model: `_check_model` in
  `vllm/entrypoints/serve/engine/serving.py` (0.32: 404 `NotFoundError`, param "model", the base
  model names after "Valid aliases:").
- vLLM, legacy (≤ 0.9, `serving_engine._validate_input`, flat `{"object": "error", ...}`).
- SGLang (`TokenizerManager._validate_one_request`; flat `ErrorResponse` via
  `OpenAIServingBase.create_error_response`); unknown model: SGLang's strict model validation test
  (400, "The model `X` does not exist" ... "The served model name is `Y`"). Before PR #21900
  (2026-04) a streaming request's context error came as `data: {"error": {...}}` in a 200 stream.
- Metric names: vLLM V1 `PrometheusStatLogger` in `vllm/v1/metrics/loggers.py` (labels
  `model_name`, `engine`): counters `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (in
  tokens; named `vllm:gpu_prefix_cache_*` before 0.9's rename) and the gauge
  `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before). SGLang's
  `python/sglang/srt/metrics/collector.py` (label `model_name`): `SchedulerMetricsCollector`
  gauges `sglang:token_usage` and `sglang:cache_hit_rate`, `TokenizerMetricsCollector` counter
  `sglang:cached_tokens_total`.
- Preemption counters: vLLM's `vllm:num_preemptions` (same `PrometheusStatLogger`, a counter, so
  `vllm:num_preemptions_total` on the wire, also before V1); SGLang's
  `sglang:num_retracted_requests_total` (`SchedulerMetricsCollector`, named "requests" beside the
  older per-batch gauge `sglang:num_retracted_reqs`, which the simulator does not expose).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.sim.config import ApiVersion, SimConfig, SimEngineKind
from gateway.sim.responses import AnswerShape
from gateway.sim.tokens import FieldValidationError

VLLM_VERSION = "0.32.0"
"""The vLLM release whose answers the vLLM family's "current" dialect imitates (its `system_fingerprint`)."""


@dataclass(frozen=True)
class ErrorReply:
    """An error answer: HTTP status and exact body bytes (JSON).

    `in_band_stream` marks legacy SGLang's behaviour for streaming requests: HTTP 200 with
    `stream_event` as one SSE data event followed by `data: [DONE]`.
    """

    status: int
    body: bytes
    in_band_stream: bool = False
    stream_event: bytes = b""
    app_wide: bool = False
    """Answered by the engine's app-wide exception handler (request validation): the same OpenAI
    error shape on every route, `/v1/messages` included."""


@dataclass(frozen=True)
class MetricNames:
    """Prometheus names an engine exposes (counters without the `_total` suffix)."""

    running: str
    waiting: str
    kv_usage: str
    prompt_tokens: str
    generation_tokens: str
    request_success: str | None = None
    prefix_cache_queries: str | None = None
    """Counter of prompt tokens looked up in the prefix cache (vLLM)."""
    prefix_cache_hits: str | None = None
    """Counter of prompt tokens found in the prefix cache (vLLM: `..._hits`; SGLang: `cached_tokens`)."""
    cache_hit_rate: str | None = None
    """Gauge of the recent prefix-cache hit rate, 0 to 1 (SGLang)."""
    preemptions: str | None = None
    """Counter of running requests preempted (vLLM) or retracted (SGLang) for KV-cache room."""
    process_start_time: bool = False
    """Whether `/metrics` also has prometheus_client's process collector gauge
    `process_start_time_seconds` (the serving process' start, unix s). vLLM's one API server serves
    prometheus_client's default registry, which holds it (`vllm/v1/metrics/prometheus.py`
    `get_prometheus_registry`); with `--api-server-count` > 1 it serves a multiprocess registry,
    which does not (`vllm/entrypoints/cli/serve.py`), and SGLang always does
    (`python/sglang/srt/utils/common.py` `add_prometheus_middleware`): False."""


ContextCheck = Callable[[int, int | None, int, str, bool], tuple[str, str | None] | None]
"""(prompt tokens, requested output tokens or None, max context, the output limit's field name,
whether the request generates) -> (error message, its `param`) or None."""


@dataclass(frozen=True)
class EngineDialect:
    """How one engine (at one API version) words and shapes its answers."""

    engine: SimEngineKind
    api_version: ApiVersion
    owned_by: str
    nested_errors: bool
    """True: `{"error": {message, type, param, code}}`; False: `{"object": "error", message, ...}`."""
    context_check: ContextCheck
    model_not_found: Callable[[str, list[str]], tuple[int, str, str | None]] | None
    """(requested, the base model's served names) -> (status, message, param); None = any model name is accepted."""
    metric_names: MetricNames
    metric_labels: Callable[[str], dict[str, str]]
    in_band_stream_errors: bool = False
    answer_shape: AnswerShape = dataclasses.field(default_factory=AnswerShape)
    """Chat and text answers' engine-specific fields (`gateway.sim.responses`), without the fingerprint."""
    fingerprints: bool = False
    """Answers carry vLLM's `system_fingerprint` (`fingerprint`)."""

    def shape_for(self, config: SimConfig) -> AnswerShape:
        """`answer_shape` with the worker's `system_fingerprint` where the engine sets one."""
        return dataclasses.replace(self.answer_shape, fingerprint=self.fingerprint(config))

    def fingerprint(self, config: SimConfig) -> str | None:
        """vLLM's default (`full`) `system_fingerprint` for a single-GPU server,
        `vllm-<version>-<first 8 hex digits of the config hash>`
        (`vllm/entrypoints/serve/utils/fingerprint.py` `build_system_fingerprint`; the simulator hashes
        its own config, so one worker's fingerprint is stable and two configs' differ); None for engines
        without one."""
        if not self.fingerprints:
            return None
        digest = hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:8]
        return f"vllm-{VLLM_VERSION}-{digest}"

    def error(self, message: str, err_type: str, status: int, param: str | None = None) -> ErrorReply:
        """An error object in this engine's JSON shape."""
        inner = {"message": message, "type": err_type, "param": param, "code": status}
        payload = {"error": inner} if self.nested_errors else {"object": "error", **inner}
        return ErrorReply(status=status, body=orjson.dumps(payload))

    def stream_error(self, message: str, err_type: str, status: int) -> bytes:
        """The SSE event an engine writes when a stream fails after it began: vLLM's
        `create_streaming_error_response` (`vllm/entrypoints/openai/engine/serving.py`: its
        `ErrorResponse`, `{"error": {...}}`), SGLang's (`srt/entrypoints/openai/serving_base.py`:
        `json.dumps({"error": ErrorResponse})`, its flat error object nested under `error`)."""
        inner = {"message": message, "type": err_type, "param": None, "code": status}
        if self.nested_errors:
            return b"data: " + orjson.dumps({"error": inner}) + b"\n\n"
        return b"data: " + json.dumps({"error": {"object": "error", **inner}}).encode() + b"\n\n"

    def bad_request(self, message: str, param: str | None = None) -> ErrorReply:
        """A 400 `BadRequestError` in this engine's shape."""
        return self.error(message, "BadRequestError", 400, param)

    def validation_error(self, exc: FieldValidationError) -> ErrorReply:
        """The engines' FastAPI `RequestValidationError` answer: 400, type "Bad Request"
        (`HTTPStatus.BAD_REQUEST.phrase`), in this engine's OpenAI shape on every route. vLLM 0.32's
        handler (`validation_exception_handler` in
        `vllm/entrypoints/serve/exception_handling/handlers/validation.py`) words it from the errors
        (`vllm_validation_message`) and sets `param` to the first error's `loc` joined with dots
        ("body.max_tokens"); the legacy vLLM and the SGLang dialects say `str(exc)` with `param` null."""
        if self.engine in ("vllm", "ascend") and self.api_version == "current":
            param = ".".join(str(part) for part in exc.errors[0]["loc"]) if exc.errors else None
            reply = self.error(vllm_validation_message(exc.errors), "Bad Request", 400, param)
        else:
            reply = self.error(str(exc), "Bad Request", 400)
        return dataclasses.replace(reply, app_wide=True)

    def check_context(self, prompt_tokens: int, requested_output: int | None, max_context: int,
                      stream: bool, output_param: str = "max_tokens", generate: bool = True) -> ErrorReply | None:
        """The engine's answer to a request that does not fit its context window, else None.
        `output_param` names the body field of `requested_output`; `generate` False for a request
        that generates nothing (the pooling APIs)."""
        refused = self.context_check(prompt_tokens, requested_output, max_context, output_param, generate)
        if refused is None:
            return None
        message, param = refused
        reply = self.bad_request(message, param)
        if stream and self.in_band_stream_errors:
            # SGLang serialised its streaming error with json.dumps (spaces, ASCII escapes).
            inner = {"object": "error", "message": message, "type": "BadRequestError", "param": None,
                     "code": 400}
            event = b"data: " + json.dumps({"error": inner}).encode() + b"\n\n"
            return ErrorReply(200, reply.body, in_band_stream=True, stream_event=event)
        return reply

    def check_model(self, requested: str | None, served: list[str], base: list[str]) -> ErrorReply | None:
        """The engine's answer to a request naming none of the `served` names (base model names and
        LoRA adapters), else None; `base` are the base model's names, which the answer may list."""
        if self.model_not_found is None or requested is None or requested in served:
            return None
        status, message, param = self.model_not_found(requested, base)
        err_type = "NotFoundError" if status == 404 else "BadRequestError"
        return self.error(message, err_type, status, param)


# --- request validation wording ------------------------------------------------------------------

_MAX_REPORTED_ERRORS = 10
_MAX_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


def _summarized_input(value: Any) -> Any:
    """vLLM's bound on an error's echoed `input` (`_summarize_error_input`): long text cut, containers
    described, other values as their text."""
    if isinstance(value, str):
        return value[:_MAX_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_INPUT_CHARS else value
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:_MAX_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_INPUT_CHARS else text


def vllm_validation_message(errors: list[dict[str, Any]]) -> str:
    """vLLM 0.32's RequestValidationError message (`validation_exception_handler`, `_format_error`):
    "N validation error(s):" and one line per error (at most 10, then "...and M more"), each the error's
    dict with `loc` joined with dots and `input` summarized, cut at 1000 characters. (The simulator's
    `loc`s hold field names only, so vLLM's removal of pydantic's internal segments does nothing here.)"""
    if not errors:
        return "Validation error"
    label = "error" if len(errors) == 1 else "errors"
    lines = []
    for error in errors[:_MAX_REPORTED_ERRORS]:
        shown = dict(error)
        if "input" in shown:
            shown["input"] = _summarized_input(shown["input"])
        shown["loc"] = ".".join(str(part) for part in shown.get("loc", ()))
        text = str(shown)
        lines.append(text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text)
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {line}\n" for line in lines)
    if len(errors) > _MAX_REPORTED_ERRORS:
        message += f"  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}\n"
    return message.rstrip()


# --- context-length wording ---------------------------------------------------------------------


def vllm_context_error(prompt: int, output: int | None, limit: int, output_param: str = "max_tokens",
                       generate: bool = True) -> tuple[str, str | None] | None:
    """vLLM 0.32: refuses an output limit over the whole context (`TokenizeParams.__post_init__`,
    vllm/renderers/params.py), a prompt over it (`TokenizeParams._token_len_check`: its tokenizer
    stops at max_model_len + 1 tokens, hence "at least") and, when it generates, a prompt of exactly
    max_model_len (`get_max_tokens`, vllm/entrypoints/serve/utils/api_utils.py, leaves it 0 output
    tokens, which `SamplingParams._verify_args` refuses). A prompt that fits with an output limit
    that does not is served: the limit is shortened to what is left (`clamped_output`). Messages
    carry `VLLMValidationError`'s " (parameter=..., value=...)" suffix (vllm/exceptions.py)."""
    if output is not None and output > limit:
        return (f"{output_param}={output} cannot be greater than max_model_len={limit}. Please request fewer "
                f"output tokens. (parameter={output_param}, value={output})", output_param)
    if prompt > limit:
        shown = limit + 1
        return (f"This model's maximum context length is {limit} tokens. However, your prompt contains at least "
                f"{shown} input tokens, which exceeds this limit even without any output tokens. Please reduce "
                f"the length of the input prompt. (parameter=input_tokens, value={shown})", "input_tokens")
    if generate and prompt == limit:
        return "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens"
    return None


def vllm_legacy_context_error(prompt: int, output: int | None, limit: int, output_param: str = "max_tokens",
                              generate: bool = True) -> tuple[str, str | None] | None:
    """vLLM ≤ 0.9: the classic "(N in the messages, M in the completion)" wording; it refused
    prompt + max_tokens over the context."""
    if output is None:
        if prompt < limit:
            return None
        return (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt} tokens in the messages, Please reduce the length of the messages."
        ), None
    if prompt + output <= limit:
        return None
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt + output} tokens ({prompt} in the messages, {output} in the completion). "
        f"Please reduce the length of the messages or completion."
    ), None


def sglang_context_error(prompt: int, output: int | None, limit: int, output_param: str = "max_tokens",
                         generate: bool = True) -> tuple[str, str | None] | None:
    """SGLang 0.5.23: an output limit over the context (`OpenAIServingChat._validate_request`,
    python/sglang/srt/entrypoints/openai/serving_chat.py), an input of context_len tokens or more,
    and input + max_new_tokens over context_len (`TokenizerManager._validate_one_request`,
    python/sglang/srt/managers/tokenizer_manager.py; a total of exactly context_len is served)."""
    if output is not None and output > limit:
        return (
            f"max_completion_tokens is too large: {output}."
            f"This model supports at most {limit} completion tokens."
        ), None
    if prompt >= limit:
        return f"The input ({prompt} tokens) is longer than the model's context length ({limit} tokens).", None
    if output is not None and prompt + output > limit:
        return (
            f"Requested token count exceeds the model's maximum context length of {limit} tokens. "
            f"You requested a total of {prompt + output} tokens: {prompt} tokens from the input "
            f"messages and {output} tokens for the completion. Please reduce the number of tokens in "
            f"the input messages or the completion to fit within the limit."
        ), None
    return None


# --- unknown model wording ----------------------------------------------------------------------


def _vllm_model_not_found(requested: str, served: list[str]) -> tuple[int, str, str | None]:
    return 404, f"The model `{requested}` does not exist. Valid aliases: {', '.join(served)}.", "model"


def _vllm_legacy_model_not_found(requested: str, served: list[str]) -> tuple[int, str, str | None]:
    return 404, f"The model `{requested}` does not exist.", None


def _sglang_model_not_found(requested: str, served: list[str]) -> tuple[int, str, str | None]:
    return 400, f"The model `{requested}` does not exist. The served model name is `{served[0]}`.", None


# --- metric names -------------------------------------------------------------------------------

VLLM_METRICS = MetricNames(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage="vllm:kv_cache_usage_perc",
    prompt_tokens="vllm:prompt_tokens",
    generation_tokens="vllm:generation_tokens",
    request_success="vllm:request_success",
    prefix_cache_queries="vllm:prefix_cache_queries",
    prefix_cache_hits="vllm:prefix_cache_hits",
    preemptions="vllm:num_preemptions",
    process_start_time=True,
)
VLLM_LEGACY_METRICS = dataclasses.replace(VLLM_METRICS, kv_usage="vllm:gpu_cache_usage_perc",
                                          prefix_cache_queries="vllm:gpu_prefix_cache_queries",
                                          prefix_cache_hits="vllm:gpu_prefix_cache_hits")
SGLANG_METRICS = MetricNames(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage="sglang:token_usage",
    prompt_tokens="sglang:prompt_tokens",
    generation_tokens="sglang:generation_tokens",
    prefix_cache_hits="sglang:cached_tokens",
    cache_hit_rate="sglang:cache_hit_rate",
    preemptions="sglang:num_retracted_requests",
)


def _vllm_labels(model: str) -> dict[str, str]:
    return {"model_name": model, "engine": "0"}


def _sglang_labels(model: str) -> dict[str, str]:
    return {"model_name": model}


def _vllm_family(engine: SimEngineKind, api_version: ApiVersion) -> EngineDialect:
    legacy = api_version == "legacy"
    return EngineDialect(
        engine=engine,
        api_version=api_version,
        owned_by="vllm",
        nested_errors=not legacy,
        context_check=vllm_legacy_context_error if legacy else vllm_context_error,
        model_not_found=_vllm_legacy_model_not_found if legacy else _vllm_model_not_found,
        metric_names=VLLM_LEGACY_METRICS if legacy else VLLM_METRICS,
        metric_labels=_vllm_labels,
        answer_shape=AnswerShape() if legacy else AnswerShape(drop_empty_tool_calls=True, reasoning_field="reasoning",
                                                              created_cache_tokens=True),
        fingerprints=not legacy,
    )


def _sglang(api_version: ApiVersion) -> EngineDialect:
    legacy = api_version == "legacy"
    return EngineDialect(
        engine="sglang",
        api_version=api_version,
        owned_by="sglang",
        nested_errors=False,
        context_check=sglang_context_error,
        model_not_found=None if legacy else _sglang_model_not_found,
        metric_names=SGLANG_METRICS,
        metric_labels=_sglang_labels,
        in_band_stream_errors=legacy,
    )


DIALECTS: dict[tuple[SimEngineKind, ApiVersion], EngineDialect] = {
    ("vllm", "current"): _vllm_family("vllm", "current"),
    ("vllm", "legacy"): _vllm_family("vllm", "legacy"),
    ("ascend", "current"): _vllm_family("ascend", "current"),
    ("ascend", "legacy"): _vllm_family("ascend", "legacy"),
    ("sglang", "current"): _sglang("current"),
    ("sglang", "legacy"): _sglang("legacy"),
}


def dialect_for(engine: SimEngineKind, api_version: ApiVersion = "current") -> EngineDialect:
    """The dialect of `engine` at `api_version`."""
    return DIALECTS[(engine, api_version)]
