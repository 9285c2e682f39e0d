"""A deterministic virtual-time evaluator of routing policies on the trace: a TUNING AID only.

    python -m loadtest.vtime --minutes 10 --policies ttft_cost,prefix_affinity --peers cache_aware

Published figures come from the real replay (`loadtest.replay`: real gateway, HTTP, simulated
workers in their own process); this module exists because live replays on a shared 2-core machine
are noisy (CPU stalls show up as send lag and TTFT), which makes parameter tuning unreliable.

What it runs, in one process with no sockets, on an asyncio loop whose clock is virtual (it jumps
to the next timer whenever nothing is ready, so results do not depend on the machine):
- the trace schedule, the sizing and every flag of `loadtest.replay` (same parser, same "auto"
  prefill speed);
- per worker the simulator's real step scheduler and prefix cache (`gateway.sim.stepper`,
  `gateway.sim.kvcache`), prompts keyed in 16-token blocks chained by the trace's hash ids (what
  the replay's block texts make the simulator compute), `ttft_s` before admission as the sim does;
- the gateway's real policy classes (`gateway.routing.registry.build_policy`, `--policy-params`)
  with the real prefill estimator (`gateway.routing.prefill`), on `Worker` objects whose engine
  load is "scraped" every `load.interval` (scaled by the speed-up, as the replay does);
- an affinity store modelled at the trace's block level (512 tokens): each block's owner is the
  last worker a request holding it was sent to, until the affinity TTL; a worker's match is the
  deepest block it owns (the gateway samples 512-byte blocks; this is coarser);
- `cache_aware` as an approximation of SGLang's router (sglang-router 0.3 defaults: cache
  threshold 0.3, balance 64 / 1.5 on its own in-flight counts, the smallest tree when no match
  passes the threshold; per-worker trees as sets of block prefixes, no eviction) — not the router.

No network, HTTP, gateway overhead or client concurrency cap: TTFT is engine queueing + prefill;
TPOT (per request of more than one token: (last token - first) / (tokens - 1)) is the step
scheduler's decode steps, each as long as the prefill chunk it carries.
"""

from __future__ import annotations

import asyncio
import json
import selectors
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from gateway.backends.engine_kinds import ENGINES
from gateway.backends.worker import Worker
from gateway.routing.features import RoutingRequest
from gateway.routing.policy import Candidate, Decision, RoutingPolicy
from gateway.routing.prefill import PrefillEstimator, PrefillTicket
from gateway.routing.registry import build_policy
from gateway.sim.kvcache import PrefixCache, PromptKey
from gateway.sim.stepper import StepScheduler, new_step_request
from gateway.sim.totals import HitRateWindow, SimTotals
from loadtest import replay as rp
from loadtest.layouts import gateway_overrides
from loadtest.replay_settings import MODEL, Settings
from loadtest.report import percentile
from loadtest.trace import ScheduledRequest, read_trace, schedule

TRACE_BLOCK_TOKENS = 512
"""Tokens per trace hash id (the replay's 2,048-byte block texts at the simulator's 4 bytes a token)."""


class _JumpSelector:
    """Wraps the loop's selector: a wait of `timeout` seconds advances the virtual clock instead."""

    def __init__(self, inner: selectors.BaseSelector, loop: VirtualTimeLoop) -> None:
        self._inner = inner
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("virtual-time loop: nothing ready and no timer (deadlock)")
        self._loop.now += max(timeout, 0.0)
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` is virtual seconds from 0; no I/O (nothing may wait on a socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self._selector = _JumpSelector(self._selector, self)  # type: ignore[assignment]

    def time(self) -> float:
        return self.now


@dataclass
class SimWorker:
    """One simulated worker: the real step scheduler and prefix cache, and the gateway's `Worker`."""

    worker: Worker
    sched: StepScheduler
    totals: SimTotals
    lock: threading.Condition


def prompt_key(hash_ids: tuple[int, ...], tokens: int, block_tokens: int) -> PromptKey:
    """The cache key of a prompt of `tokens` tokens whose 512-token blocks are `hash_ids`: chained
    hashes of its full `block_tokens` blocks (equal ids → equal leading blocks, as in the replay)."""
    hashes: list[int] = []
    chain = 0
    per_trace_block = TRACE_BLOCK_TOKENS // block_tokens
    for j in range(tokens // block_tokens):
        b = j // per_trace_block
        if b >= len(hash_ids):
            break
        if j % per_trace_block == 0:
            chain = hash((chain, hash_ids[b]))
        hashes.append(hash((chain, j % per_trace_block)) & 0xFFFFFFFFFFFFFFFF)
    return PromptKey(tokens, tuple(hashes))


def block_prefixes(hash_ids: tuple[int, ...]) -> list[int]:
    """One chained hash per leading trace block (the prefix up to and including it)."""
    out, chain = [], 0
    for h in hash_ids:
        chain = hash((chain, h))
        out.append(chain)
    return out


class CacheAwarePeer:
    """An approximation of sglang-router's `cache_aware` (see the module docstring); same interface
    as a gateway policy, plus `sent` / `done` for its own in-flight counts."""

    name = "cache_aware~"

    def __init__(self, urls: list[str], threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5) -> None:
        self.trees: dict[str, set[int]] = {u: set() for u in urls}
        self.sizes: dict[str, int] = dict.fromkeys(urls, 0)
        self.inflight: dict[str, int] = dict.fromkeys(urls, 0)
        self.threshold, self.balance_abs, self.balance_rel = threshold, balance_abs, balance_rel

    def choose(self, prefixes: list[int], tokens: int, workers: list[Worker]) -> Worker:
        loads = [self.inflight[w.url] for w in workers]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > min(loads) * self.balance_rel:
            return workers[loads.index(min(loads))]
        best, best_tokens = workers[0], -1
        for w in workers:
            tree, n = self.trees[w.url], 0
            while n < len(prefixes) and prefixes[n] in tree:
                n += 1
            if n > best_tokens:
                best, best_tokens = w, n
        if min(best_tokens * TRACE_BLOCK_TOKENS, tokens) / max(tokens, 1) > self.threshold:
            return best
        return min(workers, key=lambda w: self.sizes[w.url])

    def sent(self, worker: Worker, prefixes: list[int], tokens: int) -> None:
        tree = self.trees[worker.url]
        tree.update(prefixes)
        self.sizes[worker.url] += tokens
        self.inflight[worker.url] += 1

    def done(self, worker: Worker) -> None:
        self.inflight[worker.url] -= 1


@dataclass
class Outcome:
    """One policy's figures: TTFTs (s) per completed request, hit ratio, prefill balance."""

    name: str
    ttfts: list[float] = field(default_factory=list)
    requests: list[tuple[float, int, int]] = field(default_factory=list)
    """(TTFT s, prompt tokens, cached tokens) per completed request, in completion order."""
    hit_ratio: float = 0.0
    prefill_max_over_mean: float = 0.0
    preemptions: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    excess: list[float] = field(default_factory=list)
    """TTFT minus the request's floor (`floors`) per completed request, seconds."""
    tpots: list[float] = field(default_factory=list)
    """Per completed request of more than one output token: (last token - first) / (tokens - 1), seconds."""

    def row(self) -> str:
        p50, p99 = percentile(self.ttfts, 50), percentile(self.ttfts, 99)
        return (f"| {self.name} | {self.hit_ratio:.3f} | {p50 or 0:.3f} | {p99 or 0:.3f} | "
                f"{percentile(self.excess, 99) or 0:.3f} | "
                f"{1000 * (percentile(self.tpots, 50) or 0):.1f} | {1000 * (percentile(self.tpots, 99) or 0):.1f} | "
                f"{self.prefill_max_over_mean:.2f} | {self.preemptions} | "
                f"{', '.join(f'{k} {v}' for k, v in sorted(self.reasons.items()))} |")


TABLE_HEADER = ("| policy | hit ratio | p50 TTFT (s) | p99 TTFT (s) | p99 over floor (s) | p50 TPOT (ms) | "
                "p99 TPOT (ms) | max/mean prefill | preemptions | reasons |\n"
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")


def floors(items: list[ScheduledRequest], s: Settings, prefill_tps: float) -> list[float]:
    """Per request, a TTFT no router can beat (seconds): `ttft_s` + its prompt less the longest
    prefix any earlier request had (an unbounded shared cache), alone on an idle worker, with one
    base step time per chunk."""
    seen: set[int] = set()
    out = []
    for item in items:
        req = item.request
        prefixes = block_prefixes(req.hash_ids)
        n = 0
        while n < len(prefixes) and prefixes[n] in seen:
            n += 1
        seen.update(prefixes)
        cached = min(n * TRACE_BLOCK_TOKENS, req.input_length)
        uncached = req.input_length - cached + cached % s.kv_block_tokens
        chunks = max(1, -(-uncached // s.chunk_tokens))
        out.append(s.ttft_s + uncached / prefill_tps + chunks * s.tpot_s)
    return out


class Evaluation:
    """One policy (or the peer approximation) over the schedule, in virtual time."""

    def __init__(self, s: Settings, prefill_tps: float, policy: RoutingPolicy | CacheAwarePeer,
                 timers: dict[str, Any]) -> None:
        self.s = s
        self.policy = policy
        self.prefill = PrefillEstimator()
        self.sched_rate = prefill_tps
        self.workers: list[SimWorker] = []
        for i in range(s.workers):
            lock = threading.Condition()
            totals = SimTotals()
            sched = StepScheduler(lock, PrefixCache(s.kv_capacity_tokens, s.kv_block_tokens), totals, HitRateWindow(),
                                  chunk_tokens=s.chunk_tokens, prefill_tokens_per_s=prefill_tps,
                                  decode_step_s=s.tpot_s, decode_s_per_seq=s.decode_s_per_seq,
                                  max_num_seqs=s.max_num_seqs)
            self.workers.append(SimWorker(Worker("replay", i, f"w{i}", ENGINES["sglang"]), sched, totals, lock))
        self.scrape_s = float(timers.get("load", {}).get("interval", 1.0))
        self.ttl_s = float(timers.get("affinity", {}).get("ttl_seconds", 600.0))
        self.owners: dict[int, tuple[str, float]] = {}
        self.outcome = Outcome(policy.name)

    def _match(self, prefixes: list[int], tokens: int, now: float) -> dict[str, int]:
        """Per worker URL, the tokens of the deepest prefix block it owns (the gateway's `longest_match`)."""
        matched: dict[str, int] = {}
        for i, p in enumerate(prefixes):
            entry = self.owners.get(p)
            if entry is not None and entry[1] > now:
                matched[entry[0]] = min((i + 1) * TRACE_BLOCK_TOKENS, tokens)
        return matched

    def _route(self, item: ScheduledRequest, prefixes: list[int], now: float) -> tuple[Worker, PrefillTicket | None]:
        req = item.request
        tokens = req.input_length
        workers = [sw.worker for sw in self.workers]
        policy = self.policy
        if isinstance(policy, CacheAwarePeer):
            chosen = policy.choose(prefixes, tokens, workers)
            policy.sent(chosen, prefixes, tokens)
            return chosen, None
        match = self._match(prefixes, tokens, now) if policy.uses_affinity else {}
        request = RoutingRequest(api="chat", model=MODEL, prompt_tokens=tokens, output_tokens=item.max_tokens,
                                 stream=True, modalities=frozenset({"text"}), estimate_method="bytes")
        model = policy.prefill_model
        candidates = []
        for w in workers:
            m = match.get(w.url, 0)
            if model is None:
                candidates.append(Candidate(w, w.load(), None, m / max(tokens, 1), m))
            else:
                load, state = w.load(), self.prefill.of(w)
                candidates.append(Candidate(w, load, None, m / max(tokens, 1), m,
                                            self.prefill.queued(w, state, model, load), model.rate(state, now),
                                            False, self.prefill.decoding(w, state, load), model.recent(state, now)))
        decision: Decision = policy.select(request, candidates)
        self.outcome.reasons[decision.reason] = self.outcome.reasons.get(decision.reason, 0) + 1
        chosen = decision.worker
        expiry = now + self.ttl_s
        for p in prefixes:
            self.owners[p] = (chosen.url, expiry)
        ticket = None
        if model is not None:
            ticket = self.prefill.start(chosen, model, max(tokens - match.get(chosen.url, 0), 0), True, now)
        return chosen, ticket

    async def _one(self, item: ScheduledRequest, floor: float) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, item.send_at_s - loop.time()))
        sent = loop.time()
        req = item.request
        prefixes = block_prefixes(req.hash_ids)
        worker, ticket = self._route(item, prefixes, sent)
        sw = self.workers[worker.index]
        worker.in_flight += 1
        tokens = req.input_length
        step_req = new_step_request(tokens, [prompt_key(req.hash_ids, tokens, self.s.kv_block_tokens)], 1,
                                    item.max_tokens)
        try:
            await asyncio.sleep(self.s.ttft_s)
            with sw.lock:
                sw.sched.enqueue(step_req)
            await step_req.wait_steps(0)
            self.outcome.ttfts.append(loop.time() - sent)
            self.outcome.requests.append((loop.time() - sent, tokens, step_req.cached_tokens))
            self.outcome.excess.append(loop.time() - sent - floor)
            if ticket is not None:
                ticket.first_byte(loop.time())
            first = loop.time()
            await step_req.wait_steps(item.max_tokens)
            if item.max_tokens > 1:
                self.outcome.tpots.append((loop.time() - first) / (item.max_tokens - 1))
        finally:
            with sw.lock:
                sw.sched.finish(step_req)
            if ticket is not None:
                ticket.close()
            worker.in_flight -= 1
            if isinstance(self.policy, CacheAwarePeer):
                self.policy.done(worker)

    async def _scrape(self) -> None:
        while True:
            for sw in self.workers:
                w = sw.worker
                w.engine_running = float(len(sw.sched.running))
                w.engine_waiting = float(sw.sched.waiting_count)
                w.in_flight_at_scrape = w.in_flight
            await asyncio.sleep(self.scrape_s)

    async def run(self, items: list[ScheduledRequest]) -> Outcome:
        scraper = asyncio.get_running_loop().create_task(self._scrape())
        lows = floors(items, self.s, self.sched_rate)
        await asyncio.gather(*(self._one(item, low) for item, low in zip(items, lows, strict=True)))
        scraper.cancel()
        await asyncio.gather(scraper, return_exceptions=True)
        for sw in self.workers:
            await sw.sched.aclose()
        prompt = sum(sw.totals.prompt_tokens for sw in self.workers)
        self.outcome.hit_ratio = sum(sw.totals.cached_tokens for sw in self.workers) / max(prompt, 1)
        prefill = [sw.totals.prefill_tokens for sw in self.workers]
        self.outcome.prefill_max_over_mean = max(prefill) / max(sum(prefill) / len(prefill), 1.0)
        self.outcome.preemptions = sum(sw.totals.preemptions for sw in self.workers)
        return self.outcome


def evaluate(s: Settings, items: list[ScheduledRequest], prefill_tps: float, name: str,
             params: dict[str, Any] | None = None, speedup: float | None = None) -> Outcome:
    """Run one policy (a gateway policy name, or "cache_aware" for the peer approximation) over
    `items` (scheduled at `speedup`, default `s.speedup`: it scales the gateway's timers as the
    replay does) on a fresh virtual-time loop; deterministic for the same inputs."""
    urls = [f"w{i}" for i in range(s.workers)]
    policy: RoutingPolicy | CacheAwarePeer = (CacheAwarePeer(urls) if name == "cache_aware"
                                              else build_policy(name, params))
    loop = VirtualTimeLoop()
    try:
        timers = gateway_overrides(s, s.speedup if speedup is None else speedup)
        return loop.run_until_complete(Evaluation(s, prefill_tps, policy, timers).run(items))
    finally:
        loop.close()


def main(argv: list[str] | None = None) -> int:
    """Parse the replay's flags, evaluate each policy and the `cache_aware` approximation at each
    load level (`--utilisation`, else `--speedup`), print a table per level."""
    argv = sys.argv[1:] if argv is None else argv
    s = rp.settings_from(rp.build_parser().parse_args(argv))
    if s.scheduler != "stepped":
        raise SystemExit("loadtest.vtime models the stepped scheduler only")
    rows = read_trace(s.trace, s.minutes, s.limit, s.from_minutes)
    names = [*s.policies, *(["cache_aware"] if any(peer.policy == "cache_aware" for peer in s.peers) else [])]
    for level in rp.plan_levels(s, rp.workload_of(rows, s)):
        items = schedule(rows, level.speedup, s.output_scale)
        prefill = level.prefill_tps or 0.0
        print(f"\n{len(items)} requests at {level.speedup:.1f}x (utilisation {level.utilisation}), prefill "
              f"{prefill:,.0f} tokens/s per worker, params {json.dumps(s.policy_params)} "
              "(virtual time: a tuning aid, not published figures)")
        print(TABLE_HEADER)
        for name in names:
            print(evaluate(s, items, prefill, name, s.policy_params.get(name), level.speedup).row(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
