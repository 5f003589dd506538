"""harbor-hpc's egress proxy: a task's network allowlist, enforced in its container's network.

The host (harbor_hpc/containers/egress.py) starts it with nsenter in the container's user and
network namespaces, where nftables sends it every TCP connection the task opens to the outside
(what Harbor's Docker environment does with gost). For each one it takes where the task was
going (SO_ORIGINAL_DST) and the name it asked for (TLS SNI, else an HTTP Host header, read within
SNIFF_SEC), and connects on its behalf only when the allowlist allows the address, or the name:
it then connects to that name as resolved now (the task's hosts as the host wrote them, then the
container's DNS), so a forged name reaches only the host it names. Its own sockets carry MARK,
which the rules let out. Only the standard library: it runs as `python3 -I -S`.

Stdin/stdout: it prints `ready PORT`; each line `allow ENTRY...` replaces the allowlist and is
answered `ok`. It ends at the end of stdin (its host ended). Refusals go to stderr, one line each.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import random
import re
import socket
import struct
import sys

SO_ORIGINAL_DST = 80
SNIFF_SEC = 5.0
DNS_TIMEOUT_SEC = 3.0
CONNECT_TIMEOUT_SEC = 30.0
PEEK_LIMIT = 16384
_HTTP_REQUEST = re.compile(rb"^[A-Z]+ \S+ HTTP/1\.[01]\r\n")
_HTTP_METHOD = re.compile(rb"^[A-Z]{1,16}( |$)")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Allowlist:
    def __init__(self, entries: list[str]) -> None:
        self.names: set[str] = set()
        self.suffixes: list[str] = []
        self.networks: list[Network] = []
        for entry in entries:
            entry = entry.strip().lower().rstrip(".")
            if entry.startswith("*."):
                self.suffixes.append(entry[1:])  # "*.example.com" -> ".example.com"
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.add(entry)

    def allows_address(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        return any(ip.version == net.version and ip in net for net in self.networks)

    def allows_name(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        return name in self.names or any(name.endswith(suffix) for suffix in self.suffixes)


def original_destination(sock: socket.socket) -> tuple[str, int]:
    if sock.family == socket.AF_INET6:
        raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), struct.unpack("!H", raw[2:4])[0]
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    return socket.inet_ntop(socket.AF_INET, raw[4:8]), struct.unpack("!H", raw[2:4])[0]


def tls_server_name(data: bytes) -> str | None:
    """The SNI of a TLS ClientHello (None if `data` is not one, or names no server)."""
    try:
        if data[0] != 0x16 or data[5] != 0x01:
            return None
        at = 9 + 2 + 32  # record header, handshake header, version, random
        at += 1 + data[at]  # session id
        at += 2 + struct.unpack("!H", data[at : at + 2])[0]  # cipher suites
        at += 1 + data[at]  # compression methods
        end = at + 2 + struct.unpack("!H", data[at : at + 2])[0]
        at += 2
        while at + 4 <= end:
            kind, length = struct.unpack("!HH", data[at : at + 4])
            at += 4
            if kind == 0:  # server_name: list length, type 0 (host_name), name length, name
                name_length = struct.unpack("!H", data[at + 3 : at + 5])[0]
                return data[at + 5 : at + 5 + name_length].decode("ascii")
            at += length
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


def http_host(data: bytes) -> str | None:
    """The host of an HTTP/1 request's Host header (None if `data` is not such a request)."""
    if not _HTTP_REQUEST.match(data):
        return None
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"host":
            host = value.strip().decode("ascii", errors="replace")
            if host.startswith("["):
                return host[1:].split("]", 1)[0]
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return None


def sniffed_name(data: bytes) -> str | None:
    return tls_server_name(data) or http_host(data)


def complete(data: bytes) -> bool:
    """Whether `data` holds all of the first message a name can be read from (or is none)."""
    if data[:1] == b"\x16":  # a TLS record: complete at its length
        return len(data) >= 5 and len(data) >= 5 + struct.unpack("!H", data[3:5])[0]
    if _HTTP_METHOD.match(data):  # an HTTP request: complete at the end of its headers
        return b"\r\n\r\n" in data
    return True


class Resolver:
    """Names as the container resolves them, asked anew for each connection: the hosts the
    host wrote for it (not its /etc/hosts, which the task may change), then its DNS server."""

    def __init__(self, nameserver: str, hosts: dict[str, list[str]], port: int = 53) -> None:
        self.nameserver = nameserver
        self.hosts = hosts
        self.port = port

    async def addresses(self, name: str) -> list[str]:
        if name in self.hosts:
            return self.hosts[name]
        found: list[str] = []
        for qtype in (1, 28):  # A, then AAAA
            found += await self._query(name, qtype)
        return found

    async def _query(self, name: str, qtype: int) -> list[str]:
        ident = random.randrange(1 << 16)
        labels = name.encode("idna").split(b".")
        question = b"".join(bytes([len(label)]) + label for label in labels if label) + b"\0"
        packet = struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question
        packet += struct.pack("!HH", qtype, 1)
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            await loop.sock_connect(sock, (self.nameserver, self.port))
            for _ in range(2):
                await loop.sock_sendall(sock, packet)
                try:
                    while True:
                        answer = await asyncio.wait_for(loop.sock_recv(sock, 4096), DNS_TIMEOUT_SEC)
                        if answer[:2] == packet[:2]:
                            return parse_answer(answer)
                except TimeoutError:
                    continue
        return []


def _skip_name(data: bytes, at: int) -> int:
    while True:
        length = data[at]
        if length == 0:
            return at + 1
        if length & 0xC0 == 0xC0:
            return at + 2
        at += 1 + length


def parse_answer(data: bytes) -> list[str]:
    """The A and AAAA records of a DNS answer, in its order."""
    questions, answers = struct.unpack("!HH", data[4:8])
    at = 12
    for _ in range(questions):
        at = _skip_name(data, at) + 4
    found = []
    for _ in range(answers):
        at = _skip_name(data, at)
        kind, _class, _ttl, length = struct.unpack("!HHIH", data[at : at + 10])
        at += 10
        if kind == 1 and length == 4:
            found.append(socket.inet_ntop(socket.AF_INET, data[at : at + 4]))
        elif kind == 28 and length == 16:
            found.append(socket.inet_ntop(socket.AF_INET6, data[at : at + 16]))
        at += length
    return found


class Proxy:
    def __init__(self, resolver: Resolver, mark: int) -> None:
        self.resolver = resolver
        self.mark = mark
        self.allowlist = Allowlist([])

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            address, port = original_destination(writer.get_extra_info("socket"))
            first = b""
            if self.allowlist.allows_address(address):
                target: tuple[str, list[str]] | None = (address, [address])
            else:
                first = await self._peek(reader)
                name = sniffed_name(first)
                if name is not None and self.allowlist.allows_name(name):
                    target = (name, await self.resolver.addresses(name.lower().rstrip(".")))
                else:
                    target = None
                    asked = f" (asked for {name})" if name else ""
                    print(f"refused {address} port {port}{asked}", file=sys.stderr, flush=True)
            if target is not None:
                upstream = await self._connect(target[1], port)
                if upstream is None:
                    print(f"could not reach {target[0]} port {port}", file=sys.stderr, flush=True)
                else:
                    await self._splice(reader, writer, upstream, first)
        except (OSError, TimeoutError, ValueError):
            pass
        finally:
            writer.close()

    async def _peek(self, reader: asyncio.StreamReader) -> bytes:
        data = b""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SNIFF_SEC
        while len(data) < PEEK_LIMIT and not (data and complete(data)):
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                chunk = await asyncio.wait_for(reader.read(PEEK_LIMIT - len(data)), left)
            except TimeoutError:
                break
            if not chunk:
                break
            data += chunk
        return data

    async def _connect(
        self, addresses: list[str], port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        loop = asyncio.get_running_loop()
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, self.mark)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(
                    loop.sock_connect(sock, (address, port)), CONNECT_TIMEOUT_SEC
                )
            except (OSError, TimeoutError):
                sock.close()
                continue
            return await asyncio.open_connection(sock=sock)
        return None

    async def _splice(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        first: bytes,
    ) -> None:
        up_reader, up_writer = upstream

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while chunk := await source.read(1 << 16):
                    sink.write(chunk)
                    await sink.drain()
                if sink.can_write_eof():
                    sink.write_eof()
            except OSError:
                sink.close()

        try:
            up_writer.write(first)
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        finally:
            up_writer.close()


async def serve_control(proxy: Proxy) -> None:
    loop = asyncio.get_running_loop()
    control = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(control), sys.stdin)
    while line := await control.readline():
        words = line.decode().split()
        if words[:1] == ["allow"]:
            proxy.allowlist = Allowlist(words[1:])
            print("ok", flush=True)


async def main() -> None:
    nameserver, mark, hosts_text = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    hosts: dict[str, list[str]] = {}
    for pair in hosts_text.split(","):
        name, _, address = pair.partition("=")
        if name and address:
            hosts.setdefault(name.lower(), []).append(address)
    proxy = Proxy(Resolver(nameserver, hosts), mark)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    # Redirected IPv6 connections arrive at ::1, where the container has IPv6.
    with contextlib.suppress(OSError):
        await asyncio.start_server(proxy.handle, "::1", port)
    print(f"ready {port}", flush=True)
    await serve_control(proxy)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    os._exit(0)
