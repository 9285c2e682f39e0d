"""`loadtest.engine_hits` end to end on two real vLLM engines, tiny: four conversations of the Mooncake
trace, one at a time, through a gateway with the default policy and one with round robin.

One conversation at a time makes the comparison deterministic in kind: round robin alternates every
request between the two engines, so each turn finds at most the prompt of the turn before the last
in its engine's cache, while the default policy (`ttft_cost`) sends every later turn to the engine
holding its conversation's prompt (with no queue anywhere, that engine's predicted TTFT is the
shortest: fewer uncached tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import engine_hits
from tests.real_vllm.engine import VllmEngine, require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engines() -> Iterator[list[VllmEngine]]:
    require_vllm()
    started = engine_hits.start_engines()
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


def test_the_default_policy_gets_more_engine_cache_hits_than_round_robin(engines: list[VllmEngine],
                                                                         tmp_path: Path) -> None:
    opts = engine_hits.Options(conversations=4, concurrency=1, max_turns=4,
                               policies=(engine_hits.DEFAULT_POLICY, "round_robin"))
    runs = engine_hits.run_benchmark(opts, [e.url for e in engines], tmp_path)
    table = engine_hits.table(runs)
    assert [r.policy for r in runs] == [engine_hits.DEFAULT_POLICY, "round_robin"], table
    assert "| default (ttft_cost) |" in table and "| round_robin |" in table
    for run in runs:
        assert run.sent >= 12 and run.ok == run.sent, (table, run.errors)
        assert sum(run.per_engine) == run.ok, table
        assert run.usage_ratio is not None and run.engine_ratio is not None, table
        assert 0.0 <= run.usage_ratio <= 1.0 and 0.0 <= run.engine_ratio <= 1.0, table
        # The answers' cached_tokens and the engine's own counters tell the same story.
        assert run.engine_queries == pytest.approx(run.prompt_tokens, rel=0.05), table
        assert run.engine_hits == pytest.approx(run.cached_tokens, rel=0.05, abs=256), table
        # No policy beats one engine holding every conversation (its previous turn's whole blocks).
        assert run.reachable_ratio is not None and run.usage_ratio <= run.reachable_ratio + 1e-9, table
        assert run.max_prompt_tokens < engine_hits.CONTEXT - opts.max_output_tokens, table
    default, round_robin = runs
    assert default.prompt_tokens == round_robin.prompt_tokens, table  # the very same prompts
    assert min(round_robin.per_engine) >= round_robin.ok // 2, table
    assert default.engine_ratio is not None and round_robin.engine_ratio is not None
    assert default.engine_ratio > round_robin.engine_ratio + 0.1, table
