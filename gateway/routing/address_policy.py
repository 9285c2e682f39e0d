"""Which network addresses the gateway may fetch a client's URL from: the SSRF guard of image fetching.

Pure (no I/O). The decision is made on addresses, after DNS resolution, never on host names:
`literal_address` reads a host that is already an address (including the legacy IPv4 forms
`2130706433`, `0x7f.1`, `0177.0.0.1` that libc's `inet_aton` and WHATWG URL parsers accept), and
`AddressPolicy.refusal` says why an address is refused, if it is. IPv6 forms that embed an IPv4
address (`::ffff:a.b.c.d`, 6to4 `2002::/16`, NAT64 `64:ff9b::/96`) are judged by that IPv4 address.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from urllib.parse import unquote

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

# `inet_aton` forms: 1 to 4 dot-separated parts, each decimal, 0x-hex or 0-octal.
_LEGACY_IPV4 = re.compile(r"(?:0[xX][0-9a-fA-F]*|[0-9]+)(?:\.(?:0[xX][0-9a-fA-F]*|[0-9]+)){0,3}\.?")

# Refused on top of what `ipaddress` flags: its lists changed between Python patch releases
# (3.11.10 and 3.12.4 widened is_private), so the ranges this guard relies on are named here.
# Source: the IANA IPv4 and IPv6 Special-Purpose Address Registries (RFC 6890 and updates).
_NAMED_RANGES: tuple[tuple[str, IPNetwork], ...] = tuple((reason, ip_network(net)) for reason, net in (
    ("shared", "100.64.0.0/10"),         # RFC 6598 carrier-grade NAT; Alibaba Cloud's metadata is 100.100.100.200
    ("reserved", "192.0.0.0/24"),        # IETF protocol assignments
    ("reserved", "192.0.2.0/24"),        # documentation (TEST-NET-1..3)
    ("reserved", "198.51.100.0/24"),
    ("reserved", "203.0.113.0/24"),
    ("reserved", "198.18.0.0/15"),       # benchmarking
    ("reserved", "240.0.0.0/4"),         # future use, and 255.255.255.255 broadcast
    ("private", "fc00::/7"),             # RFC 4193 unique local addresses
    ("site_local", "fec0::/10"),         # deprecated site-local (RFC 3879), still routed by some networks
    ("reserved", "2001:db8::/32"),       # documentation
    ("reserved", "2001::/23"),           # IETF protocol assignments (Teredo, ORCHID, ...)
))
_NAT64 = IPv6Network("64:ff9b::/96")  # RFC 6052 well-known prefix: the low 32 bits are an IPv4 address


def literal_address(host: str) -> IPAddress | None:
    """The address `host` (a URL's host, brackets allowed) denotes without DNS, or None for a name.

    Accepts canonical IPv4/IPv6 and the legacy IPv4 forms libc resolves the same way
    (`2130706433`, `0x7f.1`, `0177.0.0.1`, `127.1`), so no spelling of an address slips past
    the policy as a "name". A numeric-looking host that is no valid address (`999.1.1.1`) is None.
    """
    text = unquote(host.strip().removeprefix("[").removesuffix("]"))
    try:
        return ip_address(text)
    except ValueError:
        pass
    if _LEGACY_IPV4.fullmatch(text):
        try:
            return IPv4Address(socket.inet_aton(text.rstrip(".")))
        except OSError:
            return None
    return None


def embedded_ipv4(address: IPv6Address) -> IPv4Address | None:
    """The IPv4 address an IPv6 address carries (IPv4-mapped, 6to4, NAT64 well-known), else None."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return IPv4Address(int(address) & 0xFFFF_FFFF)
    return None


class AddressPolicy:
    """Refuses every address that is not plainly public unicast, except explicitly allowed networks.

    Refused (reason in brackets): unspecified `0.0.0.0`/`::` [unspecified], loopback
    [loopback], link-local 169.254/16 and fe80::/10, which hold cloud metadata endpoints
    such as 169.254.169.254 [link_local], multicast [multicast], RFC 1918 and RFC 4193 ranges
    [private], carrier-grade NAT 100.64/10 [shared], reserved, documentation and benchmarking
    ranges [reserved], deprecated site-local fec0::/10 [site_local], and anything else
    `ipaddress` does not call global [not_global]. `allow_networks` wins over all of these (e.g.
    `127.0.0.1/32` for a test's loopback image server, or an internal image host's subnet).
    """

    def __init__(self, allow_networks: Sequence[IPNetwork] = ()) -> None:
        self.allow_networks = tuple(allow_networks)

    def refusal(self, address: IPAddress) -> str | None:
        """None when the gateway may connect to `address`, else why not (a short bounded word)."""
        if self._allowed(address):
            return None
        if isinstance(address, IPv6Address) and (inner := embedded_ipv4(address)) is not None:
            if self._allowed(inner):
                return None
            address = inner
        return special_kind(address)

    def _allowed(self, address: IPAddress) -> bool:
        return any(address in network for network in self.allow_networks)


def special_kind(address: IPAddress) -> str | None:
    """What kind of non-public address `address` is (see AddressPolicy), None for public unicast."""
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link_local"
    if address.is_multicast:
        return "multicast"
    for reason, network in _NAMED_RANGES:
        if address in network:
            return reason
    if address.is_private:
        return "private"
    if address.is_reserved:
        return "reserved"
    if isinstance(address, IPv6Address) and address.is_site_local:
        return "site_local"
    if not address.is_global:
        return "not_global"
    return None
