"""`python -m loadtest.replay --layouts pd,sglang-pd` end to end on a few requests of the Mooncake trace.

Real processes: two worker hosts (2 simulated SGLang prefill workers, 3 decode workers), the
gateway with a PD pool, and sglang-router's PD mode over fresh workers; the figures come from the
result JSON the replay writes. The sglang-router row is only checked when `sglang_router` (the
`bench` extra) is installed; without it the row must say it was skipped.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT, SHARED_DATA

TRACE = SHARED_DATA / "traces" / "mooncake" / "conversation_trace.jsonl"
REQUESTS = 12
DECODE = 3


def _replay(results: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "loadtest.replay", "--trace", str(TRACE), "--limit", str(REQUESTS),
            "--speedup", "50", "--max-seconds", "20", "--drain-seconds", "20", "--layouts", "pd,sglang-pd",
            "--pd-prefill", "2", "--pd-decode", str(DECODE), "--results-dir", str(results)]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = results.glob("replay-*.json")
    return dict(json.loads(path.read_text()))


def _check_pd_run(run: dict[str, Any]) -> None:
    assert run["status"] == "ok", run
    assert (run["sent"], run["ok"], run["errors"]) == (REQUESTS, REQUESTS, 0), run["error_samples"]
    # Every request's prefill leg ran on one of the 2 prefill workers, its decode leg on a decode
    # worker that received the KV from it.
    assert len(run["prefill_by_worker"]) == 2
    assert sum(run["requests_by_worker"]) == REQUESTS
    assert run["hit_source"] == "sim/stats" and 0.0 <= run["hit_ratio"] < 1.0
    assert sum(run["prefill_by_worker"]) > 0
    assert sum(run["pd"]["requests by decode worker"]) == REQUESTS
    assert len(run["pd"]["requests by decode worker"]) == DECODE
    assert run["pd"]["KV transfers"] == REQUESTS and run["pd"]["mean KV transfer (s)"] > 0
    assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
    assert 0 < run["tpot_p50_s"] <= run["tpot_p99_s"]
    assert run["req_per_s"] > 0


@pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} missing (KIMI_SHARED_DATA)")
def test_pd_layouts_replay_end_to_end(tmp_path: Path) -> None:
    result = _replay(tmp_path)
    runs = {run["kind"]: run for run in result["runs"]}
    assert set(runs) == {"gateway-pd", "peer-pd"}
    assert result["settings"]["layouts"] == "pd,sglang-pd"
    _check_pd_run(runs["gateway-pd"])
    if importlib.util.find_spec("sglang_router") is None:
        assert runs["peer-pd"]["status"].startswith("skipped: sglang-router is not installed")
    else:
        _check_pd_run(runs["peer-pd"])
