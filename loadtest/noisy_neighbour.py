"""Noisy-neighbour benchmark of flow control (issue 39): does a tenant's burst hurt another tenant?

    python -m loadtest.noisy_neighbour --quick          # ~6 min on a busy 2-core machine
    python -m loadtest.noisy_neighbour                  # longer windows, more samples
    python -m loadtest.noisy_neighbour --replicas-only  # the two-replica scenarios (docs/flow-control.md)

Workers: `--workers` simulated SGLang engines with the stepped engine model (`gateway.sim.stepper`:
one prefill budget per worker in chunks, batched decode steps, at most `--max-num-seqs` running),
in one worker-host process (`loadtest.workers`), fresh for every scenario. Requests: streaming chat
completions of `--prompt-tokens` (unique text: no prefix cache hits) and `--output-tokens`.

Capacity C (requests/s) is measured first: a closed loop of 2 x workers x max_num_seqs clients
through the gateway (flow control off) for `--calibrate-s` s. Then tenant A sends 3 C (`--a-factor`)
and tenant B 0.2 C (`--b-share`), each a Poisson stream (`--seed`), for `--window-s` s; requests
still open `--drain-s` s after the window are cancelled (an unfinished B request counts as a TTFT
above its wait so far: its percentile shows as `>`). Scenarios, each with fresh workers:

- `alone`: B only, through the gateway (flow control off): the reference TTFT.
- `off`: A floods, B steady, through the gateway as it was before flow control (the default).
- `on`: the same with flow control on the pool (`max_waiting`, fair by tokens, one band).
- `sglang-router`: the same behind SGLang's router (`sglang_router.launch_router`, cache_aware,
  its defaults: no rate limit, `loadtest.peers`).
- `bands`: flow control on, B's key in band 1, A's in band 0.
- with `--replicas 2` (or `--replicas-only`): `on-2`, two gateway replicas over the same workers,
  each tenant's requests alternating between them (as a load balancer spreads them), and `split-2`,
  A's requests all on one replica and B's all on the other (each replica's queue sees one tenant).

Reported per scenario: B's requests, p50 / p99 TTFT and their ratio to `alone`; A's and all
completed requests per second within the window (work conservation: flow control must not lower
the total), A's refusals (429/503). The table goes to stdout and `loadtest/results/noisy-<ts>.{md,json}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.auth.keys import hash_key
from loadtest.loadgen import RequestResult, chat_body, send_one
from loadtest.peers import Peer, PeerSettings, peer_problem, peer_version, start_peer
from loadtest.procs import ProcessGroup, child_env, free_port, python_argv
from loadtest.report import percentile

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL = "kimi-k3"
MAX_CONTEXT_TOKENS = 131_072
BYTES_PER_TOKEN = 4.0  # the simulator's default: prompt tokens = bytes / 4
STARTUP_TIMEOUT_S = 60.0
SCENARIOS = ("alone", "off", "on", "sglang-router", "bands")
REPLICA_SCENARIOS = ("on-2", "split-2")
PEER = Peer("sglang-router", "cache_aware")


@dataclass(frozen=True)
class Settings:
    """One benchmark's shape. Seconds, requests, tokens."""

    workers: int = 4
    max_num_seqs: int = 8
    prompt_tokens: int = 16000
    output_tokens: int = 32
    prefill_tps: float = 20_000.0
    window_s: float = 60.0
    drain_s: float = 20.0
    calibrate_s: float = 20.0
    a_factor: float = 3.0
    b_share: float = 0.2
    max_waiting: int = 2
    max_prefill_tokens: int = 8192
    load_interval_s: float = 0.1
    queue_timeout_s: float = 30.0
    seed: int = 39
    gateway_log: str = "warning"
    scenarios: tuple[str, ...] = SCENARIOS
    capacity: float | None = None  # requests/s; None: measured


@dataclass
class ScenarioResult:
    """What one scenario measured (see the module docstring)."""

    name: str
    b_sent: int = 0
    b_ok: int = 0
    b_unfinished: int = 0
    b_ttft_p50_s: float | None = None
    b_ttft_p50_censored: bool = False
    b_ttft_p99_s: float | None = None
    b_ttft_p99_censored: bool = False
    a_sent: int = 0
    a_ok_per_s: float = 0.0
    a_refused: int = 0
    a_errors: int = 0
    all_ok_per_s: float = 0.0
    a_ttft_p50_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)


# --- processes ----------------------------------------------------------------------------------------


def sim_fields(s: Settings) -> dict[str, Any]:
    """The simulated SGLang engines: the stepped model, `max_num_seqs` running, no prefix cache."""
    return {"engine": "sglang", "served_model_names": [MODEL], "max_context_tokens": MAX_CONTEXT_TOKENS,
            "scheduler": "stepped", "prefill_tokens_per_s": s.prefill_tps, "max_num_seqs": s.max_num_seqs,
            "default_output_tokens": s.output_tokens, "keep_records": False}


def start_workers(group: ProcessGroup, s: Settings) -> list[str]:
    """A worker-host process with `s.workers` simulated engines; their base URLs."""
    spec, ports = group.log_dir / "workers-spec.json", group.log_dir / "workers-ports.json"
    spec.write_text(json.dumps({"count": s.workers, "sim": sim_fields(s)}), encoding="utf-8")
    ports.unlink(missing_ok=True)
    proc = group.spawn("workers", python_argv("loadtest.workers", "--spec", str(spec), "--ports-file", str(ports)),
                       env=child_env())
    proc.wait_until(ports.exists, STARTUP_TIMEOUT_S, "listening")
    urls = [f"http://127.0.0.1:{p}" for p in json.loads(ports.read_text(encoding="utf-8"))["ports"]]
    for url in urls:
        proc.wait_http(url + "/health", STARTUP_TIMEOUT_S)
    return urls


def gateway_config(s: Settings, port: int, urls: list[str], keys: dict[str, str], flow: bool,
                   b_band: int = 0) -> dict[str, Any]:
    """One SGLang pool of `urls`, auth with tenant keys `a` and `b` (B in `b_band`), flow control on
    or off, the engines' load scraped every `load_interval_s`."""
    pool: dict[str, Any] = {"name": "pool", "engine": "sglang", "workers": urls,
                            "max_context_tokens": MAX_CONTEXT_TOKENS, "default_output_tokens": s.output_tokens,
                            "spillover": False}
    if flow:
        pool["flow_control"] = {"enabled": True, "max_waiting": s.max_waiting,
                                "max_prefill_tokens": s.max_prefill_tokens}
    key_entries = [{"name": "tenant-a", "sha256": hash_key(keys["a"])},
                   {"name": "tenant-b", "sha256": hash_key(keys["b"]), "priority": b_band}]
    return {"host": "127.0.0.1", "port": port, "log_level": s.gateway_log, "model": {"name": MODEL, "aliases": []},
            "pools": [pool], "load": {"interval": s.load_interval_s}, "health": {"interval": 2.0},
            "shutdown": {"drain_delay": 0}, "auth": {"enabled": True, "keys": key_entries},
            "flow_control": {"queue_timeout": s.queue_timeout_s, "max_queued_per_flow": 4096, "max_queued": 8192}}


def start_gateway(group: ProcessGroup, config: dict[str, Any], name: str = "gateway") -> str:
    """`kimi-gateway serve` with `config`; its base URL once `/ready` answers 200."""
    path = group.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = {k: v for k, v in child_env().items() if not k.startswith("KIMI_GATEWAY_")}
    proc = group.spawn(name, python_argv("gateway.cli", "serve", "-c", str(path)), env=env)
    base = f"http://127.0.0.1:{config['port']}"
    proc.wait_http(base + "/ready", STARTUP_TIMEOUT_S)
    return base


# --- load -----------------------------------------------------------------------------------------------


def poisson(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Send times (s) of a Poisson stream of `rate` per second over `seconds`."""
    times, t = [], 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        times.append(t)
    return times


def prompt(s: Settings, tenant: str, index: int) -> str:
    """A unique prompt of `s.prompt_tokens` simulator tokens (no prefix shared with another)."""
    head = f"{tenant}-{index}-{secrets.token_hex(8)} "
    size = int(s.prompt_tokens * BYTES_PER_TOKEN)
    return (head + "lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]


@dataclass
class Tenant:
    """One tenant's stream: its name, API key (None: no auth), send times and where it sends."""

    name: str
    key: str | None
    times: list[float]
    bases: list[str]


async def run_load(s: Settings, tenants: list[Tenant]) -> tuple[dict[str, list[RequestResult]], float]:
    """Send every tenant's stream (round-robin over its `bases`); wait `drain_s` after the window,
    then cancel what is still open. Returns each tenant's results and the load's start (monotonic)."""
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512, keepalive_expiry=30.0)
    timeout = httpx.Timeout(connect=10.0, read=s.window_s + s.drain_s + 60, write=30.0, pool=None)
    results: dict[str, list[RequestResult]] = {t.name: [] for t in tenants}
    tasks: list[asyncio.Task[None]] = []
    clients = [httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                                 headers={"authorization": f"Bearer {t.key}"} if t.key else {}) for t in tenants]
    t0 = time.monotonic()
    try:
        async def one(client: httpx.AsyncClient, url: str, body: bytes, result: RequestResult, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            await send_one(client, url, body, result, t0)

        for tenant, client in zip(tenants, clients, strict=True):
            for i, at in enumerate(tenant.times):
                result = RequestResult(i, at, f"{tenant.name}-{i}")
                results[tenant.name].append(result)
                url = tenant.bases[i % len(tenant.bases)] + "/v1/chat/completions"
                body = chat_body(MODEL, prompt(s, tenant.name, i), s.output_tokens)
                tasks.append(asyncio.create_task(one(client, url, body, result, at)))
        _, pending = await asyncio.wait(tasks, timeout=s.window_s + s.drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for client in clients:
            await client.aclose()
    return results, t0


def censored_percentile(values: list[float], censored: int, q: float, ceiling: float) -> tuple[float | None, bool]:
    """The `q`-th percentile of `values` plus `censored` values known only to exceed `ceiling`:
    (value, False), or (`ceiling`, True) when the percentile falls among the censored ones."""
    total = len(values) + censored
    if not total:
        return None, False
    if censored and math.ceil(q / 100 * total) > len(values):
        return ceiling, True
    return percentile(values, q * total / len(values) if censored else q), False


def summarise(name: str, s: Settings, results: dict[str, list[RequestResult]]) -> ScenarioResult:
    """B's TTFT percentiles (unfinished requests counted above the whole run), A's and everyone's
    completed requests per second within the window, A's refusals."""
    out = ScenarioResult(name)
    bs, as_ = results.get("b", []), results.get("a", [])
    out.b_sent = sum(1 for r in bs if r.sent_s is not None)
    ok_b = [r for r in bs if r.ttft_s is not None]
    out.b_ok = sum(1 for r in bs if r.ok)
    out.b_unfinished = out.b_sent - len(ok_b)
    ttfts = sorted(r.ttft_s for r in ok_b if r.ttft_s is not None)
    ceiling = s.window_s + s.drain_s  # an unfinished request's TTFT is above this
    p50, out.b_ttft_p50_censored = censored_percentile(ttfts, out.b_unfinished, 50, ceiling)
    p99, out.b_ttft_p99_censored = censored_percentile(ttfts, out.b_unfinished, 99, ceiling)
    out.b_ttft_p50_s, out.b_ttft_p99_s = p50, p99
    out.a_sent = sum(1 for r in as_ if r.sent_s is not None)
    out.a_refused = sum(1 for r in as_ if r.status in (429, 503))
    out.a_errors = sum(1 for r in as_ if r.error is not None and r.status not in (429, 503))

    def done_in_window(r: RequestResult) -> bool:
        return r.ok and r.sent_s is not None and r.e2e_s is not None and r.sent_s + r.e2e_s <= s.window_s

    out.a_ok_per_s = sum(1 for r in as_ if done_in_window(r)) / s.window_s
    out.all_ok_per_s = out.a_ok_per_s + sum(1 for r in bs if done_in_window(r)) / s.window_s
    a_ttfts = [r.ttft_s for r in as_ if r.ttft_s is not None]
    out.a_ttft_p50_s = percentile(a_ttfts, 50) if a_ttfts else None
    return out


# --- scenarios -----------------------------------------------------------------------------------------


def calibrate(s: Settings, workdir: Path) -> float:
    """The pool's capacity in requests/s: completed by a closed loop of 2 x workers x max_num_seqs
    clients through the gateway (flow control off) over `calibrate_s` s, after a warm-up."""
    keys = {"a": "sk-a-" + secrets.token_urlsafe(32), "b": "sk-b-" + secrets.token_urlsafe(32)}
    with ProcessGroup(workdir / "calibrate") as group:
        urls = start_workers(group, s)
        base = start_gateway(group, gateway_config(s, free_port(), urls, keys, flow=False))
        return asyncio.run(_closed_loop(s, base, keys["a"], 2 * s.workers * s.max_num_seqs))


async def _closed_loop(s: Settings, base: str, key: str, clients: int) -> float:
    done: list[float] = []
    stop = time.monotonic() + 5.0 + s.calibrate_s
    start = time.monotonic() + 5.0  # warm-up: the batches fill
    timeout = httpx.Timeout(connect=10.0, read=120.0, write=30.0, pool=None)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False, headers={"authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=clients * 2)) as client:
        async def loop(n: int) -> None:
            i = 0
            while time.monotonic() < stop:
                result = RequestResult(i, 0.0, f"cal-{n}-{i}")
                await send_one(client, base + "/v1/chat/completions",
                               chat_body(MODEL, prompt(s, f"cal{n}", i), s.output_tokens), result, 0.0)
                if result.ok and start <= time.monotonic() <= stop:
                    done.append(time.monotonic())
                i += 1

        await asyncio.gather(*(loop(n) for n in range(clients)))
    return len(done) / s.calibrate_s


def run_scenario(name: str, s: Settings, capacity: float, workdir: Path) -> ScenarioResult:
    """One scenario with fresh workers (see the module docstring)."""
    rng = random.Random(f"{s.seed}")
    a_times = poisson(s.a_factor * capacity, s.window_s, rng)
    b_times = poisson(s.b_share * capacity, s.window_s, random.Random(f"{s.seed}-b"))
    keys = {"a": "sk-a-" + secrets.token_urlsafe(32), "b": "sk-b-" + secrets.token_urlsafe(32)}
    details: dict[str, Any] = {}
    with ProcessGroup(workdir / name) as group:
        urls = start_workers(group, s)
        if name == "sglang-router":
            base, _ = start_peer(group, urls, PEER, PeerSettings([], {}), STARTUP_TIMEOUT_S)
            details["router"] = peer_version(PEER)
            tenants = [Tenant("a", None, a_times, [base]), Tenant("b", None, b_times, [base])]
        elif name in REPLICA_SCENARIOS:
            bases = [start_gateway(group, gateway_config(s, free_port(), urls, keys, flow=True), f"gateway-{i}")
                     for i in range(2)]
            a_bases, b_bases = (bases, bases) if name == "on-2" else ([bases[0]], [bases[1]])
            tenants = [Tenant("a", keys["a"], a_times, a_bases), Tenant("b", keys["b"], b_times, b_bases)]
        else:
            flow = name in ("on", "bands")
            base = start_gateway(group, gateway_config(s, free_port(), urls, keys, flow, 1 if name == "bands" else 0))
            tenants = [Tenant("b", keys["b"], b_times, [base])]
            if name != "alone":
                tenants.insert(0, Tenant("a", keys["a"], a_times, [base]))
        results, _ = asyncio.run(run_load(s, tenants))
    out = summarise(name, s, results)
    out.details = details
    return out


# --- report ---------------------------------------------------------------------------------------------


def fmt_s(value: float | None, censored: bool = False) -> str:
    if value is None:
        return "-"
    return (">" if censored else "") + f"{value:.2f}"


def table(results: list[ScenarioResult], alone: ScenarioResult | None) -> str:
    rows = ["| scenario | B sent | B unfinished | B TTFT p50 s | B TTFT p99 s | B p99 / alone | "
            "A done/s | all done/s | A refused (429/503) | A TTFT p50 s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = alone.b_ttft_p99_s if alone is not None else None
    for r in results:
        ratio = "-" if not base or r.b_ttft_p99_s is None else \
            ((">" if r.b_ttft_p99_censored else "") + f"{r.b_ttft_p99_s / base:.2f}x")
        rows.append(f"| {r.name} | {r.b_sent} | {r.b_unfinished} | {fmt_s(r.b_ttft_p50_s, r.b_ttft_p50_censored)} | "
                    f"{fmt_s(r.b_ttft_p99_s, r.b_ttft_p99_censored)} | {ratio} | {r.a_ok_per_s:.2f} | "
                    f"{r.all_ok_per_s:.2f} | {r.a_refused} | {fmt_s(r.a_ttft_p50_s)} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="shorter windows (40 s), calibration 15 s")
    add("--workers", type=int, default=Settings.workers)
    add("--max-num-seqs", type=int, default=Settings.max_num_seqs)
    add("--prompt-tokens", type=int, default=Settings.prompt_tokens)
    add("--output-tokens", type=int, default=Settings.output_tokens)
    add("--window-s", type=float, help="seconds of load per scenario (default 60; quick 40)")
    add("--a-factor", type=float, default=Settings.a_factor, help="A's rate as a multiple of the capacity")
    add("--b-share", type=float, default=Settings.b_share, help="B's rate as a share of the capacity")
    add("--max-waiting", type=int, default=Settings.max_waiting, help="the pool's flow_control.max_waiting")
    add("--max-prefill-tokens", type=int, default=Settings.max_prefill_tokens,
        help="the pool's flow_control.max_prefill_tokens")
    add("--capacity", type=float, help="requests/s of the pool (skip the calibration)")
    add("--scenarios", help=f"comma-separated, of {', '.join(SCENARIOS + REPLICA_SCENARIOS)}")
    add("--replicas", type=int, default=1, choices=(1, 2), help="2: also the two-replica scenarios")
    add("--replicas-only", action="store_true", help="alone and the two-replica scenarios only")
    add("--seed", type=int, default=Settings.seed)
    add("--gateway-log", default=Settings.gateway_log, choices=("warning", "info"),
        help="info: the gateways' access logs (each request's queued_s, ttft_s) in the run's logs folder")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    s = Settings(workers=args.workers, max_num_seqs=args.max_num_seqs, prompt_tokens=args.prompt_tokens,
                 output_tokens=args.output_tokens, a_factor=args.a_factor, b_share=args.b_share,
                 max_waiting=args.max_waiting, max_prefill_tokens=args.max_prefill_tokens, seed=args.seed,
                 capacity=args.capacity, gateway_log=args.gateway_log)
    if args.quick:
        s = replace(s, window_s=40.0, calibrate_s=15.0, drain_s=15.0)
    if args.window_s:
        s = replace(s, window_s=args.window_s)
    scenarios = tuple(args.scenarios.split(",")) if args.scenarios else SCENARIOS
    if args.replicas == 2:
        scenarios += REPLICA_SCENARIOS
    if args.replicas_only:
        scenarios = ("alone", *REPLICA_SCENARIOS)
    unknown = set(scenarios) - set(SCENARIOS + REPLICA_SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios: {sorted(unknown)}")
    return replace(s, scenarios=scenarios)


def main(argv: list[str] | None = None) -> None:
    s = settings_from(build_parser().parse_args(argv))
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = RESULTS_DIR / f"noisy-{stamp}-logs"
    started = time.monotonic()
    if "sglang-router" in s.scenarios and (problem := peer_problem(PEER)) is not None:
        print(f"skipping sglang-router: {problem}")
        s = replace(s, scenarios=tuple(x for x in s.scenarios if x != "sglang-router"))
    capacity = s.capacity if s.capacity is not None else calibrate(s, workdir)
    print(f"capacity: {capacity:.2f} requests/s ({s.workers} workers x max_num_seqs {s.max_num_seqs}, "
          f"{s.prompt_tokens} prompt + {s.output_tokens} output tokens); A {s.a_factor:g}x = "
          f"{s.a_factor * capacity:.2f}/s, B {s.b_share:g}x = {s.b_share * capacity:.2f}/s, {s.window_s:g} s each",
          flush=True)
    results = []
    for name in s.scenarios:
        result = run_scenario(name, s, capacity, workdir)
        results.append(result)
        print(f"  {name}: B p50 {fmt_s(result.b_ttft_p50_s, result.b_ttft_p50_censored)} s, p99 "
              f"{fmt_s(result.b_ttft_p99_s, result.b_ttft_p99_censored)} s ({result.b_sent} sent, "
              f"{result.b_unfinished} unfinished); A {result.a_ok_per_s:.2f}/s done, {result.a_refused} refused; "
              f"all {result.all_ok_per_s:.2f}/s", flush=True)
    alone = next((r for r in results if r.name == "alone"), None)
    text = table(results, alone)
    command = "python -m loadtest.noisy_neighbour " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    header = (f"Noisy neighbour, {stamp}: `{command.strip()}`; capacity {capacity:.2f} req/s; {s.workers} simulated "
              f"SGLang workers (stepped, max_num_seqs {s.max_num_seqs}, prefill {s.prefill_tps:g} tok/s), "
              f"{s.prompt_tokens}+{s.output_tokens} tokens a request; A {s.a_factor:g}x, B {s.b_share:g}x of capacity; "
              f"flow control max_waiting {s.max_waiting}, max_prefill_tokens {s.max_prefill_tokens}, load.interval "
              f"{s.load_interval_s:g} s; window {s.window_s:g} s + drain {s.drain_s:g} s "
              f"({time.monotonic() - started:.0f} s in all).")
    print("\n" + header + "\n\n" + text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"noisy-{stamp}.md").write_text(header + "\n\n" + text + "\n", encoding="utf-8")
    (RESULTS_DIR / f"noisy-{stamp}.json").write_text(json.dumps(
        {"settings": asdict(s), "capacity": capacity, "results": [asdict(r) for r in results]}, indent=1),
        encoding="utf-8")


if __name__ == "__main__":
    main()
