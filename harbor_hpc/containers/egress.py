"""A task's network policy, enforced inside its container's own network namespace.

Harbor 0.26 tasks may ask for no network, the internet, or an allowlist (hostnames, `*.`
wildcards, IPv4/IPv6 addresses and CIDR ranges), and for another policy in the verifier phase
than in the agent's. Harbor's Docker environment enforces that with nftables and a transparent
proxy (gost) beside the container; here the same runs in the container's own network namespace,
entered without root (`nsenter` into its user namespace, where the user is root): an nftables
table `harbor_hpc` sends every outgoing TCP connection to the egress proxy
(templates/egress_proxy.py), which lets through what the allowlist allows by name (TLS SNI or
HTTP Host, resolved anew for each connection) or by address; other traffic is refused, DNS to
the container's own resolver excepted. Changing the policy replaces the table in one nft
transaction, so a phase never runs under the previous phase's rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Mapping

from harbor.models.task.config import NetworkMode, NetworkPolicy

from harbor_hpc.containers.network import NAMESERVER, ended
from harbor_hpc.core.templates import template_path

TABLE = "harbor_hpc"
# The mark of the proxy's own connections, which the rules let out (any value nobody else uses).
MARK = 0x4842
START_TIMEOUT_SEC = 30.0
NFT_TIMEOUT_SEC = 30.0


def ruleset(policy: NetworkPolicy, proxy_port: int | None) -> str:
    """The nft transaction that makes `policy` the container's: the table replaced whole."""
    lines = [f"table inet {TABLE} {{}}", f"delete table inet {TABLE}"]
    if policy.network_mode == NetworkMode.PUBLIC:
        return "\n".join(lines) + "\n"
    dns = [f"ip daddr {NAMESERVER} {proto} dport 53" for proto in ("udp", "tcp")]
    lines.append(f"table inet {TABLE} {{")
    if policy.network_mode == NetworkMode.ALLOWLIST:
        assert proxy_port is not None
        lines += [
            "  chain nat_out {",
            "    type nat hook output priority -100; policy accept;",
            f"    meta mark {MARK} return",
            "    fib daddr type local return",
            *(f"    {rule} return" for rule in dns),
            f"    meta l4proto tcp redirect to :{proxy_port}",
            "  }",
        ]
    lines += [
        "  chain filter_out {",
        "    type filter hook output priority 0; policy accept;",
        "    fib daddr type local accept",
    ]
    if policy.network_mode == NetworkMode.ALLOWLIST:
        lines += [
            f"    meta mark {MARK} accept",
            *(f"    {rule} accept" for rule in dns),
            # As Harbor's Docker egress control: ping is not a way out worth refusing.
            "    ip protocol icmp accept",
            "    ip6 nexthdr icmpv6 accept",
        ]
    lines += ["    reject", "  }", "}"]
    return "\n".join(lines) + "\n"


class Egress:
    """The policy of the network namespace of container process `pid` (a host pid); its proxy
    starts with the first allowlist and ends with `close`, or when this process ends."""

    def __init__(
        self, pid: int, hosts: Mapping[str, list[str]], log: Callable[[str], None]
    ) -> None:
        self._enter = ["nsenter", "-t", str(pid), "-U", "-n", "--preserve-credentials", "--"]
        self._hosts = hosts
        self._log = log
        self._proxy: asyncio.subprocess.Process | None = None
        self._port: int | None = None
        self._stderr: asyncio.Task[None] | None = None

    async def apply(self, policy: NetworkPolicy) -> None:
        """Make `policy` the container's. Raises RuntimeError naming what refused."""
        if policy.network_mode == NetworkMode.ALLOWLIST:
            await self._allow(policy.allowed_hosts)
        nft = await asyncio.create_subprocess_exec(
            *self._enter,
            "nft",
            "-f",
            "-",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(
            nft.communicate(ruleset(policy, self._port).encode()), NFT_TIMEOUT_SEC
        )
        if nft.returncode != 0:
            raise RuntimeError(
                f"nft could not set the container's network policy ({policy.network_mode.value}): "
                f"{stderr.decode(errors='replace').strip()[-500:]}"
            )

    async def _allow(self, entries: list[str]) -> None:
        proxy = self._proxy or await self._start_proxy()
        assert proxy.stdin is not None and proxy.stdout is not None
        proxy.stdin.write(("allow " + " ".join(entries) + "\n").encode())
        await proxy.stdin.drain()
        if await asyncio.wait_for(proxy.stdout.readline(), START_TIMEOUT_SEC) != b"ok\n":
            raise RuntimeError("the egress proxy did not take the allowlist")

    async def _start_proxy(self) -> asyncio.subprocess.Process:
        hosts = ",".join(
            f"{name}={address}" for name, found in self._hosts.items() for address in found
        )
        proxy = await asyncio.create_subprocess_exec(
            *self._enter,
            sys.executable,
            "-I",
            "-S",
            str(template_path("egress_proxy.py")),
            NAMESERVER,
            str(MARK),
            hosts,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._proxy = proxy
        assert proxy.stdout is not None and proxy.stderr is not None
        self._stderr = asyncio.create_task(self._relay(proxy.stderr))
        try:
            ready = await asyncio.wait_for(proxy.stdout.readline(), START_TIMEOUT_SEC)
        except TimeoutError:
            ready = b""
        if not ready.startswith(b"ready "):
            await self.close()
            raise RuntimeError("the egress proxy did not start in the container's network")
        self._port = int(ready.split()[1])
        return proxy

    async def _relay(self, stream: asyncio.StreamReader) -> None:
        async for line in stream:
            self._log(line.decode(errors="replace").rstrip())

    async def close(self) -> None:
        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            if proxy.stdin is not None:
                proxy.stdin.close()  # the proxy ends at the end of its stdin
            await ended(proxy)
        if self._stderr is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._stderr, 2)
            self._stderr = None
