"""The request body decoder: JSON objects only, and no silent rounding of 64-bit-overflowing integers."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest
from gateway.protocol.body import decode_json_object


@pytest.mark.parametrize(("body", "param", "shown"), [
    (b'{"seed": 18446744073709551616}', "seed", "18446744073709551616"),
    (b'{"foo" : -9223372036854775809}', "foo", "-9223372036854775809"),
    (b'{"x": 1e20, "y":1' + b"0" * 30 + b"}", "y", "1" + "0" * 30),
    (b'{"seed": 2' + b"0" * 300 + b"}", "seed", "2" + "0" * 36 + "..."),
    # the same key inside a string is not the parameter
    (b'{"m": "\\"seed\\": 1' + b"0" * 30 + b'", "seed": 99999999999999999999}', "seed", "99999999999999999999"),
])
def test_top_level_integers_beyond_64_bits_are_400(body: bytes, param: str, shown: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_json_object(body)
    assert (info.value.param, info.value.code) == (param, "integer_out_of_range")
    assert info.value.message == f"The integer {shown} does not fit in 64 bits."


def test_an_escaped_key_or_too_many_huge_numbers_are_refused_without_scanning_long() -> None:
    with pytest.raises(InvalidRequest) as escaped:
        decode_json_object(b'{"\\u0073eed": 18446744073709551616}')
    assert (escaped.value.param, escaped.value.message) == ("seed", "The value of 'seed' does not fit in 64 bits.")
    many = b"{" + b", ".join(b'"k%d": 1e19' % i for i in range(5)) + b"}"
    with pytest.raises(InvalidRequest, match="More than 4 top-level numbers"):
        decode_json_object(many)
    assert decode_json_object(many.replace(b', "k4": 1e19', b""))["k3"] == 1e19  # four float literals pass


@pytest.mark.parametrize(("body", "expected"), [
    (b'{"seed": 18446744073709551615, "n": -9223372036854775808}',
     {"seed": 18446744073709551615, "n": -9223372036854775808}),
    (b'{"temperature": 1e20, "top_p": -2.5e30}', {"temperature": 1e20, "top_p": -2.5e30}),  # floats stay floats
    (b'{"tools": [{"maximum": 1' + b"0" * 25 + b"}]}", {"tools": [{"maximum": 1e25}]}),  # deeper: a JSON number
])
def test_numbers_in_range_and_floats_pass(body: bytes, expected: dict[str, object]) -> None:
    assert decode_json_object(body) == expected


@pytest.mark.parametrize("body", [b"", b"[]", b'"x"', b"{", b'{"a": 1e999}'])
def test_anything_but_a_json_object_is_invalid_json(body: bytes) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_json_object(body)
    assert info.value.code == "invalid_json"


def test_a_float_under_a_key_escaped_as_python_writes_it_passes() -> None:
    """Python's `json.dumps` (so `requests`, Schemathesis' client) writes a non-ASCII key as `\\u00bb`:
    the scan finds that spelling too, so a float there is not taken for a huge integer (Schemathesis
    sent `{"\\u00bb": -1.76e+161}` and got a 400)."""
    assert decode_json_object(b'{"\\u00bb": -1.7624481993596568e+161}') == {"\u00bb": -1.7624481993596568e+161}
    with pytest.raises(InvalidRequest) as info:
        decode_json_object(b'{"\\u00bb": 18446744073709551616}')
    assert info.value.message == "The integer 18446744073709551616 does not fit in 64 bits."
