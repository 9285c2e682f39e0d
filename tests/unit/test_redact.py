"""The secrets a config holds, and their redaction (gateway/redact.py)."""

from __future__ import annotations

from gateway.config import parse_config
from gateway.redact import Redactor, config_secrets

POOL = {"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:1"], "max_context_tokens": 1024}


def test_the_secrets_of_a_config_are_its_pools_keys_and_redis_passwords() -> None:
    config = parse_config({"pools": [{**POOL, "api_key": "k-one"}, {**POOL, "name": "q"}],
                           "redis_url": "redis://user:pa%2Fss@127.0.0.1:6379/0"}, environ={})
    assert config_secrets(config) == ["k-one", "pa/ss"]
    sentinel = parse_config({"pools": [POOL], "redis": {"sentinels": ["127.0.0.1:26379"], "service_name": "m",
                                                        "password": "primary-pw", "sentinel_password": "s-pw"}},
                            environ={})
    assert config_secrets(sentinel) == ["primary-pw", "s-pw"]
    assert config_secrets(parse_config({"pools": [POOL], "redis_url": "unix:///tmp/r.sock?password=u-pw"},
                                       environ={})) == ["u-pw"]


def test_a_secret_is_redacted_as_written_json_escaped_and_percent_encoded() -> None:
    redact = Redactor(['se"cr/et+1'])
    assert redact(b'raw se"cr/et+1, json "se\\"cr/et+1", url se%22cr%2Fet%2B1.') == (
        b"raw [redacted], json \"[redacted]\", url [redacted].")
    text = b"nothing to hide"
    assert redact(text) is text and not Redactor() and Redactor(["x"])


def test_a_longer_secret_is_redacted_whole_before_one_inside_it() -> None:
    assert Redactor(["abc", "xxabcxx"])(b"key xxabcxx and abc") == b"key [redacted] and [redacted]"
