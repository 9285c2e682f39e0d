"""The overhead benchmark's pure helpers: medians over rounds, added TTFT, ratios, profiles, request bytes."""

from __future__ import annotations

import itertools

import orjson

from loadtest.overhead_load import UNIQUE_DIGITS, RequestMaker, prompt_text
from loadtest.overhead_stats import (
    DIRECT,
    NO_FRAME,
    Sample,
    aggregate,
    closed_loop_rps,
    find,
    fmt,
    fmt_ratio,
    median,
    ratio,
    sample_from,
    top_self,
)


def _sample(target: str, rnd: int, p50: float, p99: float, ok: int = 100, cpu_ms: float | None = None) -> Sample:
    return Sample("stream c=1 16KiB", target, rnd, ok, 0, 1.0, ok * 33, p50, p99, p50, cpu_ms, 50.0)


def test_added_ttft_is_taken_within_each_round_then_the_median() -> None:
    # Round 1 is slow for both (a noisy machine): the difference, not the level, is what counts.
    samples = [
        _sample(DIRECT, 0, 100, 300), _sample("gateway", 0, 900, 2000),
        _sample(DIRECT, 1, 5000, 9000), _sample("gateway", 1, 5700, 9500),
        _sample(DIRECT, 2, 120, 250), _sample("gateway", 2, 1020, 2250),
    ]
    rows = aggregate(samples)
    gateway = find(rows, "stream c=1 16KiB", "gateway")
    assert gateway is not None
    assert gateway.added_p50_us == 800  # differences 800, 700, 900
    assert gateway.added_p99_us == 1700  # differences 1700, 500, 2000
    assert gateway.ttft_p50_us == 1020  # the median of the levels 900, 5700, 1020
    assert gateway.rounds == 3
    direct = find(rows, "stream c=1 16KiB", DIRECT)
    assert direct is not None and direct.added_p50_us is None


def test_no_added_ttft_under_load() -> None:
    # At concurrency 64 the TTFT is mostly the client's own queue: a difference would mislead.
    loaded = [Sample("stream c=64 16KiB", name, 0, 100, 0, 1.0, 3300, p50, p50, p50, None, None, concurrency=64)
              for name, p50 in ((DIRECT, 9000.0), ("gateway", 80000.0))]
    row = find(aggregate(loaded), "stream c=64 16KiB", "gateway")
    assert row is not None and row.ttft_p50_us == 80000.0
    assert row.added_p50_us is None and row.added_p99_us is None


def test_rows_keep_first_appearance_order_and_sum_errors() -> None:
    a = sample_from("json c=64 16KiB", "gateway", 0, ok=90, errors=2, seconds=2.0, events=90,
                    first_us=[1.0, 2.0, 3.0], total_us=[1.0, 2.0, 3.0], cpu_s=0.18, rss_kb=2048,
                    error_kinds={"HTTP 503": 2})
    b = sample_from("json c=64 16KiB", "gateway", 1, ok=110, errors=1, seconds=2.0, events=110,
                    first_us=[2.0], total_us=[2.0], cpu_s=0.22, rss_kb=4096, error_kinds={"HTTP 503": 1})
    c = sample_from("stream c=1 200B", "gateway", 0, ok=10, errors=0, seconds=1.0, events=330,
                    first_us=[5.0], total_us=[6.0], cpu_s=None, rss_kb=None)
    rows = aggregate([a, c, b])
    assert [r.scenario for r in rows] == ["json c=64 16KiB", "stream c=1 200B"]
    json_row = rows[0]
    assert json_row.errors == 3 and json_row.requests == 203
    assert json_row.error_kinds == {"HTTP 503": 3}
    assert json_row.rps == 50.0  # median of 45 and 55 req/s
    assert json_row.cpu_ms_per_req == 2.0  # median of 2.0 and 2.0 ms
    assert json_row.rss_peak_mb == 4.0  # the peak is the max over rounds, not a median
    assert a.ttft_p50_us == 2.0 and a.cpu_ms_per_req == 2.0
    assert rows[1].cpu_ms_per_req is None and rows[1].rss_peak_mb is None


def test_median_ratio_and_formatting() -> None:
    assert median([None, 3.0, 1.0, None, 2.0]) == 2.0
    assert median([None]) is None
    assert ratio(10.0, 4.0) == 2.5
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
    assert fmt_ratio(2.345) == "2.35x" and fmt_ratio(23.45) == "23.4x" and fmt_ratio(234.5) == "234x"
    assert fmt_ratio(None) == "-"
    assert fmt(12345.678) == "12,346" and fmt(1.23456, 3) == "1.235" and fmt(None) == "-"


def test_profile_self_time_by_function_file_and_package() -> None:
    lines = [
        'process 1:"python -m gateway.cli serve";main (gateway/cli.py);handle (gateway/service.py);'
        "_assign (httpcore/_async/connection_pool.py) 30",
        'process 1:"python -m gateway.cli serve";main (gateway/cli.py);handle (gateway/service.py);'
        "parse (gateway/service.py) 10",
        'process 1:"python -m gateway.cli serve";main (gateway/cli.py);'
        "send (uvicorn/protocols/http/httptools_impl.py:40) 5",
        'process 1:"python -m gateway.cli serve" 5',
        "not a stack line",
    ]
    top = top_self(lines, n=3)
    assert top.total == 50
    assert top.functions == [("_assign (httpcore/_async/connection_pool.py)", 30),
                             ("parse (gateway/service.py)", 10),
                             ("send (uvicorn/protocols/http/httptools_impl.py)", 5)]
    assert dict(top.packages) == {"httpcore": 30, "gateway": 10, "uvicorn": 5}
    assert ("handle (gateway/service.py)", 40) in top.gateway_inclusive
    assert all("gateway/cli.py" not in name for name, _ in top.gateway_inclusive)
    everything = top_self(lines, n=10)
    assert (NO_FRAME, 5) in everything.functions


def test_request_bytes_are_json_of_the_asked_size_with_a_unique_prefix() -> None:
    counter = itertools.count(7)
    maker = RequestMaker(8000, 16 * 1024, True, 32, "key", counter)
    first, second = maker.parts(), maker.parts()
    head, body = first[0], b"".join(first[1:])
    assert f"content-length: {len(body)}\r\n".encode() in head
    payload = orjson.loads(body)
    content = payload["messages"][0]["content"]
    assert len(content) == 16 * 1024
    assert content[:UNIQUE_DIGITS] == "000000000007"
    assert payload["max_tokens"] == 32 and payload["stream"] is True
    assert payload["stream_options"] == {"include_usage": True}
    assert b"".join(second[1:]) != body and len(b"".join(second[1:])) == len(body)
    plain = orjson.loads(b"".join(RequestMaker(8000, 200, False, 8, "key", counter).parts()[1:]))
    assert "stream_options" not in plain and plain["stream"] is False
    assert prompt_text(5) == b"alpha" and len(prompt_text(1 << 20)) == 1 << 20


def test_closed_loop_throughput_from_answer_times() -> None:
    # 256 clients, each answer takes 10 s (a server answering everyone at once): 25.6 req/s, even
    # though no answer ended inside a short window.
    assert closed_loop_rps(256, [10.0] * 256) == 25.6
    assert closed_loop_rps(4, [0.5, 1.5]) == 4.0
    assert closed_loop_rps(4, []) is None
    slow = Sample("stream c=256 16KiB", "litellm", 0, 256, 0, 12.0, 256 * 34, None, None, None, 40.0, None,
                  concurrency=256, little_rps=25.6)
    assert slow.rps == 25.6 and slow.chunks_per_s == 25.6 * 34
    row = find(aggregate([slow]), "stream c=256 16KiB", "litellm")
    assert row is not None and row.little_rounds == 1 and row.rps == 25.6


def _row_sample(scenario: str, target: str, cpu_ms: float) -> Sample:
    return Sample(scenario, target, 0, 100, 0, 1.0, 3300, 500.0, 900.0, 500.0, cpu_ms, 50.0, concurrency=64)


def test_scenarios_name_a_new_connection_per_request_and_refuse_another_fourth_field() -> None:
    from loadtest.overhead import _scenarios

    kept, fresh = _scenarios("stream:64:16KiB,stream:64:16KiB:new")
    assert (kept.fresh, kept.name) == (False, "stream c=64 16KiB")
    assert (fresh.fresh, fresh.name) == (True, "stream c=64 16KiB newconn")
    try:
        _scenarios("stream:64:16KiB:old")
    except SystemExit as exc:
        assert "fourth field" in str(exc)
    else:
        raise AssertionError("a fourth field other than `new` was accepted")


def test_production_targets_compare_prod_with_bare_and_new_connections_with_kept_alive() -> None:
    from loadtest.overhead import production_targets

    rows = aggregate([
        _row_sample("stream c=64 16KiB", "gateway", 1.0), _row_sample("stream c=64 16KiB", "gateway+prod", 1.2),
        _row_sample("stream c=64 16KiB newconn", "gateway", 1.25),
        _row_sample("stream c=64 16KiB newconn", "gateway+prod", 1.5),
        _row_sample("stream c=64 16KiB", "vllm-router", 0.5),
        _row_sample("stream c=64 16KiB newconn", "vllm-router", 1.0),
    ])
    figures = {t["target"]: (t["value"].split(" ")[0], t["met"]) for t in production_targets(rows)}
    assert figures == {
        "CPU per request, stream c=64 16KiB: gateway+prod / gateway": ("1.20x", False),
        "CPU per request, stream c=64 16KiB newconn: gateway+prod / gateway": ("1.20x", False),
        "CPU per request, gateway: stream c=64 16KiB newconn / kept alive": ("1.25x", True),
        "CPU per request, gateway+prod: stream c=64 16KiB newconn / kept alive": ("1.25x", True),
    }


def test_the_production_gateway_config_has_auth_limits_and_redis_and_validates() -> None:
    from gateway.auth.keys import hash_key
    from gateway.config import GatewayConfig
    from loadtest.overhead_targets import MASTER_KEY, PROD_LIMIT, gateway_config

    bare = GatewayConfig.model_validate(gateway_config(8000, "http://127.0.0.1:9", "info", None))
    prod = GatewayConfig.model_validate(gateway_config(8000, "http://127.0.0.1:9", "info", "kgw:ovh:x", "kgw:ovhrl:x"))
    assert not bare.auth.enabled and bare.redis_url is None
    assert prod.auth.enabled and prod.redis_url is not None and prod.auth.key_prefix == "kgw:ovhrl:x"
    (key,) = prod.auth.keys
    assert key.requests_per_minute == key.tokens_per_minute == PROD_LIMIT
    assert key.sha256 == hash_key(MASTER_KEY)


def test_redis_outcomes_are_read_from_a_gateways_metrics() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from loadtest.overhead_targets import Target, redis_outcomes

    body = (b"# HELP kimi_gateway_affinity_lookups_total x\n"
            b'kimi_gateway_affinity_lookups_total{pool="bench",result="miss"} 1735.0\n'
            b'kimi_gateway_affinity_lookups_total{pool="bench",result="skipped"} 262.0\n'
            b'kimi_gateway_affinity_lookups_created{pool="bench",result="miss"} 1.7e+09\n'
            b'kimi_gateway_redis_errors_total{op="rate_limit"} 46.0\n'
            b'kimi_gateway_requests_total{pool="bench"} 9.0\n')

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None

    server = HTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        outcomes = redis_outcomes(Target("gateway+prod", "gateway", server.server_address[1]))
    finally:
        server.shutdown()
        server.server_close()
    assert outcomes == {"affinity_lookups[miss]": 1735.0, "affinity_lookups[skipped]": 262.0,
                        "redis_errors[rate_limit]": 46.0}
