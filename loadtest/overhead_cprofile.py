"""Where a gateway variant's CPU goes per request: cProfile (CPU-time clock) of `kimi-gateway serve`
under streamed 16 KiB requests at c=64, two runs per variant (a few and many requests, so start-up
cancels), then the per-request difference of each function between two variants.

    python -m loadtest.overhead_cprofile bare prod            # the production path's extra CPU
    python -m loadtest.overhead_cprofile bare bare-fresh      # a new connection per request
    python -m loadtest.overhead_cprofile bare prod --sort self --top 40

Variants: `bare` (`overhead_targets.gateway_config` defaults), `redis` (affinity in Redis), `prod`
(the `gateway+prod` target's config: auth, limits and affinity in Redis); `-fresh` after any of
them: each request on a new connection. The gateway runs on core 0 (`taskset`), this process and
the fake engine (two processes) on core 1, as in `loadtest.overhead`. cProfile's own cost per
Python call (~1 µs) inflates the figures about threefold: compare shares and differences, not µs
with `loadtest.overhead`'s CPU per request. Profiles and logs go to `--out` (a temporary directory
by default), Redis keys are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import pstats
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from loadtest import overhead_targets as tg
from loadtest.overhead_load import RequestMaker
from loadtest.procs import ProcessGroup, free_port
from loadtest.rawhttp import Connection

PROFILED = ("import cProfile, os, runpy, sys, time, atexit; sys.path.insert(0, os.getcwd()); "
            "out = sys.argv[1]; sys.argv = ['gateway.cli'] + sys.argv[2:]; "
            "prof = cProfile.Profile(time.process_time); "
            "atexit.register(lambda: (prof.disable(), prof.dump_stats(out))); prof.enable(); "
            "runpy.run_module('gateway.cli', run_name='__main__')")
"""`python -c` code: the gateway's CLI under cProfile with a CPU-time clock, its stats written at exit."""

Stats = dict[tuple[str, int, str], tuple[float, float, float]]
"""Per function (file, line, name): calls, self µs and inclusive µs, per request."""


async def drive(port: int, requests: int, concurrency: int, fresh: bool) -> int:
    """`requests` streamed 16 KiB chat requests from `concurrency` clients; returns the failures."""
    maker = RequestMaker(port, 16 * 1024, True, 32, tg.MASTER_KEY, itertools.count(time.time_ns() // 1000))
    left, failures = [requests], [0]

    async def client() -> None:
        conn = Connection(tg.HOST, port)
        while left[0] > 0:
            left[0] -= 1
            reply = await conn.request(maker.parts(), True, 30.0)
            failures[0] += reply.error is not None
            if fresh:
                conn.close()
        conn.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return failures[0]


def profile(variant: str, requests: int, out: Path) -> Path:
    """One profiled gateway of `variant` under `requests` requests; the stats file."""
    kind, fresh = variant.removesuffix("-fresh"), variant.endswith("-fresh")
    pin = tg.plan_pinning(True)
    if pin.engine:
        os.sched_setaffinity(0, {int(pin.engine)})
    stats = out / f"{variant}-{requests}.prof"
    with ProcessGroup(out / f"logs-{variant}-{requests}") as group:
        engine = tg.start_stub(group, "engine", pin, 32, procs=2)
        port = free_port()
        prefix = f"kgw:ovh:{uuid.uuid4().hex[:12]}" if kind != "bare" else None
        auth = f"kgw:ovhrl:{uuid.uuid4().hex[:12]}" if kind == "prod" else None
        config = group.log_dir / "gateway.yaml"
        config.write_text(yaml.safe_dump(tg.gateway_config(port, engine.url, "info", prefix, auth)), encoding="utf-8")
        argv = [sys.executable, "-c", PROFILED, str(stats), "serve", "-c", str(config)]
        proc = group.spawn("gateway", pin.argv(pin.router, argv), env=tg.gateway_env(), stop_timeout=30)
        try:
            proc.wait_http(f"http://{tg.HOST}:{port}/ready", tg.STARTUP_TIMEOUT_S)
            started = time.monotonic()
            failed = asyncio.run(drive(port, requests, 64, fresh))
            print(f"  {variant}: {requests} requests in {time.monotonic() - started:.1f} s, {failed} failed",
                  flush=True)
            proc.stop()
        finally:
            for key_prefix in (prefix, auth):
                if key_prefix is not None:
                    tg.delete_redis_prefix(key_prefix)
    return stats


def per_request(few: Path, many: Path, requests: int) -> Stats:
    """(many - few) / requests for every function of the two stats files."""
    a, b = pstats.Stats(str(few)).stats, pstats.Stats(str(many)).stats  # type: ignore[attr-defined]
    zero = (0, 0, 0.0, 0.0, {})
    return {k: ((b.get(k, zero)[1] - a.get(k, zero)[1]) / requests,
                (b.get(k, zero)[2] - a.get(k, zero)[2]) / requests * 1e6,
                (b.get(k, zero)[3] - a.get(k, zero)[3]) / requests * 1e6) for k in set(a) | set(b)}


def _name(key: tuple[str, int, str]) -> str:
    path = key[0].split("site-packages/")[-1]
    for marker in ("/gateway/", "/loadtest/"):
        if marker in path:
            path = marker.strip("/") + "/" + path.split(marker, 1)[1]
    return f"{key[2]} ({path}:{key[1]})"


def table(base: str, other: str, a: Stats, b: Stats, sort: str, top: int) -> str:
    """The functions whose per-request µs (`sort`: inclusive or self) grew most from `a` to `b`."""
    col = 2 if sort == "inclusive" else 1
    lines = [f"per request: {base} {sum(v[1] for v in a.values()):,.0f} µs, {other} "
             f"{sum(v[1] for v in b.values()):,.0f} µs (self time, all functions)",
             f"| {sort} µs: {other} minus {base} | {other} | {base} | function |", "| ---: | ---: | ---: | --- |"]
    zero = (0.0, 0.0, 0.0)
    for key in sorted(set(a) | set(b), key=lambda k: -(b.get(k, zero)[col] - a.get(k, zero)[col]))[:top]:
        lines.append(f"| {b.get(key, zero)[col] - a.get(key, zero)[col]:,.1f} | {b.get(key, zero)[col]:,.1f} | "
                     f"{a.get(key, zero)[col]:,.1f} | `{_name(key)}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.overhead_cprofile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    variants = [f"{v}{s}" for v in ("bare", "redis", "prod") for s in ("", "-fresh")]
    parser.add_argument("base", choices=variants)
    parser.add_argument("other", choices=variants)
    parser.add_argument("--few", type=int, default=500, help="requests of the run whose profile is subtracted")
    parser.add_argument("--many", type=int, default=4500)
    parser.add_argument("--sort", choices=["inclusive", "self"], default="inclusive")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, help="where profiles and logs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    if not 0 < args.few < args.many:
        raise SystemExit("--few and --many: 0 < few < many")
    if any(v.split("-")[0] != "bare" for v in (args.base, args.other)) and not tg.redis_available():
        raise SystemExit(f"no Redis at {tg.REDIS_URL}")
    out = args.out or Path(tempfile.mkdtemp(prefix="overhead-cprofile-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"profiles in {out}", flush=True)
    figures = {v: per_request(profile(v, args.few, out), profile(v, args.many, out), args.many - args.few)
               for v in dict.fromkeys((args.base, args.other))}
    print(table(args.base, args.other, figures[args.base], figures[args.other], args.sort, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
