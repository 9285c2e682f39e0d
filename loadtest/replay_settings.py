"""Settings of a trace replay (`python -m loadtest.replay`) and the simulated workers they describe."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.sim.config import SimConfig
from loadtest.peers import Peer

MODEL = "kimi-k3"
MAX_CONTEXT_TOKENS = 262_144
"""Context of the benchmark pool and its workers: above the trace's longest prompt (124,847
tokens) even after the gateway's deliberately high estimate (~0.26 tokens a byte of its English-like words)."""

SIM_MESSAGE_OVERHEAD_TOKENS: int = SimConfig.model_fields["message_overhead_tokens"].default
"""Tokens the simulator adds per chat message (the `SimConfig` default, 4)."""

TIMING_RECORDS = 20_000
"""Request timings each worker keeps (`SimConfig.timing_records`, `GET /sim/timings`; a few hundred
bytes each): more than a whole 40-minute window's 7,851 requests, so none is dropped even if one
worker got them all; the replay reads them after each run (`loadtest.ttft_split`)."""

SIM_BYTES_PER_TOKEN: float = SimConfig.model_fields["bytes_per_token"].default
"""Prompt bytes the simulator counts as one token (the `SimConfig` default, 4); the replay's
texts are ASCII, so this is also characters a token for the peers' text trees."""


@dataclass(frozen=True)
class Settings:
    """Everything a replay depends on (units in the names or the `--help` text).

    `speedup` is the reference speed-up: the one the runs use without `utilisations`, and the one
    at which `prefill_tps="auto"` makes the workers `target_util` busy. With `utilisations`, each
    level's speed-up is derived from the workers' capacity (`loadtest.capacity`).
    """

    trace: Path
    minutes: float
    from_minutes: float
    limit: int | None
    speedup: float
    output_scale: float
    workers: int
    policies: list[str]
    policy_params: dict[str, dict[str, Any]]
    gateway_extra: dict[str, Any]
    gateway_time_scale: bool
    peers: list[Peer]
    peer_scale: bool
    kv_capacity_tokens: int
    kv_block_tokens: int
    max_num_seqs: int
    scheduler: str
    chunk_tokens: int
    decode_s_per_seq: float
    ttft_s: float
    tpot_s: float
    decode_batch_slowdown: float
    prefill_tps: str
    target_util: float
    utilisations: list[float]
    repeats: int
    max_concurrency: int
    max_seconds: float
    drain_seconds: float
    text_cache_blocks: int
    seed: int
    results_dir: Path


def window(s: Settings) -> str:
    """The trace window in words: "first 40 min", "minutes 40-60"."""
    return f"minutes {s.from_minutes:g}-{s.minutes:g}" if s.from_minutes else f"first {s.minutes:g} min"


def sim_fields(s: Settings, prefill_tps: float | None) -> dict[str, Any]:
    """SimConfig fields of every worker (fields unknown to the SimConfig in use are dropped by the
    worker host, which reports them)."""
    fields: dict[str, Any] = {
        "engine": "sglang",
        "served_model_names": [MODEL],
        "max_context_tokens": MAX_CONTEXT_TOKENS,
        "ttft_s": s.ttft_s,
        "tpot_s": s.tpot_s,
        "max_num_seqs": s.max_num_seqs,
        "kv_capacity_tokens": s.kv_capacity_tokens,
        "kv_block_tokens": s.kv_block_tokens,
        "decode_batch_slowdown": s.decode_batch_slowdown,
        "keep_records": False,
        "timing_records": TIMING_RECORDS,
    }
    if prefill_tps is not None:
        fields["prefill_tokens_per_s"] = prefill_tps
    if s.scheduler == "stepped":
        fields.update(scheduler="stepped", chunk_tokens=s.chunk_tokens, decode_step_s=s.tpot_s,
                      decode_s_per_seq=s.decode_s_per_seq)
    return fields


def auto_or_positive(value: str) -> str:
    """argparse type: "auto" or a positive number (kept as text)."""
    try:
        if value != "auto" and float(value) <= 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError("want 'auto' or a positive number") from None
    return value
