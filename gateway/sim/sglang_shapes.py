"""SGLang's answer shapes where they differ from vLLM's (the simulator's payloads are vLLM's:
`gateway.sim.responses`).

- Usage of chat and text completions, streamed or not (python/sglang/srt/entrypoints/openai/protocol.py
  `UsageInfo`, filled by `usage_processor.py` `UsageProcessor`): `prompt_tokens`, `total_tokens`,
  `completion_tokens`, `prompt_tokens_details` and `reasoning_tokens` (0 without a reasoning parser),
  every field serialised. `prompt_tokens_details` is `{"cached_tokens": N}` only with
  `--enable-cache-report` (`SimConfig.enable_cache_report`) and N > 0 (`_details_if_cached`), else null.
"""

from __future__ import annotations

from typing import Any


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, cache_report: bool) -> dict[str, Any]:
    """SGLang's `UsageInfo` as it serialises it (module docstring)."""
    details = {"cached_tokens": cached_tokens} if cache_report and cached_tokens > 0 else None
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": details, "reasoning_tokens": 0}
