"""`gateway.sim.sampling`: vLLM's SamplingParams range checks (vllm/sampling_params.py `_verify_args`)."""

from __future__ import annotations

import orjson
import pytest

from gateway.sim.dialects import dialect_for
from gateway.sim.sampling import check_sampling


def _error(engine: str, body: dict[str, object], api_version: str = "current") -> dict[str, object] | None:
    reply = check_sampling(engine, dialect_for(engine, api_version), body)  # type: ignore[arg-type]
    if reply is None:
        return None
    assert reply.status == 400
    data = orjson.loads(reply.body)
    return data.get("error", data)  # type: ignore[no-any-return]


@pytest.mark.parametrize("body", [
    {}, {"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"top_k": -1}, {"top_k": 0}, {"min_p": 0},
    {"presence_penalty": -2, "frequency_penalty": 2}, {"repetition_penalty": 1.1}, {"temperature": None},
    {"temperature": "hot"}, {"temperature": True}])
def test_values_vllm_accepts(body: dict[str, object]) -> None:
    assert _error("vllm", body) is None


def test_first_refusal_in_vllms_order_with_param_and_suffix() -> None:
    error = _error("vllm", {"temperature": -1, "presence_penalty": 5})
    assert error == {"message": "presence_penalty must be in [-2, 2], got 5.0.", "type": "BadRequestError",
                     "param": None, "code": 400}  # checked before temperature, names no parameter
    error = _error("ascend", {"top_p": 1.5})
    assert error is not None and error["message"] == "top_p must be in (0, 1], got 1.5. (parameter=top_p, value=1.5)"
    assert error["param"] == "top_p"


def test_legacy_vllm_words_it_without_parameter_and_sglang_is_not_checked() -> None:
    error = _error("vllm", {"temperature": -0.5}, "legacy")
    assert error is not None and (error["message"], error["param"]) == ("temperature must be non-negative, got -0.5.",
                                                                       None)
    assert _error("sglang", {"temperature": -0.5}) is None
