"""Prefix-cache hits measured by the engines themselves: multi-turn conversations through the gateway
to two real vLLM engines, once per routing policy.

    .venv/bin/python -m loadtest.engine_hits          # 60 conversations; default, round_robin, prefix_affinity
    .venv/bin/python -m loadtest.engine_hits --conversations 8 --policies default,round_robin   # smaller
    .venv/bin/python -m loadtest.engine_hits --policies default --tenants 8 --isolation off,per_key \
        --system-tokens 1024 --max-prompt-tokens 2400      # what per-key cache isolation costs

Needs the real vLLM CPU build (`scripts/install-vllm`) and its tiny models (`tests/real_vllm/engine.py`:
`models_dir()`, the 2-layer Qwen2 `dense/` with a 4,096-token BPE vocabulary, served with a 4,096-token
context); loopback only, bounded, stops by itself.

Workload: the Mooncake (Kimi) conversation trace (`traces/mooncake/conversation_trace.jsonl`) has no
text and no session ids, but its `hash_ids` are prefix hashes of 512-token blocks, so a request whose
blocks start with all the full blocks of an earlier request is that request's next turn
(`conversations`). Conversations of `--min-turns` or more turns whose prompts all stay under
`--max-trace-tokens` are eligible; `--conversations` of them are drawn with `--seed`. Every token count
is scaled by `--max-prompt-tokens / --max-trace-tokens` (a 16K-token Kimi prompt becomes ~3,300 tokens
of the tiny model) and each turn becomes a growing chat message list (`build_turns`): the system
prompt is the trace's block 0 (shared by every request of the trace), the first user message the rest
of the first prompt, and each later turn appends the previous answer (text of the trace's output
length, the same for every policy, so every policy sends the very same prompts) and a user message
of the growth the trace records. Text comes from the shared books at an offset drawn from the trace's
block id, so two conversations share no text beyond the system prompt. Streaming chat completions,
temperature 0, `max_tokens` the scaled output length (at most `--max-output-tokens`); `--concurrency`
conversations run at once, each sending its next turn when the previous answer has ended.

Per policy: the engines' prefix caches are emptied (`POST /reset_prefix_cache`, served by vLLM 0.32
with `VLLM_SERVER_DEV_MODE=1`: `vllm/entrypoints/serve/dev/cache/api_router.py`, registered in
`vllm/entrypoints/launchers/api_server/routers.py`; it answers `{"success": false}` while blocks are
held, so it is retried), a fresh `kimi-gateway serve` process with one vLLM pool of both engines (policy
unset for `default`, i.e. `ttft_cost`; in-process affinity store) replays the conversations, and two hit
ratios are read from the engines: sum(`usage.prompt_tokens_details.cached_tokens`) / sum(`prompt_tokens`)
over the answers (vLLM with `--enable-prompt-tokens-details`), and the deltas of the engines' own
Prometheus counters `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` (tokens;
`vllm/v1/metrics/loggers.py`). vLLM caches whole blocks (128 tokens on the CPU, `vllm/platforms/cpu.py`)
and always computes a prompt's last token, so even a prompt seen before is not cached to its end.

Tenants (`--tenants N`, `--isolation`): conversation i belongs to tenant i mod N, whose requests carry
its own API key (the gateway then runs with auth on and one key per tenant); each `--isolation` value
is a run of its own per policy: `off` (the engines' caches shared by every key, as without auth) or
`per_key` (`auth.cache_isolation: per_key`: the gateway sets each key's `cache_salt` and keys its
prefix-affinity records the same way, gateway/auth/cache_isolation.py). Every conversation's system
prompt is the same text (the trace's block 0, shared by every request of the trace), `--system-tokens`
long when given (else block 0 scaled, ~100 tokens: less than one 128-token vLLM block, so nothing is
shared across conversations), so isolation costs what one tenant's conversations could have reused
of another's: their common system prompt. "reachable (one engine)" counts each turn's own previous
turn only, not that system prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from loadtest.loadgen import RequestResult, send_one
from loadtest.procs import ProcessGroup, free_port
from loadtest.trace import TRACE_BLOCK_TOKENS, TraceRequest, read_trace

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("KIMI_SHARED_DATA", REPO.parent / "shared" / "data"))
DEFAULT_TRACE = SHARED_DATA / "traces" / "mooncake" / "conversation_trace.jsonl"
BOOKS = SHARED_DATA / "text" / "books"
MODEL = "kimi-k3"
POOL = "vllm"
CONTEXT = 4096
"""The engines' `--max-model-len` (the tiny models' context)."""
CHARS_PER_TOKEN = 3.45
"""Characters of book text per token of the tiny model's 4,096-token BPE (measured on 50 random
3,000-character slices of each book: 3.44-3.51 on average, 3.0-3.8 per slice)."""
DEFAULT_POLICY = "default"
"""The `--policies` name of the gateway's default policy (`policy:` left unset: `ttft_cost`)."""
HIT_COUNTER = "vllm:prefix_cache_hits_total"
QUERY_COUNTER = "vllm:prefix_cache_queries_total"
RUNNING_GAUGE = "vllm:num_requests_running"
BLOCK = 128
"""vLLM's KV block on the CPU, tokens (`vllm/platforms/cpu.py`: 128 unless `--block-size`); its prefix
cache reuses whole blocks only."""
WAIT_S = 120.0
"""Bound of every wait on an engine or the gateway (start, reset, idle), seconds."""


# --- conversations from the trace ------------------------------------------------------------------------


def full_blocks(row: TraceRequest) -> tuple[int, ...]:
    """The ids of a request's completely filled blocks (a partly filled last block is left out)."""
    return row.hash_ids if row.input_length % TRACE_BLOCK_TOKENS == 0 else row.hash_ids[:-1]


def conversations(rows: Sequence[TraceRequest]) -> list[list[TraceRequest]]:
    """The trace's conversations, in the order of their first request: each request is the next turn
    of the latest earlier request whose full blocks (at least two: block 0 is every request's system
    prompt) its own blocks start with, unless that request already has a next turn (then it starts a
    conversation of its own, as does a request that continues nothing)."""
    owner: dict[tuple[int, ...], int] = {}
    chain_of: dict[int, int] = {}
    chains: list[list[TraceRequest]] = []
    for row in rows:
        chain = None
        for k in range(len(row.hash_ids), 1, -1):
            earlier = owner.get(row.hash_ids[:k])
            if earlier is not None:
                candidate = chain_of[earlier]
                if chains[candidate][-1].index == earlier:
                    chain = candidate
                break
        if chain is None:
            chain = len(chains)
            chains.append([])
        chains[chain].append(row)
        chain_of[row.index] = chain
        owner[full_blocks(row)] = row.index
    return chains


def pick(chains: Sequence[list[TraceRequest]], count: int, seed: int, min_turns: int, max_turns: int,
         max_trace_tokens: int) -> list[list[TraceRequest]]:
    """`count` conversations drawn with `seed` from those with at least `min_turns` turns under
    `max_trace_tokens` (each cut before its first longer prompt, then to `max_turns` turns), in trace
    order. ValueError when fewer are eligible."""
    eligible = []
    for chain in chains:
        kept: list[TraceRequest] = []
        for row in chain[:max_turns]:
            if row.input_length > max_trace_tokens:
                break
            kept.append(row)
        if len(kept) >= min_turns:
            eligible.append(kept)
    if len(eligible) < count:
        raise ValueError(f"only {len(eligible)} conversations of {min_turns}+ turns under {max_trace_tokens} tokens")
    chosen = random.Random(seed).sample(eligible, count)
    return sorted(chosen, key=lambda chain: chain[0].index)


# --- text --------------------------------------------------------------------------------------------------


class BookText:
    """Book text of about a given number of tiny-model tokens, a pure function of a key: a slice of
    the shared books at an offset drawn from the key, from a word's start."""

    def __init__(self, books: Path = BOOKS) -> None:
        paths = sorted(books.glob("*.txt"))
        if not paths:
            raise SystemExit(f"engine_hits: no books under {books} (set KIMI_SHARED_DATA)")
        self.text = " ".join(" ".join(p.read_text(encoding="utf-8").split()) for p in paths)

    def take(self, key: str, tokens: int) -> str:
        """About `tokens` tokens (`CHARS_PER_TOKEN` characters each, at least one word) for `key`."""
        chars = max(1, round(tokens * CHARS_PER_TOKEN))
        digest = hashlib.sha256(key.encode()).digest()
        start = int.from_bytes(digest[:8], "little") % (len(self.text) - chars - 64)
        start = self.text.find(" ", start) + 1
        return self.text[start:start + chars].strip()


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: its chat messages and `max_tokens`."""

    conversation: int
    turn: int
    messages: list[dict[str, str]]
    max_tokens: int


def build_turns(conversation: int, chain: Sequence[TraceRequest], scale: float, texts: BookText,
                max_output_tokens: int, system_tokens: int | None = None) -> list[Turn]:
    """A conversation's turns as growing message lists, token counts scaled by `scale`.

    System: the text of block 0 (every request's first block), of `system_tokens` tokens when given,
    else of the block's scaled size; first user message: the rest of the first prompt; turn k > 1
    appends the assistant's answer to turn k - 1 (text of its trace output length) and a user message
    of what the trace's prompt grew by beyond that answer (at least 8 tokens). Texts are keyed by
    trace block ids, answers by (conversation, turn)."""

    def size(tokens: float) -> int:
        return max(8, round(tokens * scale))

    def key(row: TraceRequest, block: int, k: int) -> str:
        return f"block-{row.hash_ids[block]}" if block < len(row.hash_ids) else f"user-{conversation}-{k}"

    first = chain[0]
    system = system_tokens if system_tokens is not None else size(TRACE_BLOCK_TOKENS)
    messages = [{"role": "system", "content": texts.take(f"block-{first.hash_ids[0]}", system)},
                {"role": "user",
                 "content": texts.take(key(first, 1, 0), size(first.input_length - TRACE_BLOCK_TOKENS))}]
    turns: list[Turn] = []
    for k, row in enumerate(chain):
        if k:
            before = chain[k - 1]
            answer = texts.take(f"answer-{conversation}-{k - 1}", size(before.output_length))
            grown = size(row.input_length - before.input_length - before.output_length)
            messages = [*messages, {"role": "assistant", "content": answer},
                        {"role": "user", "content": texts.take(key(row, len(full_blocks(before)), k), grown)}]
        max_tokens = max(1, min(max_output_tokens, round(row.output_length * scale)))
        turns.append(Turn(conversation, k, messages, max_tokens))
    return turns


# --- engines ---------------------------------------------------------------------------------------------


def engine_counters(url: str) -> dict[str, float]:
    """An engine's prefix-cache counters and running requests (summed over labels) from `/metrics`."""
    totals = dict.fromkeys((HIT_COUNTER, QUERY_COUNTER, RUNNING_GAUGE), 0.0)
    for line in httpx.get(url + "/metrics", timeout=10, trust_env=False).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def wait_idle(urls: Sequence[str]) -> None:
    """Return once no engine reports a running request (RuntimeError after `WAIT_S`)."""
    deadline = time.monotonic() + WAIT_S
    while any(engine_counters(url)[RUNNING_GAUGE] for url in urls):
        if time.monotonic() > deadline:
            raise RuntimeError("engines still busy")
        time.sleep(0.2)


def reset_prefix_caches(urls: Sequence[str]) -> None:
    """Empty every engine's prefix cache (`POST /reset_prefix_cache`, retried while it answers
    `success: false`); RuntimeError when an engine lacks the endpoint or never succeeds."""
    for url in urls:
        deadline = time.monotonic() + WAIT_S
        while True:
            answer = httpx.post(url + "/reset_prefix_cache", timeout=30, trust_env=False)
            if answer.status_code != 200:
                raise RuntimeError(f"{url}/reset_prefix_cache: HTTP {answer.status_code} (VLLM_SERVER_DEV_MODE=1?)")
            if answer.json().get("success"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}/reset_prefix_cache kept answering success: false")
            time.sleep(0.5)


# --- the gateway -----------------------------------------------------------------------------------------


ISOLATIONS = ("off", "per_key")
"""The `--isolation` values: `auth.cache_isolation` of the run's gateway."""


def tenant_key(tenant: int) -> str:
    """Tenant `tenant`'s API key (a loopback benchmark's, not a secret)."""
    return f"sk-engine-hits-tenant-{tenant:04d}-" + "0" * 24


def gateway_config(port: int, urls: Sequence[str], policy: str, tenants: int = 1,
                   isolation: str = "off") -> dict[str, Any]:
    """One vLLM pool of `urls` (policy unset for `DEFAULT_POLICY`), in-process affinity store,
    generous first-byte budget for a CPU engine, no drain delay; with several `tenants` or an
    `isolation` other than `off`, auth on with one key per tenant (`tenant_key`, no limits) and
    `auth.cache_isolation` = `isolation`."""
    pool: dict[str, Any] = {"name": POOL, "engine": "vllm", "workers": list(urls), "max_context_tokens": CONTEXT}
    if policy != DEFAULT_POLICY:
        pool["policy"] = policy
    config: dict[str, Any] = {"host": "127.0.0.1", "port": port, "log_level": "warning", "pools": [pool],
                              "health": {"interval": 1.0, "timeout": 10.0}, "timeouts": {"first_byte_base": 120.0},
                              "shutdown": {"drain_delay": 0}}
    if tenants > 1 or isolation != "off":
        keys = [{"name": f"tenant-{t}", "sha256": hashlib.sha256(tenant_key(t).encode()).hexdigest(),
                 "scopes": ["user", "admin"]} for t in range(tenants)]  # admin: the readiness check's /admin/workers
        config["auth"] = {"enabled": True, "cache_isolation": isolation, "keys": keys}
    return config


def start_gateway(group: ProcessGroup, urls: Sequence[str], policy: str, tenants: int = 1,
                  isolation: str = "off") -> str:
    """Start `kimi-gateway serve` for `policy` (`gateway_config`); its base URL once every engine is
    healthy there."""
    port = free_port()
    name = policy if tenants == 1 and isolation == "off" else f"{policy}-{tenants}-{isolation}"
    path = group.log_dir / f"gateway-{name}.yaml"
    path.write_text(yaml.safe_dump(gateway_config(port, urls, policy, tenants, isolation)), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_GATEWAY_")}
    proc = group.spawn(f"gateway-{name}", [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)], env=env)
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {tenant_key(0)}"}  # an admin key when auth is on, ignored when off

    def ready() -> bool:
        try:
            answer = httpx.get(base + "/admin/workers", headers=headers, timeout=2.0, trust_env=False)
        except httpx.HTTPError:
            return False
        healthy = answer.status_code == 200 and sum(w["healthy"] for w in answer.json()["pools"][0]["workers"])
        return healthy == len(urls)

    proc.wait_until(ready, WAIT_S, f"ready at {base}")
    return base


# --- one run ---------------------------------------------------------------------------------------------


@dataclass
class PolicyRun:
    """One policy's figures. Tokens as the engines counted them; `wall_s` from the first request to
    the last answer; `per_engine`: requests each engine served (by the gateway's worker header)."""

    policy: str
    tenants: int = 1
    isolation: str = "off"
    sent: int = 0
    ok: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    max_prompt_tokens: int = 0
    reachable_tokens: int = 0
    engine_hits: float = 0.0
    engine_queries: float = 0.0
    wall_s: float = 0.0
    per_engine: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def usage_ratio(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def reachable_ratio(self) -> float | None:
        return self.reachable_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def engine_ratio(self) -> float | None:
        return self.engine_hits / self.engine_queries if self.engine_queries else None


def chat_body(turn: Turn) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": turn.messages, "max_tokens": turn.max_tokens,
                         "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})


async def replay(base: str, conversations_turns: Sequence[list[Turn]], concurrency: int,
                 tenants: int = 1) -> tuple[list[RequestResult], float]:
    """Send every conversation's turns in order, `concurrency` conversations at once, conversation i
    with tenant i mod `tenants`'s key (`tenant_key`; no key with one tenant); the results and the
    wall time (s). A failed turn ends its conversation (the next would not extend a cached prompt)."""
    url = base + "/v1/chat/completions"
    queue = list(reversed(conversations_turns))
    results: list[RequestResult] = []
    timeout = httpx.Timeout(connect=10.0, read=WAIT_S, write=30.0, pool=None)

    async def worker(clients: Sequence[httpx.AsyncClient], t0: float) -> None:
        while queue:
            for turn in queue.pop():
                result = RequestResult(len(results), 0.0, f"hits-{turn.conversation}-{turn.turn}")
                results.append(result)
                await send_one(clients[turn.conversation % len(clients)], url, chat_body(turn), result, t0)
                if not result.ok:
                    break

    keys = [{"Authorization": f"Bearer {tenant_key(t)}"} for t in range(tenants)] if tenants > 1 else [{}]
    clients = [httpx.AsyncClient(timeout=timeout, trust_env=False, headers=headers) for headers in keys]
    try:
        t0 = time.monotonic()
        await asyncio.gather(*(worker(clients, t0) for _ in range(concurrency)))
        return results, time.monotonic() - t0
    finally:
        for client in clients:
            await client.aclose()


def run_policy(group: ProcessGroup, urls: Sequence[str], policy: str, turns: Sequence[list[Turn]],
               concurrency: int, tenants: int = 1, isolation: str = "off") -> PolicyRun:
    """Cold caches, a fresh gateway for `policy` (with `tenants` keys and `isolation`), the replay,
    the engines' counters; the gateway is stopped afterwards."""
    wait_idle(urls)
    reset_prefix_caches(urls)
    before = [engine_counters(url) for url in urls]
    base = start_gateway(group, urls, policy, tenants, isolation)
    try:
        results, wall = asyncio.run(replay(base, turns, concurrency, tenants))
    finally:
        group.close()
    wait_idle(urls)
    after = [engine_counters(url) for url in urls]
    run = PolicyRun(policy, tenants, isolation, sent=len(results), wall_s=wall)
    served = Counter(r.worker for r in results if r.ok)  # the gateway's worker ids: pool/index
    run.per_engine = [served.get(f"{POOL}/{i}", 0) for i in range(len(urls))]
    prompts = {r.request_id: r.prompt_tokens or 0 for r in results if r.ok}
    for r in results:
        conversation, _, turn = (r.request_id or "").rpartition("-")
        previous = prompts.get(f"{conversation}-{int(turn) - 1}", 0)
        run.reachable_tokens += previous // BLOCK * BLOCK if r.ok else 0
        if not r.ok:
            run.errors.append(f"{r.request_id}: {r.error}")
            continue
        run.ok += 1
        run.prompt_tokens += r.prompt_tokens or 0
        run.cached_tokens += r.cached_tokens or 0
        run.max_prompt_tokens = max(run.max_prompt_tokens, r.prompt_tokens or 0)
    run.engine_hits = sum(a[HIT_COUNTER] - b[HIT_COUNTER] for a, b in zip(after, before, strict=True))
    run.engine_queries = sum(a[QUERY_COUNTER] - b[QUERY_COUNTER] for a, b in zip(after, before, strict=True))
    return run


def table(runs: Sequence[PolicyRun]) -> str:
    """The markdown table of the runs, one row per run (per policy; with tenants, per policy and
    isolation, in two more columns)."""

    def ratio(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    tenanted = any(run.tenants > 1 or run.isolation != "off" for run in runs)
    head = "| policy | tenants | cache isolation " if tenanted else "| policy "
    lines = [head + "| hit ratio (usage) | hit ratio (engine metrics) | reachable (one engine) | requests ok/sent | "
             "prompt tokens | cached tokens | engine hits / queries | requests per engine | longest prompt | wall s |",
             "| --- " + ("| ---: | --- " if tenanted else "")
             + "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for run in runs:
        name = "default (ttft_cost)" if run.policy == DEFAULT_POLICY else run.policy
        if tenanted:
            name += f" | {run.tenants} | {run.isolation}"
        lines.append(f"| {name} | {ratio(run.usage_ratio)} | {ratio(run.engine_ratio)} | "
                     f"{ratio(run.reachable_ratio)} | {run.ok}/{run.sent} | "
                     f"{run.prompt_tokens:,} | {run.cached_tokens:,} | {run.engine_hits:,.0f} / "
                     f"{run.engine_queries:,.0f} | {' / '.join(map(str, run.per_engine))} | "
                     f"{run.max_prompt_tokens:,} | {run.wall_s:.0f} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Options:
    """The benchmark's settings (the command line's options)."""

    conversations: int = 60
    policies: tuple[str, ...] = (DEFAULT_POLICY, "round_robin", "prefix_affinity")
    seed: int = 0
    concurrency: int = 4
    min_turns: int = 3
    max_turns: int = 6
    max_trace_tokens: int = 16_384
    max_prompt_tokens: int = 3_300
    max_output_tokens: int = 16
    trace: Path = DEFAULT_TRACE
    tenants: int = 1
    isolations: tuple[str, ...] = ("off",)
    system_tokens: int | None = None


def workload(opts: Options) -> list[list[Turn]]:
    """The conversations' turns (`pick` then `build_turns`)."""
    chains = pick(conversations(read_trace(opts.trace)), opts.conversations, opts.seed, opts.min_turns,
                  opts.max_turns, opts.max_trace_tokens)
    scale, texts = opts.max_prompt_tokens / opts.max_trace_tokens, BookText()
    return [build_turns(i, chain, scale, texts, opts.max_output_tokens, opts.system_tokens)
            for i, chain in enumerate(chains)]


def run_benchmark(opts: Options, engine_urls: Sequence[str], log_dir: Path) -> list[PolicyRun]:
    """Every policy, under every isolation, over the same conversations against running engines
    (started with `VLLM_SERVER_DEV_MODE=1` and `--enable-prompt-tokens-details`); one `PolicyRun`
    each, in order (policies, then isolations)."""
    turns = workload(opts)
    for url in engine_urls:  # first requests of an engine pay one-time costs: not in any policy's figures
        httpx.post(url + "/v1/chat/completions", timeout=WAIT_S, trust_env=False, json={
            "model": MODEL, "messages": [{"role": "user", "content": "The river"}], "max_tokens": 4}).raise_for_status()
    runs = []
    for policy in opts.policies:
        for isolation in opts.isolations:
            name = policy if len(opts.isolations) == 1 else f"{policy}-{isolation}"
            with ProcessGroup(log_dir / name) as group:
                runs.append(run_policy(group, engine_urls, policy, turns, opts.concurrency, opts.tenants, isolation))
    return runs


def start_engines(count: int = 2) -> list[Any]:
    """`count` real vLLM engines serving the tiny dense model with a `CONTEXT`-token context and the
    cache-reset endpoint; SystemExit naming the install script when vLLM is missing."""
    from tests.real_vllm.engine import VllmEngine, models_dir, vllm_python

    if vllm_python() is None:
        raise SystemExit("engine_hits: the real vLLM is not installed: run scripts/install-vllm")
    engines = [VllmEngine(models_dir() / "dense", [MODEL], max_model_len=CONTEXT,
                          env={"VLLM_SERVER_DEV_MODE": "1"}) for _ in range(count)]
    try:
        for engine in engines:
            engine.start()
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Options()
    parser.add_argument("--conversations", type=int, default=defaults.conversations)
    parser.add_argument("--policies", default=",".join(defaults.policies),
                        help="comma-separated; 'default' leaves the pool's policy unset (ttft_cost)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--min-turns", type=int, default=defaults.min_turns)
    parser.add_argument("--max-turns", type=int, default=defaults.max_turns)
    parser.add_argument("--max-trace-tokens", type=int, default=defaults.max_trace_tokens)
    parser.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens)
    parser.add_argument("--max-output-tokens", type=int, default=defaults.max_output_tokens)
    parser.add_argument("--trace", type=Path, default=defaults.trace)
    parser.add_argument("--tenants", type=int, default=defaults.tenants,
                        help="API keys; conversation i is tenant i mod N's (more than 1: auth on)")
    parser.add_argument("--isolation", default=",".join(defaults.isolations),
                        help=f"comma-separated auth.cache_isolation values, a run each: {', '.join(ISOLATIONS)}")
    parser.add_argument("--system-tokens", type=int, default=defaults.system_tokens,
                        help="tokens of the system prompt every conversation shares (default: the trace's block 0 "
                             "scaled)")
    args = parser.parse_args(argv)
    isolations = tuple(i.strip() for i in args.isolation.split(",") if i.strip())
    if not isolations or any(i not in ISOLATIONS for i in isolations) or args.tenants < 1:
        raise SystemExit(f"--isolation takes {', '.join(ISOLATIONS)}; --tenants at least 1")
    opts = Options(args.conversations, tuple(p.strip() for p in args.policies.split(",") if p.strip()), args.seed,
                   args.concurrency, args.min_turns, args.max_turns, args.max_trace_tokens, args.max_prompt_tokens,
                   args.max_output_tokens, args.trace, args.tenants, isolations, args.system_tokens)
    scale = opts.max_prompt_tokens / opts.max_trace_tokens
    system_growth = max(0, (opts.system_tokens or 0) - round(TRACE_BLOCK_TOKENS * scale))
    if opts.max_prompt_tokens + system_growth + opts.max_output_tokens > CONTEXT - 256:
        raise SystemExit(f"--max-prompt-tokens (+ --system-tokens beyond the scaled block 0) + --max-output-tokens "
                         f"must leave room in the {CONTEXT}-token context")
    turns = workload(opts)
    print(f"{len(turns)} conversations, {sum(map(len, turns))} turns; starting two vLLM engines...", flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="engine-hits-"))
    engines = start_engines()
    try:
        runs = run_benchmark(opts, [e.url for e in engines], log_dir)
    finally:
        for engine in engines:
            engine.stop()
    print(table(runs))
    for run in runs:
        for error in run.errors[:5]:
            print(f"{run.policy}: {error}", file=sys.stderr)
    print(f"logs: {log_dir}")


if __name__ == "__main__":
    main()
