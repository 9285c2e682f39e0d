"""The simulator's continuation of its own answer (gateway/sim/tokens.py): token i of an answer is
a function of i, counted from the start of the assistant turn, prefilled text included."""

from __future__ import annotations

import pytest

from gateway.sim.tokens import (
    FieldValidationError,
    PromptError,
    completion_continued_tokens,
    continued_tokens,
    output_text,
    output_token_count,
)


def test_a_continuation_from_k_tokens_goes_on_with_token_k() -> None:
    for k in (0, 1, 7, 16, 33):
        assert output_token_count(output_text(k)) == k
        assert output_text(k) + output_text(40 - k, start=k) == output_text(40)


def test_a_completion_prompt_ending_in_the_model_s_own_text() -> None:
    assert completion_continued_tokens("Once upon a time" + output_text(9)) == 9
    assert completion_continued_tokens("Once upon a time") == 0
    assert completion_continued_tokens("Ask Kimi something") == 0  # the model's word, not its answer's tail
    assert completion_continued_tokens(["Kimi"]) == 0  # a batch is not continued


def test_the_flags_as_vllm_and_sglang_read_them() -> None:
    turn = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": output_text(5)}]}
    assert continued_tokens({**turn, "continue_final_message": True, "add_generation_prompt": False}, "vllm") == 5
    assert continued_tokens(turn, "vllm") is None  # a new turn after the assistant's
    with pytest.raises(FieldValidationError, match="Cannot set both"):
        continued_tokens({**turn, "continue_final_message": True, "add_generation_prompt": True}, "vllm")
    with pytest.raises(PromptError, match="not compatible"):  # vLLM's default add_generation_prompt is true
        continued_tokens({**turn, "continue_final_message": True}, "vllm")
    assert continued_tokens({**turn, "continue_final_message": True}, "sglang") == 5  # no such field there
    user_last = {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
                 "add_generation_prompt": False}
    assert continued_tokens(user_last, "vllm") is None  # the user's message goes on: no answer started
