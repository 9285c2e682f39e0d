"""Figures of one run per routing policy, the comparison tables, and the result files.

The main table has one row per (load level, layout): the median of each figure over the
repetitions with its min-max range (`loadtest.spread`); the per-run table lists every run in the
order it ran. Per run: block hit ratio = cached prompt tokens / prompt tokens summed over all workers (from the
workers' `/sim/stats`; else from the `usage.prompt_tokens_details.cached_tokens` the client saw),
p50/p99 TTFT and TPOT at the client (seconds), the busiest worker's prefill (uncached) tokens / the
mean over workers, completed requests per second of replay, and errors. In a prefill/decode (PD)
layout the hit ratio and the prefill spread are those of the prefill workers (`loadtest.replay_pd`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from loadtest.loadgen import RequestResult
from loadtest.oracle import OracleResult
from loadtest.spread import Aggregate, Spread, aggregate, fmt_spread
from loadtest.ttft_split import BUSY_FLAG, RequestSplit, percentile, split_section
from loadtest.workerstats import WorkerTotals


@dataclass
class RunResult:
    """The outcome of one policy (or peer router) run. Times in seconds, tokens in tokens.

    `status` is "ok", "skipped: <why>" or "failed: <why>". `hit_source` says where the hit ratio
    comes from ("sim/stats", "client usage" or "n/a"). `prefill_by_worker` is in worker order.
    `tpot_*_s`: client-side time per output token (first to last token / (tokens - 1)). `pd`: a
    PD layout's decode-side totals (`loadtest.replay_pd.decode_figures`), empty otherwise. `split`:
    where its TTFT went (`loadtest.ttft_split.summarize`), empty when the workers kept no timings;
    `request_splits` are its requests' splits (kept in memory for the gap section, not in `to_json`).
    """

    name: str
    kind: str
    status: str = "ok"
    level: str = ""
    utilisation: float | None = None
    speedup: float | None = None
    repeat: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    scheduled: int = 0
    sent: int = 0
    ok: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    hit_ratio: float | None = None
    hit_source: str = "n/a"
    client_hit_ratio: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    e2e_p50_s: float | None = None
    send_lag_p99_s: float | None = None
    prefill_max_over_mean: float | None = None
    prefill_by_worker: list[float] = field(default_factory=list)
    requests_by_worker: list[float] = field(default_factory=list)
    max_waiting_by_worker: list[float] = field(default_factory=list)
    req_per_s: float | None = None
    replay_s: float | None = None
    total_s: float | None = None
    error_samples: list[str] = field(default_factory=list)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    machine_busy: float | None = None
    pd: dict[str, Any] = field(default_factory=dict)
    split: dict[str, Any] = field(default_factory=dict)
    request_splits: list[RequestSplit] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["request_splits"]
        return out


BUSY_WARNING = BUSY_FLAG
"""Machine CPU busy fraction above which a run is flagged: the load generator, the gateway and the
workers share 2 cores, so a saturated machine measures itself, not the routing."""


def _error_kind(message: str) -> str:
    """A short class of an error message, for counting (e.g. "HTTP 503", "ReadTimeout")."""
    head = message.split(":", 1)[0]
    return head[:60]


def summarize_run(name: str, kind: str, results: list[RequestResult], workers: list[WorkerTotals],
                  replay_s: float) -> RunResult:
    """Aggregate the client's results and the workers' totals of one run."""
    run = RunResult(name, kind, scheduled=len(results), replay_s=replay_s)
    sent = [r for r in results if r.sent_s is not None]
    ok = [r for r in results if r.ok]
    run.sent, run.ok = len(sent), len(ok)
    failed = [r for r in results if r.error is not None and r.sent_s is not None]
    run.errors = len(failed)
    run.error_kinds = dict(Counter(_error_kind(r.error or "") for r in failed).most_common(5))
    run.error_samples = list(dict.fromkeys(r.error or "" for r in failed))[:3]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    run.ttft_p50_s, run.ttft_p99_s = percentile(ttfts, 50), percentile(ttfts, 99)
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    run.tpot_p50_s, run.tpot_p99_s = percentile(tpots, 50), percentile(tpots, 99)
    run.e2e_p50_s = percentile([r.e2e_s for r in ok if r.e2e_s is not None], 50)
    run.send_lag_p99_s = percentile([r.sent_s - r.scheduled_s for r in sent if r.sent_s is not None], 99)
    if ok:
        first = min(r.sent_s or 0.0 for r in ok)
        last = max((r.sent_s or 0.0) + (r.e2e_s or 0.0) for r in ok)
        run.req_per_s = len(ok) / (last - first) if last > first else None
    client_prompt = sum(r.prompt_tokens or 0 for r in ok)
    with_cached = [r for r in ok if r.cached_tokens is not None]
    if with_cached and client_prompt:
        run.client_hit_ratio = sum(r.cached_tokens or 0 for r in with_cached) / client_prompt
    stats_known = bool(workers) and all(w.source == "sim/stats" for w in workers)
    prompt = sum(w.prompt_tokens for w in workers)
    if stats_known and prompt > 0:
        run.hit_ratio = sum(w.cached_tokens or 0.0 for w in workers) / prompt
        run.hit_source = "sim/stats"
    elif run.client_hit_ratio is not None:
        run.hit_ratio, run.hit_source = run.client_hit_ratio, "client usage"
    if workers and all(w.source != "unavailable" for w in workers):
        run.prefill_by_worker = [w.prefill_tokens for w in workers]
        run.requests_by_worker = [w.counters.get("requests", 0.0) for w in workers]
        run.max_waiting_by_worker = [w.peaks.get("max_waiting", 0.0) for w in workers]
        mean = sum(run.prefill_by_worker) / len(run.prefill_by_worker)
        run.prefill_max_over_mean = max(run.prefill_by_worker) / mean if mean > 0 else None
        check_served(run, sum(run.requests_by_worker))
    return run


MIN_SEEN_SHARE = 0.9
"""Share of the client's completed requests the layout's workers must have counted; below it the
run measured some other server (a free port taken by another process between our check and its
bind, on a shared machine) and is marked failed."""


def check_served(run: RunResult, worker_requests: float | None) -> None:
    """Mark `run` failed when its workers counted fewer than `MIN_SEEN_SHARE` of the requests the
    client completed (`worker_requests` None: not known, nothing checked)."""
    if worker_requests is None or run.status != "ok" or run.ok == 0:
        return
    if worker_requests < MIN_SEEN_SHARE * run.ok:
        run.status = (f"failed: the workers counted {worker_requests:.0f} of {run.ok} completed requests "
                      "(another server answered?)")


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


TABLE_HEADER = ("| run | load | policy | hit ratio | p50 TTFT (s) | p99 TTFT (s) | p50 TPOT (ms) | p99 TPOT (ms) "
                "| max/mean prefill | req/s | errors | ok/sent | p99 send lag (s) |\n"
                "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def _label(name: str, kind: str) -> str:
    return name if kind == "gateway" else f"{name} ({kind})"


def table_row(run: RunResult, position: int) -> str:
    """One row of the per-run table; skipped or failed runs show their status instead of figures."""
    head = f"| {position} | {run.level} | {_label(run.name, run.kind)} |"
    if run.status != "ok" and run.sent == 0:
        return f"{head} {run.status} | | | | | | | | | |"
    hit = _fmt(run.hit_ratio, ".3f") + ("" if run.hit_source in ("sim/stats", "n/a") else "*")
    return (f"{head} {hit} | {_fmt(run.ttft_p50_s, '.3f')} | {_fmt(run.ttft_p99_s, '.3f')} | "
            f"{_fmt(_ms(run.tpot_p50_s), '.1f')} | {_fmt(_ms(run.tpot_p99_s), '.1f')} | "
            f"{_fmt(run.prefill_max_over_mean, '.2f')} | {_fmt(run.req_per_s, '.1f')} | {run.errors} | "
            f"{run.ok}/{run.sent} | {_fmt(run.send_lag_p99_s, '.2f')} |")


SUMMARY_HEADER = ("| load | policy | hit ratio | p50 TTFT (s) | p99 TTFT (s) | p99 TPOT (ms) | max/mean prefill "
                  "| req/s | errors | p99 send lag (s) | runs ok |\n"
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def _ms_spread(value: Spread | None) -> Spread | None:
    if value is None:
        return None
    return Spread(value.median * 1e3, value.low * 1e3, value.high * 1e3, value.n, tuple(v * 1e3 for v in value.values))


def summary_row(cell: Aggregate) -> str:
    """One row of the main table: median (min-max) of each figure over the cell's ok runs."""
    head = f"| {cell.level} | {_label(cell.name, cell.kind)} |"
    if cell.ok_runs == 0:
        status = cell.statuses[0] if cell.statuses else "no run"
        return f"{head} {status} | | | | | | | | {cell.ok_runs}/{cell.runs} |"
    f = cell.figures
    return (f"{head} {fmt_spread(f.get('hit_ratio'), '.3f')} | {fmt_spread(f.get('ttft_p50_s'), '.3f')} | "
            f"{fmt_spread(f.get('ttft_p99_s'), '.3f')} | {fmt_spread(_ms_spread(f.get('tpot_p99_s')), '.1f')} | "
            f"{fmt_spread(f.get('prefill_max_over_mean'), '.2f')} | "
            f"{fmt_spread(f.get('req_per_s'), '.1f')} | {fmt_spread(f.get('errors'), '.0f')} | "
            f"{fmt_spread(f.get('send_lag_p99_s'), '.1f')} | {cell.ok_runs}/{cell.runs} |")


def oracle_row(ref: OracleResult) -> str:
    """A main-table row for an offline reference (hit ratio and prefill spread only)."""
    return (f"| - | offline {ref.name} (LRU model, no server) | {ref.hit_ratio:.3f} | - | - | - | "
            f"{ref.prefill_max_over_mean:.2f} | - | - | - | - |")


def summary_table(runs: list[RunResult], references: list[OracleResult]) -> str:
    """The main table: one row per (load level, layout), then the offline references."""
    lines = [SUMMARY_HEADER, *(summary_row(cell) for cell in aggregate(runs)), *(oracle_row(r) for r in references)]
    return "\n".join(lines)


def markdown(runs: list[RunResult], references: list[OracleResult], meta: dict[str, Any]) -> str:
    """The whole report: settings, the main table, notes, every run, per-run details."""
    lines = [f"# Trace replay {meta['started']}", "", f"Command: `{meta['command']}`", ""]
    lines += [f"- {key}: {value}" for key, value in meta["settings"].items()]
    lines += ["", summary_table(runs, references)]
    lines += ["", "Cells: median over the repetitions (min-max). Hit ratio = cached / prompt tokens over all "
              "workers (`/sim/stats`; PD layouts: prefill workers only). TTFT and TPOT (first to last token / "
              "(tokens - 1)) at the client. max/mean prefill = busiest worker's uncached prompt "
              "tokens / mean. req/s = completed requests / (last finish - first send). Send lag = actual - scheduled "
              "send time: large when the client's concurrency cap was reached, and TTFT then misses that wait. Load "
              "= the workers' offered load with no cache hit / their capacity (`loadtest/capacity.py`), or the "
              "speed-up.", ""]
    for note in meta.get("notes", []):
        lines.append(f"- note: {note}")
    lines += ["", "All runs, in the order they ran (* = hit ratio from the client's usage fields; send lag = "
              "actual - scheduled send time, large when the client's concurrency cap was reached):", "",
              TABLE_HEADER]
    lines += [table_row(run, i + 1) for i, run in enumerate(runs)]
    lines.append("")
    for i, run in enumerate(runs):
        tag = f"run {i + 1} ({run.level}, {run.name}, repetition {run.repeat + 1})"
        if run.details:
            lines.append(f"- {tag}: {run.details}")
        if run.status != "ok" or run.error_kinds:
            lines.append(f"- {tag}: status {run.status}; errors {run.error_kinds or 'none'}; "
                         f"e.g. {run.error_samples}")
        if run.cpu_seconds or run.machine_busy is not None:
            busy = "n/a" if run.machine_busy is None else f"{run.machine_busy:.0%}"
            warn = " (CPU-saturated: figures are not reliable)" if (run.machine_busy or 0) > BUSY_WARNING else ""
            lines.append(f"- {tag}: CPU during the replay: machine {busy} busy{warn}; seconds by process "
                         f"{ {k: round(v, 1) for k, v in run.cpu_seconds.items()} }")
        if run.pd:
            lines.append(f"- {tag}: decode side {run.pd}")
        if run.prefill_by_worker:
            lines.append(f"- {tag}: prefill tokens by worker "
                         f"{[round(v) for v in run.prefill_by_worker]}, requests by worker "
                         f"{[round(v) for v in run.requests_by_worker]}, peak waiting "
                         f"{[round(v) for v in run.max_waiting_by_worker]}")
    return "\n".join(lines) + "\n"


def write_results(directory: Path, stamp: str, runs: list[RunResult], references: list[OracleResult],
                  meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write `replay-<stamp>.md` and `.json` into `directory`; returns both paths. Both carry the
    "Where the TTFT goes" section (`loadtest.ttft_split.split_section`; JSON `ttft_split`)."""
    directory.mkdir(parents=True, exist_ok=True)
    md_path = directory / f"replay-{stamp}.md"
    json_path = directory / f"replay-{stamp}.json"
    split_md, split_json = split_section(runs)
    md_path.write_text(markdown(runs, references, meta) + "\n" + split_md + "\n", encoding="utf-8")
    payload = {**meta, "summary": [cell.to_json() for cell in aggregate(runs)], "runs": [r.to_json() for r in runs],
               "references": [asdict(r) for r in references], "ttft_split": split_json}
    json_path.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    return md_path, json_path
