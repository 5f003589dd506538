"""A network of its own for every container, with the internet, for a user who is not root.

Docker gives each container a network namespace: its own loopback and ports, so a task's server
binds port 80, two trials on one node never collide on a port, and no other user of the node can
reach what a container listens on. Apptainer gives that unprivileged only without connectivity
(`--net --network none`). slirp4netns, the user-mode network rootless Podman uses, connects such a
namespace to the outside through the host's sockets: the container gets `tap0` (10.0.2.100, DNS
at 10.0.2.3), and with `--disable-host-loopback` it cannot reach the node's loopback services.

Where slirp4netns or /dev/net/tun is not usable, containers that may use the network share the
node's (what Apptainer does by default) and `harbor-hpc doctor` says what to ask for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Mapping
from functools import cache

from harbor_hpc.core.proc import run

SLIRP4NETNS = "slirp4netns"
TUN = "/dev/net/tun"
# slirp4netns's DNS forwarder inside the container's network, and the container's address.
NAMESERVER = "10.0.2.3"
RESOLV_CONF = f"nameserver {NAMESERVER}\n"
CONTAINER_ADDRESS = "10.0.2.100"
# What Docker writes into every container's /etc/hosts before its own address and name.
HOSTS_HEADER = (
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
    "fe00::0\tip6-localnet\n"
    "ff00::0\tip6-mcastprefix\n"
    "ff02::1\tip6-allnodes\n"
    "ff02::2\tip6-allrouters\n"
)
# How long slirp4netns may take to configure the container's network (it fails by exiting,
# at once): it comes up in milliseconds, but a node starting a hundred containers at once (a
# Ray node's, its processes at Ray's default niceness 15) was seen to take more than ten seconds.
READY_TIMEOUT_SEC = 60.0
ADMIN_HINT = (
    "an admin installs slirp4netns and makes /dev/net/tun readable and writable by users "
    "(mode 666, as most distributions ship it)"
)


def hosts_file(hostname: str, *, own_network: bool, extra: Mapping[str, list[str]]) -> str:
    """/etc/hosts as Docker writes it: loopback names, the container's address and name (its
    own network's; 127.0.1.1 without one, as Debian names a host), then `extra` (--add-host)."""
    address = CONTAINER_ADDRESS if own_network else "127.0.1.1"
    lines = [f"{address}\t{hostname}"]
    lines += [f"{ip}\t{name}" for name, addresses in extra.items() for ip in addresses]
    return HOSTS_HEADER + "\n".join(lines) + "\n"


NETNS_HINT = (
    "an admin allows users network namespaces (sysctl user.max_net_namespaces above 0, and no "
    "security policy refusing them)"
)


@cache
def netns_problem() -> str | None:
    """Why this user cannot make a network namespace (what a container without network, or
    with one of its own, needs), or None; None too where user namespaces themselves fail (a
    setuid install makes its namespaces as root; doctor names a missing user namespace)."""
    unshare = shutil.which("unshare")
    if unshare is None or not run([unshare, "--user", "--map-root-user", "true"]).ok:
        return None
    tried = run([unshare, "--user", "--map-root-user", "--net", "true"])
    if tried.ok:
        return None
    return f"no network namespace for this user ({tried.why()})"


def network_hint() -> str:
    """What an admin does so that containers get a network of their own here."""
    return NETNS_HINT if netns_problem() is not None else ADMIN_HINT


@cache
def own_network_problem() -> str | None:
    """Why containers cannot have a network of their own with the internet here, or None."""
    problem = netns_problem()
    if problem is not None:
        return problem
    if shutil.which(SLIRP4NETNS) is None:
        return f"{SLIRP4NETNS} is not on PATH"
    if not os.access(TUN, os.R_OK | os.W_OK):
        return f"{TUN} is not readable and writable by this user"
    return None


class OwnNetwork:
    """slirp4netns serving the network namespace of one container; ends with `close`, or on its
    own when this process dies (it watches a pipe only we hold)."""

    def __init__(self, process: asyncio.subprocess.Process, exit_fd: int) -> None:
        self._process = process
        self._exit_fd: int | None = exit_fd

    @classmethod
    async def attach(cls, pid: int) -> OwnNetwork:
        """Connect the network namespace of container process `pid` (a host pid) to the outside.

        Raises RuntimeError with slirp4netns's own words when it does not come up.
        """
        ready_read, ready_write = os.pipe()
        exit_read, exit_write = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                SLIRP4NETNS,
                "--configure",
                "--mtu=65520",
                "--disable-host-loopback",
                f"--userns-path=/proc/{pid}/ns/user",
                f"--ready-fd={ready_write}",
                f"--exit-fd={exit_read}",
                str(pid),
                "tap0",
                pass_fds=(ready_write, exit_read),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        finally:
            os.close(ready_write)
            os.close(exit_read)
        network = cls(process, exit_write)
        # slirp4netns writes "1" once tap0 is configured, or exits (end of file).
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bytes] = loop.create_future()

        def on_readable() -> None:
            if not answer.done():
                answer.set_result(os.read(ready_read, 1))

        loop.add_reader(ready_read, on_readable)
        try:
            ready = await asyncio.wait_for(answer, READY_TIMEOUT_SEC)
        except TimeoutError:
            ready = b""
        finally:
            loop.remove_reader(ready_read)
            os.close(ready_read)
        if ready != b"1":
            await network.close()
            stderr = b""
            if process.stderr is not None:
                with contextlib.suppress(TimeoutError):
                    stderr = await asyncio.wait_for(process.stderr.read(), 2)
            raise RuntimeError(
                f"{SLIRP4NETNS} could not connect the container's network: "
                f"{stderr.decode(errors='replace').strip()[-500:] or 'no answer'}"
            )
        return network

    async def close(self) -> None:
        if self._exit_fd is not None:
            os.close(self._exit_fd)  # slirp4netns exits when this pipe ends
            self._exit_fd = None
        await ended(self._process)


async def ended(process: asyncio.subprocess.Process, grace_sec: float = 2) -> None:
    """Wait for a helper told to end (its pipe closed), killing it after `grace_sec`."""
    try:
        await asyncio.wait_for(process.wait(), grace_sec)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


@cache
def egress_problem() -> str | None:
    """Why a task's network policy beyond no network or the internet cannot be enforced here."""
    problem = own_network_problem()
    if problem is not None:
        return f"containers get no network of their own ({problem})"
    for tool in ("nft", "nsenter"):
        if shutil.which(tool) is None:
            return (
                f"{tool} is not on PATH (package {'nftables' if tool == 'nft' else 'util-linux'})"
            )
    return None
