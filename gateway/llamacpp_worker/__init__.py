"""Real CPU inference engine (llama.cpp serving SmolLM2-135M-Instruct) for tests, the demo and the
CLI. `xllamacpp` is imported only when a server actually starts, so importing this is cheap."""

from gateway.llamacpp_worker.llamacpp import (
    CONTEXT_EXCEEDED_MESSAGE,
    CONTEXT_EXCEEDED_STATUS,
    CONTEXT_EXCEEDED_TYPE,
    DEFAULT_MODEL_ALIASES,
    EngineUnavailableError,
    LlamaCppSettings,
    LlamaCppWorker,
    WorkerStartError,
    find_smollm2_gguf,
    run_engine,
)

__all__ = [
    "CONTEXT_EXCEEDED_MESSAGE",
    "CONTEXT_EXCEEDED_STATUS",
    "CONTEXT_EXCEEDED_TYPE",
    "DEFAULT_MODEL_ALIASES",
    "EngineUnavailableError",
    "LlamaCppSettings",
    "LlamaCppWorker",
    "WorkerStartError",
    "find_smollm2_gguf",
    "run_engine",
]
