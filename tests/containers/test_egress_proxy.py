"""The egress proxy's reading of what a connection asks for and of DNS answers, on real bytes:
a ClientHello from Python's own TLS, a DNS answer as a resolver sends it (with name
compression), and lookups against a DNS server on loopback. Enforcement end to end is
tests/e2e/test_network_policy.py."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import ssl
import struct
import threading
from types import ModuleType

from harbor_hpc.core.templates import template_path


def proxy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("egress_proxy", template_path("egress_proxy.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def client_hello(name: str) -> bytes:
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_names_are_read_from_tls_and_http() -> None:
    egress = proxy()
    hello = client_hello("api.example.test")
    assert egress.complete(hello) and not egress.complete(hello[:40])
    assert egress.sniffed_name(hello) == "api.example.test"
    request = b"GET /x HTTP/1.1\r\nUser-Agent: t\r\nHost: Example.test:8080\r\n\r\n"
    assert egress.sniffed_name(request) == "Example.test"
    assert not egress.complete(request[:20]) and egress.complete(request)
    assert egress.sniffed_name(b"SSH-2.0-OpenSSH_9.2\r\n") is None
    assert egress.complete(b"SSH-2.0-OpenSSH_9.2\r\n")  # no name will come: nothing to wait for


def test_the_allowlist_matches_as_harbor_describes_it() -> None:
    allowlist = proxy().Allowlist(["Example.test.", "*.wild.test", "10.1.0.0/16", "fd00::1"])
    assert allowlist.allows_name("example.test") and allowlist.allows_name("a.b.wild.test")
    assert not allowlist.allows_name("wild.test") and not allowlist.allows_name("x.example.test")
    assert allowlist.allows_address("10.1.2.3") and allowlist.allows_address("fd00::1")
    assert not allowlist.allows_address("10.2.0.1") and not allowlist.allows_address("fd00::2")


def test_dns_answers_give_their_addresses_in_order() -> None:
    question = b"\x03api\x07example\x04test\x00" + struct.pack("!HH", 1, 1)
    cname = b"\xc0\x0c" + struct.pack("!HHIH", 5, 1, 60, 6) + b"\x03cdn\xc0\x10"
    first = b"\xc0\x2b" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton("192.0.2.7")
    second = b"\xc0\x2b" + struct.pack("!HHIH", 28, 1, 60, 16)
    second += socket.inet_pton(socket.AF_INET6, "2001:db8::7")
    header = struct.pack("!HHHHHH", 7, 0x8180, 1, 3, 0, 0)
    answer = header + question + cname + first + second
    assert proxy().parse_answer(answer) == ["192.0.2.7", "2001:db8::7"]


def test_names_are_resolved_anew_for_each_connection() -> None:
    """Against a DNS server on loopback whose answer changes: each lookup asks it again, and the
    names the host gave (extra_hosts) are never asked for."""
    egress = proxy()
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    answers = iter(["192.0.2.1", "192.0.2.2"])
    asked: list[bytes] = []

    def serve() -> None:
        for _ in range(4):  # A and AAAA, twice
            query, client = server.recvfrom(512)
            asked.append(query[12:-4])
            kind = struct.unpack("!H", query[-4:-2])[0]
            header = query[:2] + struct.pack("!HHHHH", 0x8180, 1, int(kind == 1), 0, 0)
            record = b""
            if kind == 1:
                record = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 0, 4)
                record += socket.inet_aton(next(answers))
            server.sendto(header + query[12:] + record, client)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    resolver = egress.Resolver(
        "127.0.0.1", {"given.test": ["10.0.0.9"]}, port=server.getsockname()[1]
    )

    async def lookups() -> list[list[str]]:
        return [
            await resolver.addresses("api.example.test"),
            await resolver.addresses("api.example.test"),
            await resolver.addresses("given.test"),
        ]

    assert asyncio.run(lookups()) == [["192.0.2.1"], ["192.0.2.2"], ["10.0.0.9"]]
    thread.join(5)
    server.close()
    assert asked == [b"\x03api\x07example\x04test\x00"] * 4
