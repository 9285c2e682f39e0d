"""Configuration of one simulated inference engine (pydantic models).

`SimConfig` describes the engine a simulator impersonates (vLLM, SGLang or vllm-ascend), its
context window, its latency model and the faults it injects. `SimFaults` is the fault set; it can
be given at start-up, replaced at run time (`POST /sim/faults`) or overridden per request with a
body field `"x_sim_faults": {...}`.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.sim.stepper import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_DECODE_S_PER_SEQ,
    DEFAULT_DECODE_STEP_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
)

SimEngineKind = Literal["vllm", "sglang", "ascend"]
"""Simulated engine kinds. "ascend" is vllm-ascend: vLLM's API, wording and metric names."""

ApiVersion = Literal["current", "legacy"]
"""Which generation of the engine's API to mimic (see `SimConfig.api_version`)."""

MessagesUsage = Literal["vllm", "sglang", "sglang_message_stop", "llamacpp"]
"""Where an engine's Messages layer puts the usage (`gateway.sim.anthropic`)."""

BodyMode = Literal["normal", "trickle", "endless"]
"""How a probe endpoint sends its body (see `SimFaults.health_body`)."""

ApiKeyScope = Literal["engine", "all"]
"""Which paths `SimConfig.api_key` guards (see there)."""

PdRole = Literal["prefill", "decode"]
"""The role of a worker in a prefill/decode (PD) disaggregated deployment (see `gateway.sim.pd`)."""

PdProtocol = Literal["sglang", "vllm-nixl", "vllm-mooncake"]
"""How the two roles hand the KV cache over: SGLang's bootstrap rooms, or vLLM's
`kv_transfer_params` with the NixlConnector (pull) or the MooncakeConnector (push, shared
`transfer_id`); see `gateway.sim.pd`."""

SchedulerKind = Literal["per_request", "stepped"]
"""How a worker spends its time (see `SimConfig.scheduler`)."""

KvLoadFailurePolicy = Literal["fail", "recompute"]
"""vLLM's `KVTransferConfig.kv_load_failure_policy`: what a decode worker does when it cannot pull
the KV blocks a request names ("fail", the default: the request ends with an error; "recompute":
it prefills the prompt itself)."""


class SimFaults(BaseModel):
    """Faults a simulated engine injects. Every field defaults to "off".

    - `fail_status` / `fail_count` / `fail_body` / `retry_after_s`: answer generation requests with
      this HTTP status before doing any work. `fail_count` is how many requests fail (`None` = all);
      with global faults it counts down. `fail_body` is the exact JSON text to send (default: an
      error object in the engine's style). `retry_after_s` adds a `Retry-After` header,
      `fail_headers` any others (e.g. the `x-ratelimit-*` of a rate-limiting proxy in front).
    - `hang_before_headers`: accept the request but never send headers (the request is recorded as
      aborted once the client gives up).
    - `hang_health`: `GET /health` (and SGLang's other probe endpoints, `/health_generate`, `/ready` and
      `/model_info`) accepts the connection but never answers.
    - `health_body` / `metrics_body`: how the probe endpoints / `GET /metrics` send their body:
      "normal"; "trickle" (200 headers, then one byte every `trickle_interval_s` seconds, never
      ending); "endless" (200 headers, then 64 KiB writes as fast as the client reads, never
      ending). Both stop when the client leaves (hostile-endpoint tests of probes and scrapes).
    - `black_hole`: every request (generation, `/health`, `/metrics`) is accepted and never
      answered, as by a wedged engine process; a PD prefill worker's KV hand-over waits that end
      while it is set are not answered either (its decode partners hear nothing from a wedged engine).
    - `drop_after_chunks`: streaming only; after N SSE events, drop the connection without ending
      the chunked body, so the client sees an incomplete response (not a clean end).
    - `reset_after_chunks`: streaming only; after N SSE events, reset the connection (TCP RST:
      `SO_LINGER` 0, then the transport aborted): an engine host that went away, as the client
      sees a killed peer's kernel answer.
    - `stall_after_chunks`: streaming only; after N SSE events, send nothing more (the connection
      stays open) until the client leaves: an engine stuck mid-decode, caught by the reader's
      inter-token budget (`timeouts.read`).
    - `pause_after_chunks` / `pause_s`: streaming only; after N SSE events, send nothing for
      `pause_s` seconds, then go on as if nothing happened: a long silence inside a healthy stream
      (a slow tool call, a long reasoning step; heartbeat tests).
    - `error_after_chunks`: streaming only; after N SSE events, send the engine's in-band error
      event and `data: [DONE]`, and end the response: what vLLM's chat and completion stream
      generators do when generation raises mid-stream (`vllm/entrypoints/openai/serving_chat.py`
      `chat_completion_stream_generator`, `serving_completion.py`: `except Exception` yields
      `data: {create_streaming_error_response(...)}` and then `data: [DONE]`; SGLang's
      `serving_chat.py` `_generate_chat_stream` likewise, its event `{"error": {"object": "error", ...}}`:
      `SimDialect.stream_error`); on a Messages stream Anthropic's `error` event
      (`internal_error`) and the end, no `[DONE]`, as vLLM 0.32's Messages layer sends it
      (vllm/entrypoints/anthropic/serving.py `message_stream_converter`).
    - `cut_answer`: non-streaming only; a 200 answer's headers (with its whole `content-length`)
      and the first half of its body are sent, then the connection is dropped: an engine that dies
      while its answer is on the wire (the client reads an EOF before the body's end).
    - `null_max_tokens_500`: `/v1/completions` with `"max_tokens": null` gets HTTP 500 (an engine
      version that fails on the null instead of using its default, as reported in issue 10; the
      same answer on every worker, so it is the request's fault, not the workers').
    - `raw_stream_chunks`: streaming only; base64 byte strings sent as the whole response body,
      each as its own write with a ~20 ms pause in between (byte-exact relay tests).
    - `no_lora_routes`: the runtime LoRA load and unload paths answer FastAPI's 404 `Not Found`, as
      an engine restarted without runtime loading does (vLLM without
      VLLM_ALLOW_RUNTIME_LORA_UPDATING registers no such route).
    - `metrics_running_offset`: `GET /metrics` reports this many more running requests than run
      (a constant load offset: an engine that counts its own metrics scrape, or a monitoring
      request it always has, as a running request).
    """

    model_config = ConfigDict(extra="forbid")

    fail_status: int | None = Field(default=None, ge=100, le=599)
    fail_count: int | None = Field(default=None, ge=0)
    fail_body: str | None = None
    retry_after_s: int | None = Field(default=None, ge=0)
    fail_headers: dict[str, str] | None = None
    hang_before_headers: bool = False
    hang_health: bool = False
    health_body: BodyMode = "normal"
    metrics_body: BodyMode = "normal"
    trickle_interval_s: float = Field(default=0.1, gt=0.0)
    black_hole: bool = False
    drop_after_chunks: int | None = Field(default=None, ge=0)
    stall_after_chunks: int | None = Field(default=None, ge=0)
    reset_after_chunks: int | None = Field(default=None, ge=0)
    error_after_chunks: int | None = Field(default=None, ge=0)
    pause_after_chunks: int | None = Field(default=None, ge=0)
    pause_s: float = Field(default=1.0, gt=0.0)
    cut_answer: bool = False
    null_max_tokens_500: bool = False
    raw_stream_chunks: list[str] | None = None
    no_lora_routes: bool = False
    metrics_running_offset: int = Field(default=0, ge=0)

    @field_validator("raw_stream_chunks")
    @classmethod
    def _check_base64(cls, chunks: list[str] | None) -> list[str] | None:
        for chunk in chunks or []:
            try:
                base64.b64decode(chunk, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"raw_stream_chunks: not base64: {chunk[:40]!r}") from exc
        return chunks

    def raw_chunk_bytes(self) -> list[bytes] | None:
        """The decoded `raw_stream_chunks`, or None when unset."""
        if self.raw_stream_chunks is None:
            return None
        return [base64.b64decode(chunk) for chunk in self.raw_stream_chunks]

    def overridden_by(self, override: SimFaults) -> SimFaults:
        """These faults with every field explicitly set in `override` replaced by its value."""
        return self.model_copy(update={name: getattr(override, name) for name in override.model_fields_set})

    @staticmethod
    def encode_chunks(chunks: list[bytes]) -> list[str]:
        """Encode byte strings for `raw_stream_chunks` (test helper)."""
        return [base64.b64encode(chunk).decode("ascii") for chunk in chunks]


class SimConfig(BaseModel):
    """One simulated engine.

    Token accounting (no real tokenizer): prompt tokens = ceil(UTF-8 bytes of all prompt text /
    `bytes_per_token`) + `image_tokens` per image part + `message_overhead_tokens` per chat message.
    Output: one word per token; the count is `max_completion_tokens`, else `max_tokens`, else
    `default_output_tokens` (where the model stops by itself; None: it never does and runs to the end
    of the context; `eos_after_tokens`, `min_tokens` and `ignore_eos` move that end as the engines'
    sampling params do: `tokens.generated_count`), never more than the context leaves (`output_room`).
    Latency: `ttft_s` before the first token, `tpot_s` between tokens.

    Opt-in engine model (every field below defaults to today's behaviour):

    - `kv_capacity_tokens` turns on a prefix cache of that many tokens of KV memory, in blocks of
      `kv_block_tokens` (see `gateway.sim.kvcache`): cached prompt prefixes are reported as
      `usage.prompt_tokens_details.cached_tokens` and in the engine's prefix-cache metrics, and a
      request waits while its uncached tokens do not fit beside those of the running requests.
    - `prefill_tokens_per_s` makes the time to first token `ttft_s` + uncached prompt tokens /
      `prefill_tokens_per_s` (seconds).
    - `decode_batch_slowdown` makes each output token take `tpot_s` x (1 + `decode_batch_slowdown`
      x (running requests - 1)) seconds.
    - `keep_records=False` keeps only counters (`GET /sim/stats`), no per-request records;
      `timing_records=N` keeps the last N requests' times and token counts (`GET /sim/timings`).
    - `scheduler="stepped"` replaces the per-request timing above by one step scheduler per worker
      (`gateway.sim.stepper`): one prefill budget (`prefill_tokens_per_s`, default
      `DEFAULT_PREFILL_TOKENS_PER_S`) shared by concurrent prefills in chunks of `chunk_tokens`,
      decode steps of `decode_step_s` + `decode_s_per_seq` x batch, and, with
      `kv_capacity_tokens`, preemption when the KV cache is full. `ttft_s` is then a fixed delay
      before the request reaches the scheduler (the API server's share), and `tpot_s` /
      `decode_batch_slowdown` are not used.
    """

    model_config = ConfigDict(extra="forbid")

    engine: SimEngineKind
    served_model_names: list[str] = Field(default_factory=lambda: ["kimi-k3"], min_length=1)
    lora_modules: list[Annotated[str, Field(pattern=r"^[^=\s]+=\S+$")]] = Field(
        default_factory=list, description="LoRA adapters loaded at start, each `name=path` as vLLM's "
        "`--lora-modules` (vllm/entrypoints/openai/cli_args.py `LoRAParserAction`) and SGLang's `--lora-paths` "
        "take them: listed in /v1/models with `parent` (`models_list`) and served under their name")
    runtime_lora_updating: bool = Field(
        default=False, description="vLLM family: serve `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` "
        "(vLLM registers them only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; vllm-ascend likewise). SGLang "
        "always serves `POST /load_lora_adapter` and `/unload_lora_adapter`; this is its `--enable-lora` "
        "(also implied by `lora_modules`, its `--lora-paths`): without it they answer SGLang's 'LoRA is not "
        "enabled' refusal")
    enable_cache_report: bool = Field(
        default=True, description="SGLang's `--enable-cache-report`: its usage carries `prompt_tokens_details` "
        "(`cached_tokens`) only with it, and only when some prompt tokens were cached (`gateway.sim.sglang_shapes`)")
    tool_call_parser: str | None = Field(
        default="kimi_k2", description="vLLM family: the engine's `--tool-call-parser` (only whether one is set "
        "matters): without one vLLM refuses a `required` or named `tool_choice` "
        "(vllm/renderers/online_renderer.py); SGLang's `--tool-call-parser` likewise gates tool calls")
    enable_auto_tool_choice: bool = Field(
        default=True, description="vLLM's `--enable-auto-tool-choice`: without it and without a parser, "
        "`tool_choice: auto` (also what tools without a `tool_choice`, and Messages with tools, mean) is refused")
    lora_loadable_paths: list[str] | None = Field(
        default=None, description="adapter paths a runtime load finds (None: every path); another fails as "
        "the engine fails on a path without an adapter")
    max_loaded_loras: int | None = Field(
        default=None, ge=1, description="SGLang's `--max-loaded-loras`: adapters loaded at once (start-up ones "
        "included), a load beyond refused in SGLang's words (python/sglang/srt/managers/tokenizer_manager.py "
        "`load_lora_adapter`); None: no bound. vLLM has no such refusal: a runtime load past `--max-cpu-loras` "
        "drops its least recently used adapter from the CPU cache and keeps it listed and servable "
        "(vllm/lora/worker_manager.py `LRUCacheWorkerLoRAManager.add_adapter`), which this simulator does by "
        "doing nothing")
    max_context_tokens: int = Field(gt=0)
    pooling: bool = Field(
        default=False, description="also serve the pooling APIs (`/v1/embeddings`, `/v1/rerank`, `/v1/score`: "
        "`gateway.sim.pooling`), as vLLM does only for a pooling model; without it they are not found")
    embedding_dimensions: int = Field(default=64, ge=1, description="the length of an embedding vector before "
                                      "a request's `dimensions` shortens it")
    pooling_special_tokens: int = Field(
        default=0, ge=0, description="special tokens the simulated pooling model's tokenizer adds to each "
        "sequence it tokenizes from text: an embeddings text, a rerank or score pair (`gateway.sim.pooling`); "
        "a BERT cross-encoder adds 3 to a pair, XLM-RoBERTa 4")
    ttft_s: float = Field(default=0.0, ge=0.0)
    tpot_s: float = Field(default=0.0, ge=0.0)
    default_output_tokens: int | None = Field(
        default=16, ge=0, description="where the model ends by itself when the request sets no output limit "
        "(finish `stop`); None: it never does and runs to the end of the context, as vLLM and SGLang let a model "
        "that emits no end-of-sequence do (`output_room`), at `tpot_s` a token")
    eos_after_tokens: int | None = Field(
        default=None, ge=0, description="the model ends by itself after this many tokens under any output limit "
        "(finish `stop`); None: it runs to an explicit limit (`tokens.generated_count`)")
    bytes_per_token: float = Field(default=4.0, gt=0.0)
    image_tokens: int = Field(default=256, ge=0)
    message_overhead_tokens: int = Field(default=4, ge=0)
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Requests processed at once; the rest wait (and count as "waiting"). None = unlimited."""
    stream_headers_after_prefill: bool = False
    """False (what vLLM and SGLang do): a streaming response sends its 200 headers as soon as the
    request is validated and the first SSE event after `ttft_s`. True: hold the headers until the
    first token is ready."""
    api_version: ApiVersion = "current"
    messages_usage: Literal["engine"] | MessagesUsage = Field(
        default="engine", description="where the Messages API's usage goes (`gateway.sim.anthropic`): "
        "`engine` is the engine's own (SGLang's for sglang, vLLM's otherwise)")
    """"current" mimics the engines as of 2026; "legacy" mimics older releases: vLLM ≤ 0.9 flat
    `{"object": "error", ...}` errors with the "(N in the messages, M in the completion)" wording
    and `vllm:gpu_cache_usage_perc`; SGLang before 2026-04 (context errors of streaming requests
    arrive as an SSE error event inside a 200 response; any model name accepted)."""
    responses_delete: bool = False
    """Serve `DELETE /v1/responses/{id}` as OpenAI does (the stored response deleted:
    `{"id", "object": "response", "deleted": true}`), a server that can delete. False (vLLM 0.32 and
    SGLang: no such route, `vllm/entrypoints/openai/responses/api_router.py`): FastAPI's 405
    `{"detail": "Method Not Allowed"}` with `allow: GET` (`gateway.sim.responses_api`)."""
    faults: SimFaults = Field(default_factory=SimFaults)
    kv_capacity_tokens: int | None = Field(default=None, gt=0)
    """KV-cache memory of the worker in tokens; None = no prefix cache (cached_tokens always 0)
    and KV usage = tokens of running requests / `max_context_tokens`."""
    stream_interval: int = Field(default=1, ge=1)
    """Tokens per streamed chunk (the last chunk may hold fewer): vLLM's `--stream-interval`
    (`vllm/config/scheduler.py` `SchedulerConfig.stream_interval`, applied per request in
    `vllm/v1/engine/output_processor.py`) and SGLang's `--stream-interval`. A loaded vLLM also packs
    the tokens its API server has not yet read into one chunk (`RequestOutputCollector`), which
    this reproduces deterministically. Scripted tool-call answers stream one token per chunk."""
    kv_block_tokens: int = Field(default=16, gt=0)
    """Tokens per cache block. Cached tokens are reported in whole blocks, as vLLM reports them
    (`num_cached_tokens` is hit blocks x block size): its default block size is 16 on GPU, 128 on
    CPU (`vllm/platforms/cpu.py`) and on Ascend (vllm-ascend's platform). SGLang's radix cache
    matches per page (`--page-size`, 1 by default on most attention backends): 1 imitates it."""
    kv_usage_includes_cache: bool = False
    """False (what vLLM and SGLang report): KV usage counts tokens of running requests only, as
    cached blocks nobody uses are free to evict. True: cached blocks count too."""
    prefill_tokens_per_s: float | None = Field(default=None, gt=0.0)
    """Prefill speed in tokens per second; None = the prefill takes `ttft_s` whatever the prompt."""
    decode_batch_slowdown: float = Field(default=0.0, ge=0.0)
    """Extra time per output token per additional running request, as a fraction of `tpot_s`."""
    scheduler: SchedulerKind = "per_request"
    """"per_request": each request sleeps its own prefill and decode time (the fields above).
    "stepped": one scheduler loop per worker shares the prefill budget, batches decode steps and
    preempts under KV pressure (`gateway.sim.stepper`, which gives the sources of the defaults)."""
    chunk_tokens: int = Field(default=DEFAULT_CHUNK_TOKENS, gt=0)
    """Stepped: tokens per step (vLLM `max_num_batched_tokens`, SGLang `chunked_prefill_size`)."""
    decode_step_s: float = Field(default=DEFAULT_DECODE_STEP_S, ge=0.0)
    """Stepped: fixed time of every step, seconds."""
    decode_s_per_seq: float = Field(default=DEFAULT_DECODE_S_PER_SEQ, ge=0.0)
    """Stepped: extra step time per decoding sequence in the batch, seconds."""
    api_key: str | None = None
    """With a key, guarded paths answer 401 `{"error": "Unauthorized"}` (both engines' answer)
    unless the request carries `Authorization: Bearer <api_key>`; OPTIONS and `/sim/*` (test
    controls, not part of an engine) are never guarded."""
    api_key_scope: ApiKeyScope = "engine"
    """"engine": what the engine itself guards with `--api-key`: vLLM and vllm-ascend only paths
    under `/v1`, SGLang every path but `/health*` and `/metrics*`. "all": every path, as an
    authenticating proxy in front of the engine would."""
    health_generate_poll_s: float = Field(default=1.0, gt=0.0)
    """SGLang: how often its generating `/health` (`/health_generate`) looks for scheduler output,
    seconds: SGLang's handler sleeps 1 s per look (`python/sglang/srt/entrypoints/http_server.py`
    `health_generate`), so it never answers in under a second. Tests shorten it."""
    health_generate_timeout_s: float = Field(default=20.0, gt=0.0)
    """SGLang: how long its generating `/health` waits for scheduler output before answering 503,
    seconds (`SGLANG_HEALTH_CHECK_TIMEOUT`, 20 s)."""
    keep_records: bool = True
    """False: store no `SimRequestRecord`s (memory stays flat on long benchmarks); the counters
    of `GET /sim/stats` and `/metrics` are kept either way."""
    timing_records: int = Field(default=0, ge=0)
    """Keep the compact timings (`gateway.sim.timings`: times and token counts, no body) of the
    last this many generation requests for `GET /sim/timings`; 0 keeps none."""
    keep_alive_s: float = Field(default=5.0, gt=0.0)
    """Seconds an idle HTTP connection stays open between requests: uvicorn's
    `timeout_keep_alive`, whose default of 5 s vLLM and SGLang run with."""
    idle_close_unannounced: bool = False
    """True: a connection idle for `keep_alive_s` is dropped without telling the client, which
    learns it only when it sends its next request there (the connection is reset before any
    response byte). This is the race a pooled client meets when the engine's idle close crosses
    its request on the wire, or when a NAT or proxy in between forgot the connection, made
    deterministic. False: the idle close is a FIN the client sees at once (uvicorn)."""

    pd_role: PdRole | None = None
    """None: an aggregated worker. "prefill" / "decode": one side of a PD pair speaking
    `pd_protocol` (see `gateway.sim.pd` for the exact wire behaviour)."""
    pd_protocol: PdProtocol | None = None
    """Required with `pd_role`: "sglang" (needs `engine="sglang"`), "vllm-nixl" or
    "vllm-mooncake" (vLLM or vllm-ascend)."""
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    """SGLang and vLLM Mooncake prefill workers: the port of the bootstrap server
    (`--disaggregation-bootstrap-port`, 8998 by default in SGLang; `VLLM_MOONCAKE_BOOTSTRAP_PORT`,
    8998 by default) that `run_sim` serves beside the HTTP port. Tests may leave it unset and give
    routers the HTTP port: the sim answers the bootstrap calls there too."""
    pd_wait_timeout_s: float = Field(default=300.0, gt=0.0)
    """SGLang: how long a decode worker waits for its room's KV
    (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s) and a prefill worker for its decode partner
    to claim the room (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, 300 s). vLLM Mooncake: how long
    a decode worker waits for its transfer's KV (the sim's choice)."""
    kv_hold_timeout_s: float = Field(default=480.0, gt=0.0)
    """vLLM prefill workers: how long the blocks of a finished prefill are held for a decode worker
    to take (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s; Mooncake has the same kind of abort
    timeout); then they are freed and counted in `vllm:nixl_num_kv_expired_reqs` (NIXL)."""
    kv_load_failure_policy: KvLoadFailurePolicy = "fail"
    """vLLM NIXL decode workers: see `KvLoadFailurePolicy`."""
    kv_transfer_tokens_per_s: float | None = Field(default=None, gt=0.0)
    """Decode workers: KV transfer speed in prompt tokens per second; a transfer takes the tokens
    this worker does not hold in its own prefix cache / this rate. None = instant."""
    engine_id: str | None = None
    """vLLM NIXL prefill workers: the `remote_engine_id` they hand out (default: a fresh UUID)."""
    side_channel_host: str = "127.0.0.1"
    """vLLM NIXL prefill workers: the `remote_host` they hand out (`VLLM_NIXL_SIDE_CHANNEL_HOST`);
    the `remote_port` is the sim's own HTTP port, where it answers the decode worker's reads."""

    @model_validator(mode="after")
    def _check_pd(self) -> SimConfig:
        if (self.pd_role is None) != (self.pd_protocol is None):
            raise ValueError("pd_role and pd_protocol go together")
        if self.pd_protocol == "sglang" and self.engine != "sglang":
            raise ValueError("pd_protocol 'sglang' needs engine 'sglang'")
        if self.pd_protocol in ("vllm-nixl", "vllm-mooncake") and self.engine == "sglang":
            raise ValueError(f"pd_protocol '{self.pd_protocol}' needs engine 'vllm' or 'ascend'")
        if self.max_loaded_loras is not None and self.engine != "sglang":
            raise ValueError("max_loaded_loras is SGLang's --max-loaded-loras; vLLM refuses no runtime load for "
                             "capacity (see its description)")
        return self

    @property
    def lora_enabled(self) -> bool:
        """SGLang's `--enable-lora`: `runtime_lora_updating`, or adapters loaded at start."""
        return self.runtime_lora_updating or bool(self.lora_modules)

    @property
    def step_prefill_tokens_per_s(self) -> float:
        """The stepped scheduler's prefill budget: `prefill_tokens_per_s`, else the default."""
        return self.prefill_tokens_per_s if self.prefill_tokens_per_s is not None else DEFAULT_PREFILL_TOKENS_PER_S

    @property
    def lora_adapters(self) -> dict[str, str]:
        """LoRA adapter name -> path, from `lora_modules`, in their order."""
        return dict(module.split("=", 1) for module in self.lora_modules)

    @property
    def model_name(self) -> str:
        """The name responses report as `model` (the first served name)."""
        return self.served_model_names[0]

    @property
    def messages_usage_mode(self) -> MessagesUsage:
        """`messages_usage` with `engine` resolved: SGLang's shape for sglang, vLLM's for vLLM and Ascend."""
        if self.messages_usage != "engine":
            return self.messages_usage
        return "sglang" if self.engine == "sglang" else "vllm"

    def output_room(self, prompt_tokens: int) -> int:
        """Output tokens the engine generates at most after a prompt of `prompt_tokens` (whatever the
        limit; 0 when none is left): vLLM, max_model_len - prompt (`get_max_tokens`,
        vllm/entrypoints/serve/utils/api_utils.py); SGLang, its scheduler's bound of context_len - 1
        less the prompt less one (`Scheduler.init_req_max_new_tokens`,
        python/sglang/srt/managers/scheduler.py, with `max_req_len` = context_len - 1 from tp_worker.py)."""
        slack = 2 if self.engine == "sglang" else 0
        return max(self.max_context_tokens - prompt_tokens - slack, 0)
