"""The simulator's chat prompts given as token ids (gateway/sim/tokens.py `pretokenized_chat_prompt`):
SGLang's `input_ids`, vLLM's `kv_transfer_params.prompt_token_ids`, each engine only its own."""

from __future__ import annotations

import pytest

from gateway.sim.tokens import PromptError, pretokenized_chat_prompt

HI = [{"role": "user", "content": "Hi"}]
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]


def test_sglang_prefills_input_ids_instead_of_the_messages() -> None:
    assert pretokenized_chat_prompt({"messages": HI, "input_ids": [5] * 300}, "sglang") == 300
    assert pretokenized_chat_prompt({"messages": HI}, "sglang") is None
    assert pretokenized_chat_prompt({"messages": HI, "kv_transfer_params": {"prompt_token_ids": [5]}},
                                    "sglang") is None
    with pytest.raises(PromptError):
        pretokenized_chat_prompt({"messages": HI, "input_ids": ["a"]}, "sglang")


def test_vllm_prefills_forwarded_prompt_token_ids_unless_it_must_render_the_messages() -> None:
    kv = {"kv_transfer_params": {"prompt_token_ids": [5] * 300}}
    assert pretokenized_chat_prompt({"messages": HI, **kv}, "vllm") == 300
    assert pretokenized_chat_prompt({"messages": HI, "input_ids": [5] * 300}, "vllm") is None
    assert pretokenized_chat_prompt({"messages": HI, "echo": True, **kv}, "vllm") is None
    assert pretokenized_chat_prompt({"messages": IMAGE, **kv}, "vllm") is None
    for bad in ([], [-1], [1.5], "12"):
        with pytest.raises(PromptError, match="non-empty list of non-negative integers"):
            pretokenized_chat_prompt({"messages": HI, "kv_transfer_params": {"prompt_token_ids": bad}}, "vllm")
