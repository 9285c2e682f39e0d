"""The stream relay and the engine exchange (`gateway/streaming.py`) without a socket: an in-memory
engine answer (the `UpstreamResponse` surface) relayed by `UpstreamStream`, the facts it reports to
the request's ledger and the verdict it hands its owner; `first_content`'s hold before the first
token; `open_upstream`'s reading of engine errors. (`classify_event` on the engines' shapes:
tests/unit/test_stream_hold.py; `Holding` and `Lease`: tests/unit/test_dispatch_attempt.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import pytest

from gateway.backends.client import UpstreamTimeouts
from gateway.backends.h1 import H1Error
from gateway.backends.registry import WorkerRegistry
from gateway.config import parse_config
from gateway.dispatch.ledger import Ledger
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.record import RequestOutcome
from gateway.redact import Redactor
from gateway.streaming import (
    KEEPALIVE_COMMENT,
    AttemptFailed,
    EventTooLarge,
    Holding,
    Outcome,
    UpstreamStream,
    _retry_after,
    error_event_at,
    first_content,
    open_upstream,
)

CHUNK = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
DONE = b"data: [DONE]\n\n"


class Answer:
    """An engine's answer in memory: its chunks, then (`fail`) a transport error, or (`stall`) no end."""

    def __init__(self, chunks: list[bytes], status: int = 200, content_type: str = "text/event-stream",
                 fail: bool = False, stall: float | None = None, headers: Mapping[str, str] | None = None,
                 secrets: tuple[str, ...] = ()) -> None:
        self.status_code = status
        self.headers: Mapping[str, str] = {"content-type": content_type, **(headers or {})}
        self.redact = Redactor(secrets)
        self._chunks = chunks
        self._fail = fail
        self._stall = stall
        self.closed = 0

    async def _iterate(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self._chunks):
            if i and self._stall is not None:
                await asyncio.sleep(self._stall)
            yield chunk
        if self._fail:
            raise H1Error("connection reset")

    def chunks(self) -> AsyncIterator[bytes]:
        return self._iterate()

    def codings(self) -> list[str]:
        return []

    async def aclose(self) -> None:
        self.closed += 1


def ledger(api: str = "chat") -> Ledger:
    config = parse_config({"pools": [{"name": "p", "engine": "vllm", "max_context_tokens": 8192,
                                      "workers": ["http://a:1"]}]}, environ={})
    return Ledger(api, "r", None, GatewayMetrics(), WorkerRegistry(config))


def stream(answer: Answer, book: Ledger, verdicts: list[str | None], **options: object) -> UpstreamStream:
    """The stream of `answer` accepted at its first chunk, reporting verdicts into `verdicts`."""
    chunks = answer.chunks()
    holding = Holding()
    holding.opened(answer)
    first = answer._chunks[0] if not options.pop("waiting", False) else b""
    if first:
        chunks = _skip_first(chunks)
    return UpstreamStream(answer, first, chunks, holding, book, first == b"", on_end=verdicts.append,
                          **options)  # type: ignore[arg-type]


async def _skip_first(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    await anext(chunks)
    async for chunk in chunks:
        yield chunk


async def relayed(relay: UpstreamStream) -> bytes:
    return b"".join([part async for part in relay.body()])


# -- UpstreamStream ----------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_a_complete_stream_is_relayed_byte_exact_and_reports_its_usage_and_a_good_verdict() -> None:
    answer, book, verdicts = Answer([ROLE + CHUNK[:30], CHUNK[30:], USAGE, DONE]), ledger(), []
    out = await relayed(stream(answer, book, verdicts))
    assert out == ROLE + CHUNK + USAGE + DONE
    assert verdicts == [None] and answer.closed == 1
    assert book.record.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert book.record.outcome is RequestOutcome.OK


@pytest.mark.anyio
async def test_a_stream_cut_mid_event_ends_on_a_whole_event_with_one_error_event_and_a_bad_verdict() -> None:
    answer, book, verdicts = Answer([ROLE, CHUNK[:40]], fail=True), ledger(), []
    out = await relayed(stream(answer, book, verdicts))
    assert out.startswith(ROLE) and b'"content":"h' not in out  # the half event is never relayed
    assert out.endswith(b"\n\n") and b'"error"' in out[len(ROLE):] and DONE not in out
    assert book.record.outcome is RequestOutcome.UPSTREAM_ERROR and "mid-stream" in (book.record.error or "")
    assert verdicts == [book.record.error]


@pytest.mark.anyio
async def test_an_end_without_done_is_reported_as_incomplete() -> None:
    book, verdicts = ledger(), []
    out = await relayed(stream(Answer([ROLE, CHUNK]), book, verdicts))
    assert out.startswith(ROLE + CHUNK) and b"ended the stream early" in out
    assert book.record.outcome is RequestOutcome.UPSTREAM_ERROR and verdicts and verdicts[0] is not None


@pytest.mark.anyio
async def test_a_connection_reset_after_done_is_a_complete_answer() -> None:
    book, verdicts = ledger(), []
    out = await relayed(stream(Answer([CHUNK, DONE], fail=True), book, verdicts))
    assert out == CHUNK + DONE and verdicts == [None] and book.record.outcome is RequestOutcome.OK


@pytest.mark.anyio
async def test_the_usage_patch_strips_only_its_own_chunk() -> None:
    book, verdicts = ledger(), []
    out = await relayed(stream(Answer([CHUNK, USAGE, DONE]), book, verdicts, strip_usage=True))
    assert out == CHUNK + DONE and book.record.usage is not None  # the record still gets the usage


@pytest.mark.anyio
async def test_an_event_longer_than_the_limit_ends_the_stream_with_an_error() -> None:
    book, verdicts = ledger(), []
    out = await relayed(stream(Answer([CHUNK, b"data: " + b"x" * 70_000, b"y" * 70_000]), book, verdicts,
                               max_event=100_000))
    assert out.startswith(CHUNK) and b"longer than the gateway relays (100000 bytes)" in out
    assert b"xxx" not in out
    assert book.record.outcome is RequestOutcome.UPSTREAM_ERROR


@pytest.mark.anyio
async def test_a_committed_stream_sends_keepalives_until_its_first_byte_which_the_ledger_notes() -> None:
    book, verdicts = ledger(), []
    relay = stream(Answer([CHUNK, DONE], stall=0.0), book, verdicts, waiting=True, keepalive_interval=0.01)
    answer_chunks = relay._rest

    async def slow() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.05)
        async for chunk in answer_chunks:
            yield chunk

    relay._rest = slow()
    out = await relayed(relay)
    assert out.startswith(KEEPALIVE_COMMENT) and out.endswith(CHUNK + DONE)
    assert book.record.first_byte_at is not None and verdicts == [None]


@pytest.mark.anyio
async def test_an_aborted_stream_blames_nobody_and_says_why() -> None:
    book, verdicts = ledger(), []
    answer = Answer([ROLE, CHUNK], fail=True)
    relay = stream(answer, book, verdicts)
    await relay.abort("The prefill worker failed before the first token")
    out = await relayed(relay)
    assert b"The prefill worker failed before the first token" in out and verdicts == []
    assert book.record.error is not None and book.record.error.startswith("The prefill worker failed")


@pytest.mark.anyio
async def test_closing_an_unread_stream_releases_it_once() -> None:
    answer, book = Answer([CHUNK, DONE]), ledger()
    relay = stream(answer, book, [])
    await relay.aclose()
    await relay.aclose()
    assert answer.closed == 1 and book.record.usage is None


def test_error_event_at_finds_the_first_error_object() -> None:
    error = b'data: {"error": {"message": "boom"}}\n\n'
    assert error_event_at(CHUNK + error + CHUNK) == len(CHUNK)
    assert error_event_at(CHUNK + b'data: {"content": "\\"error\\""}\n\n') == -1


# -- first_content -----------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_first_content_holds_empty_events_and_returns_everything_read() -> None:
    answer = Answer([b": keep-alive\n\n", ROLE, CHUNK, DONE])
    held, rest, content = await first_content(answer, None, sse=True)  # type: ignore[arg-type]
    assert (held, content) == (b": keep-alive\n\n" + ROLE + CHUNK, True)
    assert [chunk async for chunk in rest] == [DONE]


@pytest.mark.anyio
async def test_first_content_past_the_hold_window_commits_without_content() -> None:
    answer = Answer([ROLE, CHUNK], stall=1.0)
    held, _, content = await first_content(answer, 0.05, sse=True)  # type: ignore[arg-type]
    assert (held, content) == (ROLE, False) and answer.closed == 0


@pytest.mark.anyio
@pytest.mark.parametrize(("error", "outcome"), [
    (b'data: {"error": {"message": "This model\'s maximum context length is 8192 tokens", "code": 400}}\n\n',
     Outcome.TOO_LONG),
    (b'data: {"error": {"message": "bad temperature", "code": 422}}\n\n', Outcome.CLIENT_ERROR),
    (b'data: {"error": {"message": "engine crashed", "code": 500}}\n\n', Outcome.PROTOCOL_ERROR),
])
async def test_an_error_event_before_content_fails_the_attempt(error: bytes, outcome: Outcome) -> None:
    answer = Answer([ROLE, error])
    with pytest.raises(AttemptFailed) as caught:
        await first_content(answer, None, sse=True)  # type: ignore[arg-type]
    assert caught.value.outcome is outcome and caught.value.answered and answer.closed == 1


@pytest.mark.anyio
async def test_a_stream_that_ends_or_breaks_before_content_fails_over() -> None:
    for answer, outcome in ((Answer([ROLE]), Outcome.PROTOCOL_ERROR), (Answer([ROLE], fail=True), None)):
        with pytest.raises(AttemptFailed) as caught:
            await first_content(answer, None, sse=True)  # type: ignore[arg-type]
        assert outcome is None or caught.value.outcome is outcome
        assert answer.closed == 1


@pytest.mark.anyio
async def test_first_content_takes_token_level_data_for_output_but_fails_over_on_a_flood() -> None:
    """Token-level data before the first token (vLLM's role chunk with the prompt's token ids, over
    64 KiB, read in pieces): the worker's output, so the response is accepted with every byte read,
    never tried elsewhere. A flood of small content-less events over 1 MiB still fails over."""
    ids = b",".join(b"%d" % (100_000 + i) for i in range(200_000))
    role = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"prompt_token_ids":[' \
        + ids + b"]}\n\n"
    pieces = [role[at:at + 65536] for at in range(0, len(role), 65536)]
    answer = Answer([*pieces, CHUNK, DONE])
    held, rest, content = await first_content(answer, None, sse=True)  # type: ignore[arg-type]
    assert (held, content, answer.closed) == (role, True, 0)
    assert [chunk async for chunk in rest] == [CHUNK, DONE]
    answer = Answer([b": keep-alive\n\n" * 80_000, CHUNK, DONE])
    with pytest.raises(AttemptFailed) as caught:
        await first_content(answer, None, sse=True)  # type: ignore[arg-type]
    assert caught.value.outcome is Outcome.PROTOCOL_ERROR and answer.closed == 1


@pytest.mark.anyio
async def test_first_content_holds_one_unfinished_event_up_to_max_event() -> None:
    """One event still unfinished past 1 MiB is held whole up to `max_event`; past `max_event` it is
    EventTooLarge and the response is closed."""
    text = b'data: {"id":"c","choices":[{"index":0,"text":"' + b"w" * (3 << 20) + b'"}]}\n\n'
    pieces = [text[at:at + 65536] for at in range(0, len(text), 65536)]
    answer = Answer([*pieces, DONE])
    held, _, content = await first_content(answer, None, sse=True, max_event=4 << 20)  # type: ignore[arg-type]
    assert (held, content, answer.closed) == (text, True, 0)
    answer = Answer([*pieces, DONE])
    with pytest.raises(EventTooLarge):
        await first_content(answer, None, sse=True, max_event=2 << 20)  # type: ignore[arg-type]
    assert answer.closed == 1


# -- open_upstream -------------------------------------------------------------------------------------

class Client:
    """The upstream client's `post`, answering `answer`."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout: UpstreamTimeouts,
                   pool: str | None = None) -> Answer:
        return self.answer


@pytest.mark.anyio
@pytest.mark.parametrize(("status", "body", "outcome"), [
    (503, b'{"error": "overloaded"}', Outcome.STATUS_5XX),
    (429, b"slow down", Outcome.STATUS_429),
    (400, b'{"message": "maximum context length is 8192 tokens"}', Outcome.TOO_LONG),
    (401, b"who are you", Outcome.AUTH_ERROR),
    (422, b"bad field", Outcome.CLIENT_ERROR),
    (204, b"", Outcome.PROTOCOL_ERROR),
])
async def test_open_upstream_reads_an_engines_refusal(status: int, body: bytes, outcome: Outcome) -> None:
    answer = Answer([body], status=status, content_type="application/json",
                    headers={"retry-after": "7", "x-ratelimit-remaining-requests": "0"}, secrets=("sk-secret",))
    with pytest.raises(AttemptFailed) as caught:
        await open_upstream(Client(answer), "http://a:1/v1/chat/completions", b"{}", {},  # type: ignore[arg-type]
                            UpstreamTimeouts(1.0, 1.0))
    failure = caught.value
    assert (failure.outcome, failure.status, failure.body) == (outcome, status, body) and answer.closed >= 1
    if outcome is Outcome.STATUS_429:
        assert failure.retry_after == 7.0 and failure.headers == {"x-ratelimit-remaining-requests": "0"}


@pytest.mark.anyio
async def test_open_upstream_redacts_the_config_secrets_from_an_error_body() -> None:
    answer = Answer([b'{"error": "bad key sk-secret"}'], status=500, content_type="application/json",
                    secrets=("sk-secret",))
    with pytest.raises(AttemptFailed) as caught:
        await open_upstream(Client(answer), "http://a:1/v1/chat/completions", b"{}", {},  # type: ignore[arg-type]
                            UpstreamTimeouts(1.0, 1.0))
    assert b"sk-secret" not in caught.value.body and b"[redacted]" in caught.value.body


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), ("3", 3.0), ("-2", 0.0), ("1e9", 3600.0), ("nan", None), ("soon", None),
    ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date in the past: now
])
def test_retry_after_takes_seconds_or_a_date_within_bounds(value: str | None, seconds: float | None) -> None:
    answer = Answer([], headers={} if value is None else {"retry-after": value})
    assert _retry_after(answer) == seconds  # type: ignore[arg-type]
