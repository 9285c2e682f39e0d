"""The PD leg builders (`gateway/dispatch/pd/requests.py`): the parsed engine body and the
workers' facts -> each leg's exact request bytes, the body itself never changed."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.dispatch.pd.requests import (
    mooncake_requests,
    nixl_decode_request,
    nixl_handle,
    nixl_prefill_request,
    sglang_request,
)

BODY: dict[str, Any] = {"model": "kimi", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                        "stream_options": {"include_usage": True}, "max_completion_tokens": 64}


def test_sglang_one_request_for_both_legs_with_the_bootstrap_fields_last() -> None:
    before = orjson.dumps(BODY)
    out = sglang_request(BODY, "p0", 8998, [42])
    assert out == before[:-1] + b',"bootstrap_host":"p0","bootstrap_port":8998,"bootstrap_room":42}'
    assert orjson.dumps(BODY) == before
    batch = orjson.loads(sglang_request({"prompt": ["a", "b"]}, "p0", None, [1, 2]))
    assert batch == {"prompt": ["a", "b"], "bootstrap_host": ["p0", "p0"], "bootstrap_port": [None, None],
                     "bootstrap_room": [1, 2]}
    with pytest.raises(ValueError):
        sglang_request(BODY, "p0", 1, [1, 2])


def test_nixl_prefill_then_decode_with_the_prefill_answers_handle() -> None:
    assert nixl_prefill_request(BODY) == orjson.dumps(
        {"model": "kimi", "messages": BODY["messages"], "stream": False, "max_completion_tokens": 1, "max_tokens": 1,
         "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                "remote_block_ids": None, "remote_host": None, "remote_port": None}})
    handle = {"do_remote_prefill": True, "remote_host": "p0", "remote_port": 5600, "remote_block_ids": [1]}
    assert nixl_decode_request(BODY, handle) == orjson.dumps({**BODY, "kv_transfer_params": handle})
    assert orjson.loads(nixl_decode_request(BODY, None))["kv_transfer_params"] is None  # sent as null
    assert "kv_transfer_params" not in BODY


@pytest.mark.parametrize(("answer", "handle"), [
    (b'{"id": "x", "kv_transfer_params": {"remote_port": 1}}', {"remote_port": 1}),
    (b'{"id": "x"}', None), (b'{"kv_transfer_params": null}', None),
])
def test_the_handle_of_a_nixl_prefill_answer(answer: bytes, handle: dict[str, Any] | None) -> None:
    assert nixl_handle(answer) == handle


@pytest.mark.parametrize(("answer", "words"), [
    (b"not json", "not a JSON object"), (b"[1]", "not a JSON object"), (b"null", "not a JSON object"),
    (b'{"kv_transfer_params": [1]}', "kv_transfer_params is not an object"),
])
def test_a_nixl_prefill_answer_without_a_usable_handle_is_refused(answer: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        nixl_handle(answer)


def test_mooncake_both_legs_tied_by_one_transfer_id() -> None:
    prefill, decode = mooncake_requests(BODY, "xfer-1", "http://p0:8998", "engine-0")
    assert orjson.loads(prefill)["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                           "transfer_id": "xfer-1"}
    assert orjson.loads(prefill)["max_tokens"] == 1 and orjson.loads(prefill)["stream"] is False
    assert decode == orjson.dumps({**BODY, "kv_transfer_params": {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "xfer-1",
        "remote_bootstrap_addr": "http://p0:8998", "remote_engine_id": "engine-0"}})
    assert "kv_transfer_params" not in BODY
