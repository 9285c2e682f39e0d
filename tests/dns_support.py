"""A tiny DNS server on a loopback UDP port whose records a test sets (dnspython builds the answers)."""

from __future__ import annotations

import socket
import threading
from types import TracebackType

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class LoopbackDns:
    """Answers A, AAAA and SRV questions from `a`, `aaaa` and `srv` (absolute names, trailing dot).

    `srv[name]` is a list of `(target, port)`; with `glue` on, the targets' A records go into the
    additional section (as CoreDNS does for a headless Service), else the resolver asks for them.
    A name in none of the tables is NXDOMAIN. `failing` on: every answer is SERVFAIL; `failing_types`
    (e.g. {"A"}): questions of those types only are SERVFAIL. `queries` counts the questions seen.
    Tables may be changed while it runs (replace the lists, don't edit).
    """

    def __init__(self, glue: bool = True) -> None:
        self.a: dict[str, list[str]] = {}
        self.aaaa: dict[str, list[str]] = {}
        self.srv: dict[str, list[tuple[str, int]]] = {}
        self.glue = glue
        self.failing = False
        self.failing_types: set[str] = set()
        self.queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="loopback-dns", daemon=True)

    def __enter__(self) -> LoopbackDns:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                query = dns.message.from_wire(data)
            except Exception:  # not a DNS message: ignored, as a server would
                continue
            self.queries += 1
            self._sock.sendto(self._answer(query).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        if self.failing or dns.rdatatype.to_text(question.rdtype) in self.failing_types:
            response.set_rcode(dns.rcode.SERVFAIL)
            return response
        name = question.name.to_text()
        if name not in self.a and name not in self.aaaa and name not in self.srv:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response
        if question.rdtype == dns.rdatatype.A and self.a.get(name):
            response.answer.append(dns.rrset.from_text_list(name, 0, "IN", "A", self.a[name]))
        elif question.rdtype == dns.rdatatype.AAAA and self.aaaa.get(name):
            response.answer.append(dns.rrset.from_text_list(name, 0, "IN", "AAAA", self.aaaa[name]))
        elif question.rdtype == dns.rdatatype.SRV and self.srv.get(name):
            records = [f"0 50 {port} {target}" for target, port in self.srv[name]]
            response.answer.append(dns.rrset.from_text_list(name, 0, "IN", "SRV", records))
            if self.glue:
                for target in dict.fromkeys(t for t, _ in self.srv[name]):
                    if self.a.get(target):
                        response.additional.append(dns.rrset.from_text_list(target, 0, "IN", "A", self.a[target]))
        return response
