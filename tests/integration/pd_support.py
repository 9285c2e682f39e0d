"""Helpers of the gateway's prefill/decode (PD) tests: PD sim groups and the PD pool config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openai import OpenAI

from tests.support import RunningSim

StartSim = Callable[..., RunningSim]
ENGINE = {"sglang": "sglang", "vllm-nixl": "vllm", "vllm-mooncake": "vllm"}
# Health probes of tests whose prefill worker is black-holed mid-request: frequent, so its wedge is
# found ~1 s later. The timeout only bounds that failure; one much shorter (0.2 s) also failed the
# probes of *healthy* sims whenever the CPU was busy (the suite on more xdist workers than cores),
# marking them unhealthy before the fault and failing the test.
WEDGE_PROBES = {"interval": 0.1, "timeout": 1.0}


@dataclass
class PdGroup:
    """A PD pool's sims: `prefill` and `decode` workers speaking `mode`."""

    mode: str
    prefill: list[RunningSim]
    decode: list[RunningSim]

    def pool(self, name: str = "pd", max_context_tokens: int = 131072, **extra: Any) -> dict[str, Any]:
        """The gateway pool config of this group (bootstrap ports: the sims answer bootstrap calls on
        their HTTP port)."""
        prefill: list[dict[str, Any]] = []
        for sim in self.prefill:
            entry: dict[str, Any] = {"url": sim.url}
            if self.mode != "vllm-nixl":
                entry["bootstrap_port"] = int(sim.url.rsplit(":", 1)[1])
            prefill.append(entry)
        pd = {"mode": self.mode, "prefill": prefill, "decode": [s.url for s in self.decode],
              **extra.pop("disaggregation", {})}
        return {"name": name, "engine": ENGINE[self.mode], "max_context_tokens": max_context_tokens,
                "disaggregation": pd, **extra}

    def all(self) -> list[RunningSim]:
        return [*self.prefill, *self.decode]


def pd_group(start_sim: StartSim, mode: str, prefill: int = 1, decode: int = 1, **fields: Any) -> PdGroup:
    """Start `prefill` prefill and `decode` decode sims of `mode` (extra SimConfig `fields` for all)."""
    engine = ENGINE[mode]

    def start(role: str) -> RunningSim:
        return start_sim(engine, pd_role=role, pd_protocol=mode, **fields)

    return PdGroup(mode, [start("prefill") for _ in range(prefill)], [start("decode") for _ in range(decode)])


PROMPT = "Tell me about prefill and decode disaggregation, " * 8  # > 16 tokens: NIXL has blocks to pull


def send(base_url: str, kind: str, stream: bool) -> str:
    """One request with the OpenAI SDK (the peer and gateway wire tests send the same); returns the generated text."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=20)
    if kind == "chat":
        if stream:
            chunks = client.chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=4, stream=True, stream_options={"include_usage": True})
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reply = client.chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=4)
        return reply.choices[0].message.content or ""
    if stream:
        parts = client.completions.create(model="kimi-k3", prompt=PROMPT, max_tokens=4, stream=True,
                                          stream_options={"include_usage": True})
        return "".join(c.choices[0].text for c in parts if c.choices)
    return client.completions.create(model="kimi-k3", prompt=PROMPT, max_tokens=4).choices[0].text
