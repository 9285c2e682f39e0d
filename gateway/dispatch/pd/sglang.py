"""SGLang bootstrap (`mode: sglang`): the same request, with a fresh bootstrap room per prompt, to
both legs at once; the prefill answer is read to its end and dropped (`gateway/protocol/pd.py`)."""

from __future__ import annotations

from gateway.dispatch.pd.attempt import Answer, PdAttempt
from gateway.dispatch.pd.requests import sglang_request
from gateway.protocol.pd import fresh_rooms, host_of
from gateway.streaming import Holding


class SglangRunner:
    """Both legs at once with one body: the prefill worker's host and bootstrap port, fresh rooms."""

    __slots__ = ()

    async def legs(self, pd: PdAttempt, holding: Holding, headers: dict[str, str]) -> Answer:
        """One request for both legs (`sglang_request`), sent at once (`PdAttempt.both`)."""
        prefill = pd.prefill
        body = sglang_request(pd.body, host_of(prefill.url), prefill.bootstrap_port, fresh_rooms(pd.body))
        leg = pd.start_prefill(holding, body, headers)
        return await pd.both(holding, leg, headers, body)


SGLANG = SglangRunner()
