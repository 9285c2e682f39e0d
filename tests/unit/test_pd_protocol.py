"""The PD wire protocol's pure functions (`gateway/protocol/pd.py`): bootstrap rooms and fields,
the vLLM prefill leg's body, the Mooncake kv_transfer_params and bootstrap address, the engine id
of a `GET /query` table, and the check of a NIXL prefill's KV handle."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.protocol.pd import (
    MAX_ROOM,
    NIXL_PREFILL_PARAMS,
    batch_size,
    bootstrap_addr,
    bootstrap_fields,
    foreign_kv_handle,
    fresh_rooms,
    host_of,
    mooncake_decode_params,
    mooncake_prefill_params,
    new_transfer_id,
    rank0_engine_id,
    vllm_prefill_body,
)


@pytest.mark.parametrize(("body", "n"), [
    ({"messages": []}, None), ({"prompt": "a"}, None), ({"prompt": [1, 2, 3]}, None), ({"prompt": []}, None),
    ({"prompt": ["a", "b"]}, 2), ({"prompt": [[1], [2], [3]]}, 3),
])
def test_a_batch_is_a_list_of_prompts(body: dict[str, Any], n: int | None) -> None:
    assert batch_size(body) == n
    rooms = fresh_rooms(body)
    assert len(rooms) == (n or 1) and all(0 <= room <= MAX_ROOM for room in rooms)


def test_bootstrap_fields_are_scalars_for_one_prompt_and_lists_for_a_batch() -> None:
    assert bootstrap_fields({"messages": []}, "p0", 8998, [7]) == \
        {"bootstrap_host": "p0", "bootstrap_port": 8998, "bootstrap_room": 7}
    assert bootstrap_fields({"prompt": ["a", "b"]}, "p0", None, [1, 2]) == \
        {"bootstrap_host": ["p0", "p0"], "bootstrap_port": [None, None], "bootstrap_room": [1, 2]}
    with pytest.raises(ValueError, match="2 bootstrap rooms for 1 prompts"):
        bootstrap_fields({"messages": []}, "p0", 1, [1, 2])


def test_the_vllm_prefill_body_generates_one_token_unstreamed_and_leaves_the_body_alone() -> None:
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 5,
            "max_completion_tokens": 50, "messages": []}
    before = dict(body)
    out = vllm_prefill_body(body, {"x": 1})
    assert out == {"model": "m", "stream": False, "max_completion_tokens": 1, "messages": [], "max_tokens": 1,
                   "kv_transfer_params": {"x": 1}}
    assert body == before
    assert "max_completion_tokens" not in vllm_prefill_body({"max_tokens": 9}, {})
    assert NIXL_PREFILL_PARAMS["do_remote_decode"] is True and NIXL_PREFILL_PARAMS["do_remote_prefill"] is False


def test_mooncake_fields_and_the_bootstrap_address() -> None:
    transfer = new_transfer_id()
    assert transfer.startswith("xfer-") and transfer != new_transfer_id()
    assert mooncake_prefill_params("t") == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "t"}
    assert mooncake_decode_params("t", "http://p:8998", "e") == {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "t",
        "remote_bootstrap_addr": "http://p:8998", "remote_engine_id": "e"}
    assert bootstrap_addr(host_of("http://p0:8000"), 8998) == "http://p0:8998"
    assert bootstrap_addr(host_of("http://[fd00::1]:8000"), 8998) == "http://[fd00::1]:8998"


def test_the_engine_id_is_the_lowest_numbered_ranks() -> None:
    assert rank0_engine_id({"1": {"engine_id": "b"}, "0": {"engine_id": "a"}}) == "a"
    assert rank0_engine_id({"x": {"engine_id": "x"}, "10": {"engine_id": "ten"}, "2": {"engine_id": "two"}}) == "two"
    for broken, error in (({}, IndexError), ({"0": {}}, KeyError), ([], IndexError), ({"0": "s"}, TypeError)):
        with pytest.raises(error):
            rank0_engine_id(broken)


def test_a_kv_handle_must_name_the_prefill_workers_side_channel() -> None:
    handle = {"do_remote_prefill": True, "remote_host": "P0", "remote_port": 5600}
    assert foreign_kv_handle(handle, "p0", None) is None  # the host case-insensitively, any port
    assert foreign_kv_handle(handle, "p0", 5600) is None
    assert "remote_port '5600', not the prefill worker's 5601" in (foreign_kv_handle(handle, "p0", 5601) or "")
    assert "names remote_host 'P0', not the prefill worker's 'p1'" in (foreign_kv_handle(handle, "p1", None) or "")
    assert foreign_kv_handle({**handle, "remote_port": 70000}, "p0", None) is not None
    assert foreign_kv_handle({**handle, "remote_port": True}, "p0", None) is not None  # a bool is no port
    assert foreign_kv_handle({"do_remote_prefill": True, "remote_host": "[fd00::1]", "remote_port": 1},
                             "fd00::1", None) is None
    assert foreign_kv_handle({"do_remote_prefill": False}, "p0", None) is None  # no remote prefill: passes
    assert foreign_kv_handle({"do_remote_prefill": True}, "p0", None) is not None
