"""The SSRF address policy of the image fetch: which addresses are refused, and how hosts are read."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network

import pytest

from gateway.routing.address_policy import AddressPolicy, embedded_ipv4, literal_address

DEFAULT = AddressPolicy()


@pytest.mark.parametrize(("address", "reason"), [
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("::1", "loopback"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("10.1.2.3", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    ("fc00::1", "private"),
    ("fd12:3456:789a::1", "private"),              # RFC 4193 ULA
    ("169.254.169.254", "link_local"),             # AWS / GCP / Azure instance metadata
    ("169.254.0.1", "link_local"),
    ("fe80::1", "link_local"),
    ("fe80::1%eth0", "link_local"),
    ("fd00:ec2::254", "private"),                  # AWS metadata over IPv6
    ("100.64.0.1", "shared"),                      # carrier-grade NAT
    ("100.100.100.200", "shared"),                 # Alibaba Cloud metadata
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "reserved"),
    ("192.0.0.8", "reserved"),
    ("192.0.2.1", "reserved"),
    ("198.18.0.1", "reserved"),
    ("2001:db8::1", "reserved"),
    ("2001::1", "reserved"),                       # Teredo
    ("fec0::1", "site_local"),
    # IPv6 forms carrying an IPv4 address are judged by that address.
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:7f00:1", "loopback"),
    ("::ffff:169.254.169.254", "link_local"),
    ("::ffff:10.0.0.1", "private"),
    ("::ffff:0.0.0.0", "unspecified"),
    ("2002:7f00:1::", "loopback"),                 # 6to4 of 127.0.0.1
    ("2002:a9fe:a9fe::1", "link_local"),           # 6to4 of 169.254.169.254
    ("64:ff9b::7f00:1", "loopback"),               # NAT64 of 127.0.0.1
    ("64:ff9b::a9fe:a9fe", "link_local"),          # NAT64 of 169.254.169.254
    ("::127.0.0.1", "reserved"),                   # deprecated IPv4-compatible form
])
def test_non_public_addresses_are_refused(address: str, reason: str) -> None:
    assert DEFAULT.refusal(ip_address(address)) == reason


@pytest.mark.parametrize("address", ["0.1.2.3", "100::1", "2001:10::1", "::ffff:0:1.2.3.4"])
def test_other_special_purpose_ranges_are_refused(address: str) -> None:
    # "this network", discard-only, ORCHID, IPv4-translated: which word
    # `ipaddress` files them under varies between Python releases; that they are refused does not.
    assert DEFAULT.refusal(ip_address(address)) is not None


@pytest.mark.parametrize("address", [
    "8.8.8.8", "1.1.1.1", "93.184.216.34", "151.101.1.69",
    "2606:4700:4700::1111", "2001:4860:4860::8888",
    "::ffff:8.8.8.8",                              # mapped public: judged as 8.8.8.8, not as reserved ::/8
    "64:ff9b::808:808",                            # NAT64 of 8.8.8.8 (IPv6-only networks)
    "2002:808:808::1",                             # 6to4 of 8.8.8.8
])
def test_public_unicast_addresses_are_allowed(address: str) -> None:
    assert DEFAULT.refusal(ip_address(address)) is None


def test_allow_networks_override_the_refusals_and_nothing_more() -> None:
    policy = AddressPolicy([ip_network("127.0.0.1/32"), ip_network("10.20.0.0/16")])
    assert policy.refusal(IPv4Address("127.0.0.1")) is None
    assert policy.refusal(IPv6Address("::ffff:127.0.0.1")) is None  # the same address, mapped
    assert policy.refusal(IPv4Address("10.20.3.4")) is None
    assert policy.refusal(IPv4Address("127.0.0.2")) == "loopback"
    assert policy.refusal(IPv6Address("::1")) == "loopback"
    assert policy.refusal(IPv4Address("10.21.0.1")) == "private"
    assert policy.refusal(IPv4Address("169.254.169.254")) == "link_local"


@pytest.mark.parametrize(("host", "address"), [
    ("127.0.0.1", "127.0.0.1"),
    ("[::1]", "::1"),
    ("[::ffff:127.0.0.1]", "::ffff:127.0.0.1"),
    ("[fe80::1%25eth0]", "fe80::1%eth0"),          # a URL's zone id is percent-encoded
    # Legacy IPv4 spellings libc's inet_aton (so getaddrinfo) and WHATWG URL parsers accept.
    ("2130706433", "127.0.0.1"),                   # one 32-bit decimal number
    ("0x7f000001", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"),                       # a.b: b fills the low 24 bits
    ("127.1", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),                   # octal
    ("0x7F.0.0.1", "127.0.0.1"),
    ("0xa9.0xfe.0xa9.0xfe", "169.254.169.254"),
    ("2852039166", "169.254.169.254"),
    ("127.0.0.1.", "127.0.0.1"),                   # trailing dot
    ("0", "0.0.0.0"),
])
def test_literal_addresses_in_every_spelling(host: str, address: str) -> None:
    assert literal_address(host) == ip_address(address)


@pytest.mark.parametrize("host", ["2130706433", "0x7f.1", "0177.0.0.1", "[::ffff:127.0.0.1]", "017700000001"])
def test_obfuscated_loopback_spellings_are_refused(host: str) -> None:
    address = literal_address(host)
    assert address is not None
    assert DEFAULT.refusal(address) == "loopback"


@pytest.mark.parametrize("host", ["localhost", "example.com", "metadata.google.internal", "1e100.net",
                                  "127.0.0.1.nip.io", "999.1.1.1", "08.0.0.1", "1.2.3.4.5", ""])
def test_names_are_not_literals_and_go_through_dns(host: str) -> None:
    # The decision for these is made on the addresses they resolve to (see test_image_fetch.py).
    assert literal_address(host) is None


def test_embedded_ipv4_of_plain_ipv6_is_none() -> None:
    assert embedded_ipv4(IPv6Address("2606:4700::1111")) is None
    assert embedded_ipv4(IPv6Address("::ffff:1.2.3.4")) == IPv4Address("1.2.3.4")
