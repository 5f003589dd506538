"""Network policies as Harbor 0.26 asks for them, enforced as Harbor's Docker environment does:
an allowlist by name (TLS SNI, HTTP Host) or by address, a policy of its own for each phase,
and names that resolve as in Docker (/etc/hosts with localhost and the container's name).

Destinations are the egress test host (.ci/provision.sh): a network namespace of this machine's
at $HARBOR_HPC_TEST_EGRESS_HOST where every port answers `reached PORT`; the test names point
at it through `extra_hosts` (docker run --add-host).
"""

from __future__ import annotations

import asyncio
import os
import re
import textwrap
from pathlib import Path

import pytest
from harbor.models.task.config import NetworkMode, NetworkPolicy

from harbor_hpc.containers.egress import ruleset
from harbor_hpc.containers.environment import (
    SingularityEnvironment,
    environment_capabilities,
    parse_extra_hosts,
)
from tests.containers.test_environment import reward, run_trial
from tests.support.environments import make_environment

# Connects to HOST:PORT, sends what a client of KIND sends first (a TLS ClientHello naming
# NAME, an HTTP request for NAME, or nothing), prints the first line back or what went wrong.
PROBE = r"""
import socket, ssl, sys
host, port, name, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
hello = b""
if kind == "tls":
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=name)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = outgoing.read()
elif kind == "http":
    hello = f"GET / HTTP/1.1\r\nHost: {name}\r\n\r\n".encode()
try:
    connection = socket.create_connection((host, port), timeout=30)
    connection.sendall(hello)
    print(connection.recv(100).decode().strip() or "closed")
except OSError as error:
    print(type(error).__name__)
"""
NAMES = ("allowed.test", "api.wild.test", "wild.test", "denied.test")


def egress_host() -> str:
    return os.environ.get("HARBOR_HPC_TEST_EGRESS_HOST", "10.79.0.2")


def allowlist(*hosts: str) -> NetworkPolicy:
    return NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=list(hosts))


def test_extra_hosts_are_docker_add_host_entries() -> None:
    assert parse_extra_hosts("a.test:10.0.0.1, b.test:[fd00::1],a.test:10.0.0.2") == {
        "a.test": ["10.0.0.1", "10.0.0.2"],
        "b.test": ["fd00::1"],
    }
    with pytest.raises(ValueError, match=r"'a\.test' is not NAME:ADDRESS"):
        parse_extra_hosts("a.test")


def test_the_ruleset_replaces_the_table_whole() -> None:
    public = ruleset(NetworkPolicy(), None)
    assert public == "table inet harbor_hpc {}\ndelete table inet harbor_hpc\n"
    closed = ruleset(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK), None)
    assert closed.startswith(public) and "redirect" not in closed and "53" not in closed
    assert "redirect to :4242" in ruleset(allowlist("a.test"), 4242)


def egress_environment(
    sif: Path, folder: Path, policy: NetworkPolicy, phases: list[NetworkPolicy]
) -> SingularityEnvironment:
    return make_environment(
        sif, folder, name="egress", network_policy=policy, phase_network_policies=phases,
        extra_hosts=",".join(f"{name}:{egress_host()}" for name in NAMES),
    )  # fmt: skip


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.egress
def test_allowlist_and_a_policy_per_phase(debian_sif: Path, tmp_path: Path) -> None:
    host = egress_host()
    gateway = host.rsplit(".", 1)[0] + ".1"  # the test host's peer: no server there

    async def main() -> dict[str, str]:
        agent = allowlist("allowed.test", "*.wild.test")
        environment = egress_environment(debian_sif, tmp_path, agent, [agent, NetworkPolicy()])
        seen: dict[str, str] = {}
        await environment.start(force_build=False)
        try:
            await environment.exec(f"cat > /tmp/probe.py <<'EOF'\n{PROBE}\nEOF")

            async def probe(label: str, *args: object) -> None:
                command = "python3 /tmp/probe.py " + " ".join(str(arg) for arg in args)
                seen[label] = (await environment.exec(command)).stdout or ""

            await probe("name", host, 80, "allowed.test", "http")
            await probe("wildcard", host, 443, "api.wild.test", "tls")
            await probe("other name", host, 80, "denied.test", "http")
            await probe("wildcard's apex", host, 443, "wild.test", "tls")
            await probe("no name", host, 2222, "-", "raw")
            # A name the allowlist allows, sent to another address, reaches only that name.
            await probe("forged", gateway, 80, "allowed.test", "http")
            await environment.set_network_policy(allowlist(f"{host}/32"))
            await probe("cidr", host, 2222, "-", "raw")
            await environment.set_network_policy(allowlist(host))
            await probe("address", host, 2222, "-", "raw")
            await probe("address, other port's name", host, 80, "denied.test", "http")
            await environment.set_network_policy(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
            await probe("no network", host, 2222, "-", "raw")
            await environment.set_network_policy(NetworkPolicy())
            await probe("public", host, 2222, "-", "raw")
            names = "getent hosts localhost $(hostname) | sort; cat /etc/hostname"
            seen["names"] = (await environment.exec(names)).stdout or ""
            seen["hostname"] = environment.hostname
        finally:
            await environment.stop(delete=True)
        return seen

    seen = asyncio.run(main())
    hostname = seen.pop("hostname")
    loopback = "::1             localhost ip6-localhost ip6-loopback"
    assert seen.pop("names") == f"10.0.2.100      {hostname}\n{loopback}\n{hostname}\n"
    assert seen == {
        "name": "reached 80\n",
        "wildcard": "reached 443\n",
        "other name": "closed\n",
        "wildcard's apex": "closed\n",
        "no name": "closed\n",
        "forged": "reached 80\n",
        "cidr": "reached 2222\n",
        "address": "reached 2222\n",
        "address, other port's name": "reached 80\n",
        "no network": "ConnectionRefusedError\n",
        "public": "reached 2222\n",
    }


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.egress
@pytest.mark.harbor
def test_harbor_switches_the_policy_between_agent_and_verifier(
    debian_sif: Path, tmp_path: Path
) -> None:
    """A task whose agent may reach one name only and whose verifier has the internet: Harbor
    asks the environment to switch, and each phase sees its own policy."""
    host = egress_host()
    task = tmp_path / "phases"
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True)
    (task / "task.toml").write_text(
        textwrap.dedent(f"""\
            version = "1.0"
            [agent]
            timeout_sec = 120.0
            network_mode = "allowlist"
            allowed_hosts = ["allowed.test"]
            [verifier]
            timeout_sec = 60.0
            network_mode = "public"
            [environment]
            docker_image = "{debian_sif}"
            """)
    )
    (task / "instruction.md").write_text("Reach what you may.\n")
    (task / "environment" / "Dockerfile").write_text("FROM scratch\n")
    probe = f"cat > /tmp/probe.py <<'EOF'\n{PROBE}\nEOF\n"
    (task / "solution" / "solve.sh").write_text(
        f"#!/bin/bash\n{probe}"
        f"python3 /tmp/probe.py {host} 80 allowed.test http > /tmp/agent-allowed\n"
        f"python3 /tmp/probe.py {host} 80 denied.test http > /tmp/agent-denied\n"
    )
    (task / "tests" / "test.sh").write_text(
        f"#!/bin/bash\n{probe}"
        f"python3 /tmp/probe.py {host} 80 denied.test http > /tmp/verifier\n"
        'seen="$(cat /tmp/agent-allowed /tmp/agent-denied /tmp/verifier | tr "\\n" " ")"\n'
        'echo "$seen" > /logs/verifier/seen.txt\n'
        'if [ "$seen" = "reached 80 closed reached 80 " ]; then echo 1; else echo 0; fi'
        " > /logs/verifier/reward.txt\n"
    )
    extra = ",".join(f"{name}:{host}" for name in NAMES)
    result = run_trial(task, tmp_path / "trials", f"extra_hosts={extra}")
    seen = next((tmp_path / "trials").glob("phases__*/verifier/seen.txt"), None)
    assert reward(result) == 1.0, (result.get("exception_info"), seen and seen.read_text())


def test_the_docs_table_is_what_the_environment_declares() -> None:
    """Each capability the table of docs/environment.md names is declared where the node can
    enforce it, and those it says are not there yet are not."""
    page = (Path(__file__).parents[2] / "docs" / "environment.md").read_text()
    table = page.split("| a task asks for | Harbor's capability | here |", 1)[1].split("\n\n")[0]
    declared = environment_capabilities(mounted=True, egress=True, netns=True).model_dump()
    named = {}
    for row in table.strip().splitlines()[1:]:
        _, capability, here = (cell.strip() for cell in row.strip("|").split("|"))
        for name in re.findall(r"`(\w+)`", capability):
            named[name] = not here.startswith("not yet")
    assert named, "the docs' table names no capability"
    for name, given in named.items():
        assert declared[name] is given, name
    # Each allowlist entry kind goes with the allowlist.
    kinds = [name for name in declared if name.startswith("network_allowlist_")]
    assert len(kinds) == 6 and all(declared[name] for name in kinds)
