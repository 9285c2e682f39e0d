"""The pure parts of mid-stream migration (gateway/dispatch/migration.py): what the client got of a
stream, the body that continues it, and the safe-point rules."""

from __future__ import annotations

import orjson

from gateway.dispatch.migration import FOLD_BYTES, PARSED_EVENT_MAX, Progress, continuation_body, refusal


def _event(delta: dict[str, object] | None = None, text: str | None = None, finish: str | None = None,
           usage: dict[str, int] | None = None) -> bytes:
    choice: dict[str, object] = {"index": 0, "finish_reason": finish}
    if delta is not None:
        choice["delta"] = delta
    if text is not None:
        choice["text"] = text
    return b"data: " + orjson.dumps({"id": "c-1", "created": 7, "model": "m", "choices": [choice],
                                     "usage": usage}) + b"\n\n"


def test_progress_keeps_content_reasoning_and_the_first_ident() -> None:
    progress = Progress()
    progress.keep(_event({"role": "assistant", "content": ""}) + _event({"reasoning_content": "think"}))
    progress.keep(_event({"content": "Hel"}) + b": keep-alive\n\n" + _event({"content": "lo"}))
    progress.keep(_event({"content": ' "\\ \u00e9\n'}))
    progress.fold()
    assert progress.text == 'Hello "\\ \u00e9\n' and progress.reasoning == "think"
    assert progress.generated == 4 and progress.ident == {"id": "c-1", "created": 7, "model": "m"}
    assert not progress.tool_call and not progress.finished


def test_progress_prefers_the_engine_s_count_and_folds_in_batches() -> None:
    progress = Progress()
    progress.keep(_event(text="a", usage={"prompt_tokens": 5, "completion_tokens": 2}))
    progress.fold()
    assert progress.generated == 2 and progress.prompt_tokens == 5
    big = _event(text="x" * 1000)
    for _ in range(FOLD_BYTES // len(big) + 2):
        progress.keep(big)
    assert progress._size < FOLD_BYTES  # folded on the way, not held whole


def test_progress_keeps_a_folds_pieces_as_one_and_parses_no_large_event() -> None:
    """A fold's text pieces are kept as one (its bytes, not an object per token); in a fold with a
    piece that does not decode, each is kept apart and that one dropped. An event over
    PARSED_EVENT_MAX (a role chunk holding a prompt's token ids) is never parsed: the stream's identity
    and usage come from the events around it."""
    progress = Progress()
    ids = b",".join(b"%d" % (100_000 + i) for i in range(PARSED_EVENT_MAX // 6))
    progress.keep(b'data: {"id":"big","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],'
                  b'"usage":{"prompt_tokens":1,"completion_tokens":0},"prompt_token_ids":[' + ids + b"]}\n\n")
    progress.keep(b"".join(_event({"content": "ab"}) for _ in range(1000)))
    progress.fold()
    assert progress.text == "ab" * 1000 and len(progress._text) == 1
    progress.keep(b'data: {"choices":[{"delta":{"content":"bad\\u12"}}]}\n\n'
                  + _event({"content": "!"}, usage={"prompt_tokens": 9, "completion_tokens": 1001}))
    progress.fold()
    assert progress.text == "ab" * 1000 + "!" and progress.tokens == 1002
    assert progress.ident == {"id": "c-1", "created": 7, "model": "m"} and progress.prompt_tokens == 9


def test_a_chat_continuation_adds_the_partial_turn_and_shrinks_the_limits() -> None:
    progress = Progress()
    progress.keep(_event({"content": "Once"}) + _event({"content": " upon"}))
    progress.fold()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "min_tokens": 3,
            "temperature": 0, "seed": 1, "stop": ["x"]}
    out = continuation_body("chat", body, progress, "m")
    assert out is not None
    assert out["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    assert (out["continue_final_message"], out["add_generation_prompt"]) == (True, False)
    assert (out["max_tokens"], out["min_tokens"], out["seed"], out["stop"]) == (8, 1, 1, ["x"])
    assert body["messages"] == [{"role": "user", "content": "hi"}]  # the original is left alone


def test_a_client_s_own_prefill_grows_rather_than_doubling_the_turn() -> None:
    progress = Progress()
    progress.keep(_event({"content": " more"}))
    progress.fold()
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Start"}],
            "continue_final_message": True, "add_generation_prompt": False}
    out = continuation_body("chat", body, progress, "m")
    assert out is not None and out["messages"][-1] == {"role": "assistant", "content": "Start more"}
    assert len(out["messages"]) == 2


def test_a_completion_continuation_appends_to_the_prompt_and_nothing_left_means_none() -> None:
    progress = Progress()
    progress.keep(_event(text=" there") + _event(text=" was"))
    progress.fold()
    out = continuation_body("completions", {"prompt": ["Once"], "max_tokens": 5}, progress, "m")
    assert out is not None and (out["prompt"], out["max_tokens"]) == ("Once there was", 3)
    assert continuation_body("completions", {"prompt": "Once", "max_tokens": 2}, progress, "m") is None


def test_the_safe_point_rules() -> None:
    progress = Progress()
    progress.keep(_event({"content": "Kimi tok"}))
    progress.fold()
    chat = {"messages": []}
    assert refusal("chat", chat, progress) is None
    assert refusal("chat", {**chat, "n": 2}, progress) == "n > 1"
    assert refusal("chat", {**chat, "top_logprobs": 2}, progress) == "logprobs were asked for"
    assert refusal("completions", {"prompt": [1, 2]}, progress) == "the prompt is not one string"
    assert refusal("completions", {"prompt": "a", "echo": True}, progress) == "echo was asked for"
    straddle = {**chat, "stop": "tokens", "include_stop_str_in_output": True}
    assert refusal("chat", straddle, progress) == "a stop sequence may straddle the seam"
    assert refusal("chat", {**straddle, "include_stop_str_in_output": False}, progress) is None
    tool = Progress()
    tool.keep(_event({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}))
    tool.fold()
    assert refusal("chat", chat, tool) == "a tool call was under way"
    done = Progress()
    done.keep(_event({"content": "x"}, finish="stop"))
    done.fold()
    assert refusal("chat", chat, done) == "the answer had finished"


def test_sglang_s_rules_reasoning_and_its_stop_strings() -> None:
    # SGLang renders a continued assistant message's content alone (serving_chat.py
    # `_handle_last_assistant_message`), and no hold-back of a partial stop match is relied on.
    thinking = Progress()
    thinking.keep(_event({"reasoning_content": "hmm"}) + _event({"content": "Kimi"}))
    thinking.fold()
    assert refusal("chat", {"messages": []}, thinking, "sglang") == "SGLang does not continue reasoning"
    assert refusal("chat", {"messages": []}, thinking, "vllm") is None
    plain = Progress()
    plain.keep(_event({"content": "Kimi tok"}))
    plain.fold()
    assert refusal("chat", {"messages": [], "stop": "tokens"}, plain, "sglang") == \
        "a stop sequence may straddle the seam"
    assert refusal("chat", {"messages": [], "stop": "tokens"}, plain, "vllm") is None
    assert refusal("chat", {"messages": [], "stop": "Zürich"}, plain, "sglang") is None
    assert refusal("completions", {"prompt": "a"}, plain, "sglang") is None


def _anthropic(kind: str, data: dict[str, object]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def test_progress_reads_a_messages_stream_and_its_safe_points() -> None:
    start = _anthropic("message_start", {"message": {"id": "msg_1", "content": [], "stop_reason": None,
                                                     "usage": {"input_tokens": 9, "output_tokens": 0}}})
    text = _anthropic("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    progress = Progress()
    progress.keep(start + text + _anthropic("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                                          "text": "Once"}}))
    progress.keep(_anthropic("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": " upon"}}))
    progress.fold()
    assert (progress.text, progress.generated, progress.prompt_tokens, progress.block) == ("Once upon", 2, 9,
                                                                                            (0, "text"))
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert refusal("messages", body, progress) is None
    assert refusal("messages", {**body, "messages": [*body["messages"], {"role": "assistant", "content": "x"}]},
                   progress) == "the request prefilled the answer"
    assert refusal("messages", {**body, "stop_sequences": ["upon a"]}, progress) is None  # vLLM holds it back
    assert refusal("messages", {**body, "stop_sequences": ["upon a"]}, progress, "sglang") == \
        "a stop sequence may straddle the seam"
    closed = Progress()
    closed.keep(start + text + _anthropic("content_block_stop", {"index": 0}))
    closed.fold()
    assert refusal("messages", body, closed) == "no text block was open"
    thinking = Progress()
    thinking.keep(start + _anthropic("content_block_start", {"index": 0, "content_block": {"type": "thinking"}})
                  + _anthropic("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta",
                                                                             "thinking": "hm"}}))
    thinking.fold()
    assert refusal("messages", body, thinking) == "a thinking block was relayed"
    tool = Progress()
    tool.keep(start + _anthropic("content_block_start", {"index": 0, "content_block": {"type": "tool_use"}}))
    tool.fold()
    assert refusal("messages", body, tool) == "a tool call was under way"
    done = Progress()
    done.keep(start + text + _anthropic("message_delta", {"delta": {"stop_reason": "end_turn"}}))
    done.fold()
    assert refusal("messages", body, done) == "the answer had finished"
