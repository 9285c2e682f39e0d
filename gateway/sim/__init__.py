"""Engine simulator: speaks the vLLM / SGLang / vllm-ascend OpenAI-compatible HTTP APIs.

Used by integration tests (real HTTP on loopback) and by the demo. Quick use::

    from gateway.sim import SimConfig, sim_server

    with sim_server(SimConfig(engine="vllm", max_context_tokens=8192, ttft_s=0.05)) as srv:
        ...  # POST f"{srv.url}/v1/chat/completions"; srv.app.engine.records

Opt-in engine model for benchmarks (`SimConfig.kv_capacity_tokens`, `prefill_tokens_per_s`,
`decode_batch_slowdown`, `keep_records`): a per-worker prefix cache with LRU eviction
(`gateway.sim.kvcache`), prefill time that grows with the uncached tokens, a FIFO admission queue,
`usage.prompt_tokens_details.cached_tokens`, the engines' prefix-cache metrics, and running totals
on `GET /sim/stats`. `SimConfig.scheduler="stepped"` swaps the per-request timing for one step
scheduler per worker (`gateway.sim.stepper`): a prefill budget shared by concurrent prefills in
chunks, decode steps that slow with the batch, and preemption when the KV cache is full.
"""

from gateway.sim.app import SimApp, create_sim_app
from gateway.sim.config import ApiVersion, SimConfig, SimEngineKind, SimFaults
from gateway.sim.dialects import EngineDialect, dialect_for
from gateway.sim.server import run_sim, sim_server, sim_uvicorn_server
from gateway.sim.worker_state import SimRequestRecord, SimWorkerState

__all__ = [
    "ApiVersion",
    "EngineDialect",
    "SimApp",
    "SimConfig",
    "SimEngineKind",
    "SimFaults",
    "SimRequestRecord",
    "SimWorkerState",
    "create_sim_app",
    "dialect_for",
    "run_sim",
    "sim_server",
    "sim_uvicorn_server",
]
