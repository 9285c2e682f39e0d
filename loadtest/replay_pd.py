"""Prefill/decode (PD) layouts of the trace replay (`python -m loadtest.replay --layouts ...`).

    python -m loadtest.replay --layouts aggregated,pd,sglang-pd --policies prefix_affinity --peers none

Layouts, each run with fresh processes on the same schedule:

- `aggregated`: the policies and peers of `loadtest.replay` (N aggregated workers).
  Each PD layout is one `loadtest.layouts.Layout` appended to the replay's list (`layouts`), so it
  runs at every load level and repetition in the rotated order like the others.
- `pd`: the gateway with one PD pool (`disaggregation: {mode: sglang}`): `--pd-prefill` simulated
  SGLang prefill workers (`pd_role: prefill`) and `--pd-decode` decode workers (`pd_role:
  decode`), prefill policy `--pd-prefill-policy` (default prefix_affinity), decode policy
  `--pd-decode-policy` (default least_load).
- `sglang-pd`: sglang-router's PD mode (`launch_router --pd-disaggregation --prefill URL PORT
  --decode URL`, `--prefill-policy cache_aware --decode-policy power_of_two`) in front of the same
  kind of workers, its eviction interval and tree size scaled as the aggregated peer's
  (`loadtest.peers.peer_settings`, the tree sized to a prefill worker's KV). Skipped when
  sglang-router is not installed.

Sizing (defaults, see `PdSettings`): the prefill group gets the aggregated pool's totals, so both
layouts have the same prefill capacity and prefix-cache memory and differ in how they are split:
KV memory (2 prefill workers x 4M tokens against 8 x 1M) and, with the stepped worker model (one
prefill budget per worker), prefill speed (each prefill worker 4x the aggregated worker's), with
the per-request model, slots (2 x 16 against 8 x 4). The decode workers are added on top (at least
64 slots each, no prefix cache: each request's whole prompt KV is moved from its prefill worker, at
`--kv-transfer-tps`, default 10x the aggregated workers' prefill speed). In PD layouts the hit
ratio and the prefill spread are the prefill workers'; the decode workers' KV transfers and
requests go to `RunResult.pd`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from loadtest import oracle
from loadtest.layouts import (
    STARTUP_TIMEOUT_S,
    Launched,
    Layout,
    RunContext,
    deep_merge,
    gateway_config,
    gateway_overrides,
    launch_gateway,
    start_workers,
)
from loadtest.peers import Peer, peer_problem, peer_settings, start_router
from loadtest.procs import ProcessGroup, free_port
from loadtest.replay_settings import SIM_BYTES_PER_TOKEN, Settings, auto_or_positive, sim_fields
from loadtest.trace import TraceRequest
from loadtest.workerstats import WorkerTotals

LAYOUTS = ("aggregated", "pd", "sglang-pd")
GATEWAY_PD, PEER_PD = "gateway-pd", "peer-pd"
"""Run kinds of the two PD layouts (aggregated runs are "gateway" and "peer")."""
PROTOCOL = "sglang"
"""The PD protocol of every PD layout: the one sglang-router's PD mode speaks."""
AUTO_TRANSFER_FACTOR = 10.0
"""`--kv-transfer-tps auto`: KV moves this many times faster than one request's prefill computes it."""
DECODE_SEQS = 64
"""Fewest decode slots a worker gets by default (`config/k3-pd.yaml`'s decode_max_in_flight_per_worker):
enough that decode admission never waits, so a prefill never waits for its decode partner's slot."""


@dataclass(frozen=True)
class PdSettings:
    """The PD layouts of a replay and their workers. Slots are requests a worker runs at once
    (`max_num_seqs`), KV in tokens, speeds in tokens/s (`prefill_speedup`: a prefill worker's
    prefill speed / the aggregated worker's; transfer "auto": `AUTO_TRANSFER_FACTOR` x the
    aggregated prefill speed)."""

    layouts: list[str]
    prefill: int
    decode: int
    prefill_seqs: int
    prefill_kv_tokens: int
    prefill_speedup: float
    decode_seqs: int
    kv_transfer_tps: str
    prefill_policy: str
    decode_policy: str
    peer_prefill_policy: str
    peer_decode_policy: str

    def transfer_tps(self, prefill_tps: float | None) -> float | None:
        """KV transfer speed, tokens/s (None: instant, when the prefill speed is not modelled)."""
        if self.kv_transfer_tps != "auto":
            return float(self.kv_transfer_tps)
        return None if prefill_tps is None else AUTO_TRANSFER_FACTOR * prefill_tps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The PD options of `python -m loadtest.replay`."""
    add = parser.add_argument
    add("--layouts", default="aggregated",
        help=f"comma-separated, of {', '.join(LAYOUTS)}: aggregated = --policies and --peers over --workers; "
             "pd = the gateway's PD pool; sglang-pd = sglang-router --pd-disaggregation")
    add("--pd-prefill", type=int, default=2, help="PD layouts: prefill workers")
    add("--pd-decode", type=int, default=6, help="PD layouts: decode workers")
    add("--pd-prefill-seqs", type=int,
        help="slots of a prefill worker (default per_request: --max-num-seqs x --workers / --pd-prefill, the "
             "aggregated total; stepped: --max-num-seqs)")
    add("--pd-prefill-speedup", type=float,
        help="a prefill worker's prefill speed / an aggregated worker's (default stepped: --workers / "
             "--pd-prefill, the aggregated total; per_request: 1, its slots carry the total)")
    add("--pd-prefill-kv", type=int,
        help="KV tokens of a prefill worker (default: --kv-capacity x --workers / --pd-prefill, the aggregated total)")
    add("--pd-decode-seqs", type=int,
        help=f"slots of a decode worker (default: --max-num-seqs, at least {DECODE_SEQS})")
    add("--kv-transfer-tps", type=auto_or_positive, default="auto",
        help=f"KV transfer, prompt tokens/s, or 'auto' ({AUTO_TRANSFER_FACTOR:g} x an aggregated worker's prefill)")
    add("--pd-prefill-policy", default="prefix_affinity", help="the gateway PD pool's prefill_policy")
    add("--pd-decode-policy", default="least_load", help="the gateway PD pool's decode_policy")
    add("--peer-prefill-policy", default="cache_aware", help="sglang-router PD: --prefill-policy")
    add("--peer-decode-policy", default="power_of_two", help="sglang-router PD: --decode-policy")


def pd_settings(args: argparse.Namespace, s: Settings) -> tuple[Settings, PdSettings]:
    """The PD settings from the parsed options, and `s` without its policies and peers when the
    aggregated layout is not asked for. Raises SystemExit for a bad option."""
    layouts = [v.strip() for v in args.layouts.split(",") if v.strip()]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown or not layouts:
        raise SystemExit(f"--layouts: want some of {', '.join(LAYOUTS)}, got {args.layouts!r}")
    if min(args.pd_prefill, args.pd_decode, args.pd_decode_seqs or 1, args.pd_prefill_speedup or 1) <= 0:
        raise SystemExit("--pd-prefill, --pd-decode, --pd-decode-seqs and --pd-prefill-speedup must be positive")
    share = s.workers / args.pd_prefill
    stepped = s.scheduler == "stepped"
    pd = PdSettings(
        layouts=layouts, prefill=args.pd_prefill, decode=args.pd_decode,
        prefill_seqs=args.pd_prefill_seqs or (s.max_num_seqs if stepped else math.ceil(s.max_num_seqs * share)),
        prefill_kv_tokens=args.pd_prefill_kv or math.ceil(s.kv_capacity_tokens * share),
        prefill_speedup=args.pd_prefill_speedup or (share if stepped else 1.0),
        decode_seqs=args.pd_decode_seqs or max(DECODE_SEQS, s.max_num_seqs), kv_transfer_tps=args.kv_transfer_tps,
        prefill_policy=args.pd_prefill_policy, decode_policy=args.pd_decode_policy,
        peer_prefill_policy=args.peer_prefill_policy, peer_decode_policy=args.peer_decode_policy)
    if "aggregated" not in layouts:
        s = replace(s, policies=[], peers=[])
    return s, pd


def layouts(pd: PdSettings) -> list[Layout]:
    """The PD layouts asked for, in the replay's layout list order (after the aggregated ones)."""
    out: list[Layout] = []
    if "pd" in pd.layouts:
        out.append(Layout(f"pd:{pd.prefill_policy}+{pd.decode_policy}", GATEWAY_PD, _launcher(GATEWAY_PD, pd)))
    if "sglang-pd" in pd.layouts:
        out.append(Layout(f"sglang-router-pd:{pd.peer_prefill_policy}+{pd.peer_decode_policy}", PEER_PD,
                          _launcher(PEER_PD, pd), peer_problem(PEER)))
    return out


def describe(pd: PdSettings, prefill_tps: float | None) -> dict[str, Any]:
    """The PD settings for the result files (empty without a PD layout)."""
    if not set(pd.layouts) - {"aggregated"}:
        return {}
    transfer = pd.transfer_tps(prefill_tps)
    return {
        "layouts": ",".join(pd.layouts),
        "PD workers": f"{pd.prefill} prefill x {pd.prefill_seqs} slots x {pd.prefill_kv_tokens:,} KV tokens x "
                      f"{pd.prefill_speedup:g} prefill speed; {pd.decode} decode x {pd.decode_seqs} slots, "
                      "no prefix cache",
        "PD protocol": PROTOCOL,
        "KV transfer (tokens/s)": "instant" if transfer is None else round(transfer),
        "gateway PD policies": f"prefill {pd.prefill_policy}, decode {pd.decode_policy}",
        "sglang-router PD policies": f"prefill {pd.peer_prefill_policy}, decode {pd.peer_decode_policy}",
    }


def references(rows: list[TraceRequest], pd: PdSettings) -> list[oracle.OracleResult]:
    """The offline round-robin reference of the prefill group (empty without a PD layout)."""
    if not set(pd.layouts) - {"aggregated"}:
        return []
    rr = oracle.references(rows, pd.prefill, pd.prefill_kv_tokens)[0]
    return [replace(rr, name=f"round_robin over {pd.prefill} prefill workers")]


def role_fields(s: Settings, pd: PdSettings, role: str, prefill_tps: float | None) -> dict[str, Any]:
    """SimConfig fields of a PD worker: the aggregated workers' with its role, slots and KV."""
    fields = {**sim_fields(s, prefill_tps), "pd_role": role, "pd_protocol": PROTOCOL}
    if role == "prefill":
        fields.update(max_num_seqs=pd.prefill_seqs, kv_capacity_tokens=pd.prefill_kv_tokens)
        if prefill_tps is not None:
            fields["prefill_tokens_per_s"] = prefill_tps * pd.prefill_speedup
        return fields
    fields.update(max_num_seqs=pd.decode_seqs, kv_capacity_tokens=None)
    transfer = pd.transfer_tps(prefill_tps)
    if transfer is not None:
        fields["kv_transfer_tokens_per_s"] = transfer
    return fields


def pd_gateway_config(port: int, prefill_urls: list[str], decode_urls: list[str], s: Settings,
                      pd: PdSettings, speedup: float) -> dict[str, Any]:
    """The gateway config of the `pd` layout at `speedup`: the replay's pool as a PD pool of these
    workers (each prefill worker's bootstrap port is its HTTP port, where the simulator answers it)."""
    config = gateway_config(port, [], pd.prefill_policy, None, gateway_overrides(s, speedup))
    pool = config["pools"][0]
    for key in ("workers", "policy", "policy_params"):
        pool.pop(key, None)
    pool["disaggregation"] = deep_merge({
        "mode": PROTOCOL,
        "prefill": [{"url": url, "bootstrap_port": int(url.rsplit(":", 1)[1])} for url in prefill_urls],
        "decode": decode_urls,
        "prefill_policy": pd.prefill_policy,
        "decode_policy": pd.decode_policy,
    }, {f"{role}_policy_params": s.policy_params[name]
        for role, name in (("prefill", pd.prefill_policy), ("decode", pd.decode_policy)) if name in s.policy_params})
    return config


def peer_args(prefill_urls: list[str], decode_urls: list[str], pd: PdSettings) -> list[str]:
    """sglang-router's PD worker arguments: `--prefill URL BOOTSTRAP_PORT` per prefill worker,
    `--decode URL` per decode worker, and the two policies."""
    args = ["--pd-disaggregation"]
    for url in prefill_urls:
        args += ["--prefill", url, url.rsplit(":", 1)[1]]
    for url in decode_urls:
        args += ["--decode", url]
    return [*args, "--prefill-policy", pd.peer_prefill_policy, "--decode-policy", pd.peer_decode_policy]


def decode_figures(totals: list[WorkerTotals]) -> dict[str, Any]:
    """The decode workers' part of a PD run: requests per worker, KV transfers and their mean time
    (seconds) and size (tokens)."""
    transfers = sum(w.counters.get("pd_transfers", 0.0) for w in totals)
    seconds = sum(w.counters.get("pd_transfer_seconds", 0.0) for w in totals)
    tokens = sum(w.counters.get("pd_transferred_tokens", 0.0) for w in totals)
    return {
        "requests by decode worker": [round(w.counters.get("requests", 0.0)) for w in totals],
        "KV transfers": round(transfers),
        "mean KV transfer (s)": round(seconds / transfers, 4) if transfers else None,
        "mean transferred tokens": round(tokens / transfers) if transfers else None,
        "peak running by decode worker": [round(w.peaks.get("max_running", 0.0)) for w in totals],
    }


PEER = Peer("sglang-router", "cache_aware")
"""The router of the `sglang-pd` layout (its PD policies are `--peer-prefill/decode-policy`)."""


def _launcher(kind: str, pd: PdSettings) -> Callable[[ProcessGroup, RunContext], Launched]:
    """Starts fresh prefill and decode workers, then the gateway's PD pool (`kind` GATEWAY_PD) or
    sglang-router's PD mode (PEER_PD) in front; the decode workers' totals go to `RunResult.pd`."""

    def launch(group: ProcessGroup, ctx: RunContext) -> Launched:
        s, level = ctx.settings, ctx.level
        prefill_urls, dropped = start_workers(group, s, level.prefill_tps, pd.prefill,
                                              role_fields(s, pd, "prefill", level.prefill_tps), "prefill")
        decode_urls, more = start_workers(group, s, level.prefill_tps, pd.decode,
                                          role_fields(s, pd, "decode", level.prefill_tps), "decode")
        if kind == GATEWAY_PD:
            port = free_port()
            base = launch_gateway(group, pd_gateway_config(port, prefill_urls, decode_urls, s, pd, level.speedup),
                                  port)
            details = {"gateway overrides": gateway_overrides(s, level.speedup)}
            return Launched(base, prefill_urls, dropped + more, details, side_urls=decode_urls,
                            side_figures=decode_figures)
        scaled = peer_settings(PEER, level.speedup, pd.prefill_kv_tokens, SIM_BYTES_PER_TOKEN, s.peer_scale)
        base, _ = start_router(group, PEER, peer_args(prefill_urls, decode_urls, pd), pd.prefill + pd.decode,
                               scaled.flags, STARTUP_TIMEOUT_S)
        return Launched(base, prefill_urls, dropped + more, {"flags": scaled.mapping},
                        side_urls=decode_urls, side_figures=decode_figures)

    return launch
