"""One request's part in a PD hand-over, as a prefill or decode simulator serves it.

`PdLeg.start` reads the protocol fields of a request (the wire format: `gateway/protocol/pd.py`);
the generation code then calls `before_prefill` in place of the prefill wait (a SGLang prefill
worker waits for its decode partner's bootstrap; a decode worker waits for and receives the KV),
`after_prefill` once the prompt is computed, `response_fields` for the JSON answer and `finish`
when the request ends, however it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.protocol.pd import DO_REMOTE_DECODE, KV_TRANSFER_PARAMS, TRANSFER_ID
from gateway.sim.active import ActiveRequest
from gateway.sim.asgi import DisconnectWatch, Scope
from gateway.sim.dialects import ErrorReply
from gateway.sim.kvcache import PromptKey
from gateway.sim.pd import (
    PdFailure,
    mooncake_pull,
    mooncake_remote,
    new_request_id,
    nixl_pull,
    nixl_remote,
    sglang_bootstrap,
    sglang_receive,
)
from gateway.sim.worker_state import SimRequestRecord, SimWorkerState


@dataclass(eq=False)
class PdLeg:
    """The PD side of one request on one worker (only built for workers with a `pd_role`)."""

    engine: SimWorkerState
    record: SimRequestRecord
    kind: str
    port: int
    rooms: list[int] = field(default_factory=list)
    """SGLang prefill: the bootstrap rooms of the request's prompts."""
    targets: list[tuple[str, int, int]] = field(default_factory=list)
    """SGLang decode: (bootstrap host, port, room) per prompt."""
    nixl_params: dict[str, Any] | None = None
    """vLLM decode: the request's `kv_transfer_params` asking for a remote prefill."""
    nixl_offer: bool = False
    """vLLM NIXL prefill: the request asked to keep its KV for a remote decode."""
    mooncake_params: dict[str, Any] | None = None
    """vLLM Mooncake decode: the request's `kv_transfer_params` asking for a remote prefill."""
    transfer_id: str | None = None
    """vLLM Mooncake prefill: the `transfer_id` to hold the KV under."""
    keys: tuple[PromptKey, ...] = ()
    _rooms_claimed: list[Any] = field(default_factory=list)
    _ready: bool = False

    @classmethod
    def start(cls, engine: SimWorkerState, record: SimRequestRecord, kind: str, body: dict[str, Any],
              n_prompts: int, scope: Scope) -> PdLeg | ErrorReply:
        """The leg of a validated request, or the 400 answer to malformed protocol fields."""
        config = engine.config
        server = scope.get("server") or ("127.0.0.1", 0)
        leg = cls(engine, record, kind, int(server[1] or 0))
        if config.pd_protocol == "sglang":
            targets = sglang_bootstrap(body, n_prompts)
            if isinstance(targets, str):
                return engine.dialect.bad_request(targets)
            if config.pd_role == "prefill":
                leg.rooms = [room for _, _, room in targets]
            else:
                leg.targets = targets
        elif config.pd_protocol == "vllm-mooncake":
            params = body.get(KV_TRANSFER_PARAMS)
            if config.pd_role == "prefill":
                if isinstance(params, dict) and params.get(DO_REMOTE_DECODE) is True and params.get(TRANSFER_ID):
                    leg.transfer_id = str(params[TRANSFER_ID])
            else:
                leg.mooncake_params = mooncake_remote(body)
        elif config.pd_role == "prefill":
            params = body.get(KV_TRANSFER_PARAMS)
            leg.nixl_offer = isinstance(params, dict) and params.get(DO_REMOTE_DECODE) is True
        else:
            leg.nixl_params = nixl_remote(body)
        return leg

    @property
    def sglang_prefill(self) -> bool:
        return bool(self.rooms)

    async def before_prefill(self, watch: DisconnectWatch, active: ActiveRequest) -> int:
        """Wait for the hand-over that precedes the prefill; returns the prompt tokens whose KV
        came from the prefill worker (0 when none). Raises PdFailure (the engine's error)."""
        pd = self.engine.pd
        assert pd is not None
        if self.rooms:
            self._rooms_claimed = await watch.run(pd.sglang_wait_bootstrap(self.rooms))
            return 0
        if self.targets:
            pd.count(waiting_for_kv=1)
            try:
                await watch.run(sglang_receive(self.targets, self.engine.config.pd_wait_timeout_s,
                                               self.engine.http_client))
            except PdFailure:
                pd.count(transfer_failed=1)
                raise
            finally:
                pd.count(waiting_for_kv=-1)
            return await self._transfer(watch, active, active.prompt_tokens)
        if self.nixl_params is not None or self.mooncake_params is not None:
            pd.count(waiting_for_kv=1)
            try:
                if self.nixl_params is not None:
                    blocks = await watch.run(nixl_pull(self.nixl_params, self.engine.http_client))
                    remote = min(blocks * self.engine.config.kv_block_tokens, active.prompt_tokens)
                else:
                    assert self.mooncake_params is not None
                    remote = await watch.run(mooncake_pull(self.mooncake_params, self.engine.config.pd_wait_timeout_s,
                                                           self.engine.http_client))
            except PdFailure as exc:
                pd.count(transfer_failed=1)
                if self.engine.config.kv_load_failure_policy == "fail":
                    raise PdFailure("Internal server error", exc.kind) from None
                self.engine.update(self.record, pd_failure=exc.kind)
                return 0  # "recompute": prefill locally
            finally:
                pd.count(waiting_for_kv=-1)
            return await self._transfer(watch, active, min(remote, active.prompt_tokens))
        return 0

    async def _transfer(self, watch: DisconnectWatch, active: ActiveRequest, remote_tokens: int) -> int:
        """Receive `remote_tokens` of KV less what this worker's own prefix cache holds."""
        tokens = max(0, remote_tokens - active.cached_tokens)
        rate = self.engine.config.kv_transfer_tokens_per_s
        seconds = tokens / rate if rate is not None else 0.0
        await watch.sleep(seconds)
        assert self.engine.pd is not None
        self.engine.pd.count(transfers=1, transfer_seconds=seconds, transferred_tokens=tokens)
        self.engine.update(self.record, kv_transfer_tokens=tokens, kv_transfer_s=seconds)
        return tokens

    def after_prefill(self, active: ActiveRequest) -> None:
        """The prompt's KV is computed: a SGLang prefill worker hands it to the waiting decode; a
        Mooncake prefill worker holds it for the decode worker of its `transfer_id`."""
        pd = self.engine.pd
        if pd is None:
            return
        if self._rooms_claimed:
            pd.sglang_kv_ready(self._rooms_claimed)
            self._ready = True
        elif self.transfer_id is not None:
            pd.mooncake_offer(self.transfer_id, self.keys, active.prompt_tokens)
            self._ready = True

    def response_fields(self, active: ActiveRequest) -> dict[str, Any]:
        """Extra top-level fields of the JSON answer: vLLM's `kv_transfer_params` (the held
        blocks' handle on a prefill worker asked for a remote decode, else null)."""
        if self.engine.config.pd_protocol == "sglang":
            return {}
        if not self.nixl_offer or self.engine.pd is None:
            return {KV_TRANSFER_PARAMS: None}
        request_id = new_request_id(self.kind, self.record.headers)
        return {KV_TRANSFER_PARAMS: self.engine.pd.nixl_offer(request_id, self.keys, active.prompt_tokens,
                                                                  self.port)}

    def finish(self) -> None:
        """The request ended: a prefill that never produced its KV fails its decode partner."""
        if self._ready or self.engine.pd is None:
            return
        if self._rooms_claimed:
            self.engine.pd.sglang_abandon(self.rooms, self._rooms_claimed, "prefill request ended without KV")
        elif self.transfer_id is not None:
            self.engine.pd.mooncake_abandon(self.transfer_id, "prefill request ended without KV")
