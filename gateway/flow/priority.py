"""The engines' own `priority` field under the gateway's control.

vLLM and SGLang read a request body's `priority` (an integer) to order their waiting queue when
they run priority scheduling, and each tenant could otherwise jump every other tenant's queue by
sending one. So a client's `priority` (and SGLang's data-parallel rank fields: `SCHEDULING_FIELDS`,
gateway/protocol/body.py) reaches the engines only when its key may set it
(`auth.keys[].client_priority`, or with auth off: every client is trusted then, as before);
otherwise the gateway strips it. On a pool whose engines run priority scheduling
(`flow_control.engine_priority`) the gateway sets it from the request's band instead
(`engine_value`), on the APIs whose engine request has the field (`PRIORITY_APIS`: chat and text
completions, Responses; vLLM `vllm/entrypoints/openai/chat_completion/protocol.py`,
`completion/protocol.py`, `responses/protocol.py`; SGLang's OpenAI protocol likewise).

The engines order priorities oppositely:

- vLLM, `--scheduling-policy priority` (`vllm/config/scheduler.py` `SchedulerConfig.policy`: "lower
  value means earlier handling", ties by arrival; the waiting queue is a heap of (priority,
  arrival), `vllm/v1/core/sched/request_queue.py` `PriorityRequestQueue`, and a full batch preempts
  its largest (priority, arrival), `vllm/v1/core/sched/scheduler.py`): priority = -band.
- SGLang, `--enable-priority-scheduling` (`python/sglang/srt/server_args.py`: "Requests with higher
  priority integer values will be scheduled first by default", unless
  `--schedule-low-priority-values-first`; an incoming request preempts running ones only when
  its priority is at least `--priority-scheduling-preemption-threshold`, 10, higher): priority = band.

The launch flags (`launch_flags`) are what the emitted engine scripts add for a pool with
`engine_priority` (gateway/plans/emit.py).
"""

from __future__ import annotations

from typing import Any

from gateway.dialects.names import CHAT, COMPLETIONS, RESPONSES
from gateway.parsing import ForwardBody, Payload
from gateway.protocol.body import SCHEDULING_FIELDS

PRIORITY_FIELD = "priority"
"""The engines' body field (vLLM and SGLang both)."""

PRIORITY_APIS = frozenset({CHAT, COMPLETIONS, RESPONSES})
"""The APIs whose engine requests carry `priority` (vLLM's Messages request has none)."""

LAUNCH_FLAGS: dict[str, tuple[str, ...]] = {
    "vllm": ("--scheduling-policy priority",),
    "ascend": ("--scheduling-policy priority",),
    "sglang": ("--enable-priority-scheduling",),
}
"""Engine kind -> the flags that turn its priority scheduling on (vllm-ascend takes vLLM's CLI)."""


def engine_value(engine: str, band: int) -> int:
    """The engine `priority` of a request in `band` on an `engine` kind (see the module docstring)."""
    return band if engine == "sglang" else -band


def launch_flags(engine: str) -> tuple[str, ...]:
    """The launch flags of `engine`'s priority scheduling (none for an engine kind without it)."""
    return LAUNCH_FLAGS.get(engine, ())


def client_value(payload: Payload, name: str = PRIORITY_FIELD) -> Any:
    """The client's own `priority` (or another of `SCHEDULING_FIELDS`) in `payload`; None when it
    sent none or null."""
    if isinstance(payload, ForwardBody):
        return next((v for k, v in payload.head_fields if k == name), None)
    return payload.get(name)


def without_scheduling_fields(payload: Payload) -> Payload:
    """`payload` without the client's `SCHEDULING_FIELDS` (itself when it has none)."""
    for name in SCHEDULING_FIELDS:
        if client_value(payload, name) is not None:
            payload = _with(payload, name, None)
    return payload


def with_priority(payload: Payload, value: int | None) -> Payload:
    """`payload` with the engine `priority` set to `value`, or left out (None)."""
    return _with(payload, PRIORITY_FIELD, value)


def _with(payload: Payload, name: str, value: Any) -> Payload:
    if isinstance(payload, ForwardBody):
        return payload.with_member(name, value)
    if value is None:
        return {k: v for k, v in payload.items() if k != name}
    return {**payload, name: value}
