"""A task cannot tell our environment from Docker, for whoever runs the tests (CI: an ordinary
user, as on a cluster): root in the container, a writable image, its own /tmp, /dev/shm and
HOME, the image's ENV, WORKDIR, USER and ENTRYPOINT, no network when asked, and a watchdog
that sees the whole container.

The image (`fidelity_sif`, tests/support/images.py) is built by Docker from a Dockerfile as a
published task would have it, and turned into a .sif by `apptainer build docker-daemon://`, as
`harbor-hpc convert` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from harbor.models.task.config import NetworkMode, NetworkPolicy

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.errors import (
    ContainerStartFailed,
    MemoryLimitExceededError,
    UnsupportedTask,
)
from harbor_hpc.containers.holder import root_path
from harbor_hpc.containers.limits import ONE_ID, read_limits
from harbor_hpc.containers.network import egress_problem, netns_problem, own_network_problem
from harbor_hpc.containers.probes import (
    container_root_finding,
    missing_subid_ranges,
    network_finding,
    network_policy_finding,
)
from tests.support import environments
from tests.support.cli import cli, cli_json
from tests.support.sample_tasks import FETCH_ANSWER, answer_service

REGISTRY_PORT = 5000  # something listening on the host's loopback (the test registry)


def make_environment(image: Path, folder: Path, **kwargs: Any) -> SingularityEnvironment:
    """The fidelity tests' environment: its task's environment folder empty, beside the trial."""
    return environments.make_environment(
        image, folder, folder / "environment", name="fidelity", **kwargs
    )


def started(
    image: Path, folder: Path, **kwargs: Any
) -> AbstractAsyncContextManager[SingularityEnvironment]:
    return environments.started(image, folder, folder / "environment", name="fidelity", **kwargs)


async def run(environment: SingularityEnvironment, command: str, **kwargs: Any) -> str:
    result = await environment.exec(command, **kwargs)
    assert result.return_code == 0, f"{command}: {result.stdout}{result.stderr}"
    return result.stdout or ""


def connect_command(host: str, port: int) -> str:
    return (
        f'python3 -c \'import socket; socket.create_connection(("{host}", '
        # slirp4netns is a user-space network: on a loaded 2-core node a connection can take
        # seconds. Without a network the attempt fails at once, whatever the timeout.
        f'{port}), timeout=30); print("connected")\' 2>&1 | tail -n 1'
    )


# Binds port 80 (root's, in a network namespace of the container's own) and holds it a while.
BIND_80 = (
    "python3 -c 'import socket, time; s = socket.socket(); "
    's.bind(("0.0.0.0", 80)); s.listen(); print("bound"); time.sleep(2)\''
)


@pytest.fixture(scope="module")
def host_listener() -> Iterator[tuple[str, int]]:
    """A port listening on the node's own (non-loopback) address: what a container with the
    network reaches, as a Docker container reaches its host, and one without cannot."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect(("10.255.255.255", 1))  # no packet: picks the address of the default route
    address = probe.getsockname()[0]
    probe.close()
    server = socket.create_server(("0.0.0.0", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                server.accept()[0].close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield address, server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


@pytest.mark.apptainer
@pytest.mark.docker
def test_the_container_looks_like_docker(fidelity_sif: Path, tmp_path: Path) -> None:
    host_secret = Path(tempfile.gettempdir()) / f"host-only-{uuid.uuid4().hex}"
    host_secret.write_text("host\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    mounts = [{"type": "bind", "source": str(logs), "target": "/logs/agent"}]
    tool = tmp_path / "tool.sh"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)

    async def main() -> None:
        async with started(fidelity_sif, tmp_path, mounts=mounts) as environment:
            assert await run(environment, "id -u; pwd") == "0\n/app\n"
            # Docker's umask and `docker cp`'s modes, whatever the user's umask (077 here).
            assert await run(environment, "umask") == "0022\n"
            await environment.upload_file(tool, "/app/tool.sh")
            assert await run(environment, "stat -c %a /app/tool.sh") == "755\n"
            readable = "su nobody -s /bin/sh -c 'cat /etc/resolv.conf >/dev/null && echo ok'"
            assert await run(environment, readable) == "ok\n"
            # The image's folders, /tmp and HOME are writable, as for Docker's root.
            made = "echo x > /app/new && echo y > /tmp/t && echo z > $HOME/h && echo $HOME"
            assert await run(environment, made) == "/root\n"
            hidden = await run(environment, f"ls {host_secret} 2>&1 || echo absent")
            assert hidden.endswith("absent\n")
            shm = "head -c 1000000 /dev/zero > /dev/shm/x && stat -c %s /dev/shm/x"
            assert await run(environment, shm) == "1000000\n"
            # The image's ENV as Docker sets it; nothing of Apptainer.
            names = (await run(environment, "env")).splitlines()
            env = dict(line.split("=", 1) for line in names if "=" in line)
            assert env["LANG"] == "C.UTF-8" and env["GREETING"] == "hello world"
            leaked = [
                name
                for name in env
                if name.startswith(("APPTAINER", "SINGULARITY"))
                or name in {"PS1", "PROMPT_COMMAND", "LC_CTYPE"}
            ]
            assert leaked == []
            assert "singularity" not in env.get("LD_LIBRARY_PATH", "")
            prompt = await run(environment, "bash -i -c 'echo \"$PS1\"' 2>/dev/null")
            assert "Apptainer" not in prompt
            # The ENTRYPOINT ran before anything else, as root.
            hosts = await run(environment, "tail -n 1 /etc/hosts; ls /tmp/entrypoint-*")
            assert hosts == "10.1.2.3 entry.test\n/tmp/entrypoint-busy-done\n/tmp/entrypoint-ran\n"
            # apt's way of dropping privileges works (a user of the subuid range), and Harbor's
            # log folders are every user's to write, as Docker leaves them.
            other = "su nobody -s /bin/sh -c 'id -u' && stat -c %a /logs/agent"
            assert await run(environment, other) == "65534\n777\n"
            await run(environment, "su nobody -s /bin/sh -c 'echo n > /logs/agent/by-nobody'")
            await run(environment, "echo r > /logs/agent/by-root")
            private = environment._private_dir
            assert private is not None and private.stat().st_mode & 0o077 == 0

    user_umask = os.umask(0o077)  # a cluster login's, stricter than Docker's
    try:
        asyncio.run(main())
    finally:
        os.umask(user_umask)
    host_secret.unlink()
    # What the container wrote into the host's folders belongs to whoever ran it.
    owners = {path.name: path.stat().st_uid for path in logs.iterdir()}
    assert owners == {"by-nobody": os.getuid(), "by-root": os.getuid()}


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_each_container_has_a_network_of_its_own(
    fidelity_sif: Path, tmp_path: Path, host_listener: tuple[str, int]
) -> None:
    """As with Docker: the network reaches out, port 80 is the container's own (two containers
    bind it at once), the node's loopback services are not reachable; and no-network is only
    loopback, reaching nothing. Where the user may make no network namespace (CI's stage of
    that), no-network is refused naming why, and a container shares the node's network, which
    its trial's folder says."""
    interfaces = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort"
    if netns_problem() is not None:
        closed = NetworkPolicy(network_mode=NetworkMode.NO_NETWORK)
        with pytest.raises(UnsupportedTask, match="asks for no network, which takes a network"):
            make_environment(fidelity_sif, tmp_path / "closed", network_policy=closed)

        async def shared() -> str:
            environment = make_environment(fidelity_sif, tmp_path / "one")
            await environment.start(force_build=False)
            try:
                return await run(environment, connect_command(*host_listener))
            finally:
                await environment.stop(delete=True)

        assert asyncio.run(shared()) == "connected\n"
        limits = read_limits(tmp_path / "one" / "trial")
        assert [limit for limit in limits if "shares the node's network" in limit], limits
        return

    async def main() -> dict[str, str]:
        seen = {}
        closed = NetworkPolicy(network_mode=NetworkMode.NO_NETWORK)
        one, two, offline = (
            make_environment(fidelity_sif, tmp_path / "one"),
            make_environment(fidelity_sif, tmp_path / "two"),
            make_environment(fidelity_sif, tmp_path / "closed", network_policy=closed),
        )
        try:
            # All three at once, as a node's trials start: nothing of one may reach another.
            starts = (e.start(force_build=False) for e in (one, two, offline))
            for outcome in await asyncio.gather(*starts, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
            seen["out"] = await run(one, connect_command(*host_listener))
            seen["loopback"] = await run(one, connect_command("127.0.0.1", REGISTRY_PORT))
            both = await asyncio.gather(run(one, BIND_80), run(two, BIND_80))
            seen["bound"] = "".join(both)
            seen["interfaces"] = await run(one, interfaces)
            seen["closed out"] = await run(offline, connect_command(*host_listener))
            seen["closed interfaces"] = await run(offline, interfaces)
            # Names resolve as in Docker, without a network too (Python resolves for itself).
            names = "python3 -c 'import socket; print(socket.gethostbyname(\"localhost\"))'"
            seen["closed names"] = await run(offline, names + "; hostname")
            seen["hostname"] = offline.hostname
        finally:
            await asyncio.gather(*(e.stop(delete=True) for e in (one, two, offline)))
        return seen

    seen = asyncio.run(main())
    assert seen["out"] == "connected\n"
    assert "refused" in seen["loopback"], seen["loopback"]
    assert seen["bound"] == "bound\nbound\n"
    assert seen["interfaces"] == "lo\ntap0\n"
    assert "unreachable" in seen["closed out"], seen["closed out"]
    assert seen["closed interfaces"] == "lo\n"
    assert seen["closed names"] == f"127.0.0.1\n{seen['hostname']}\n"


@pytest.fixture
def path_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str], None]]:
    """`path_without(tool)`: PATH from here on holds every program it held but `tool`, as on
    nodes without it installed (a folder of links to the rest)."""

    def forget() -> None:
        for probe in (netns_problem, own_network_problem, egress_problem):
            probe.cache_clear()

    def hide(tool: str) -> None:
        links = tmp_path / "bin"
        links.mkdir()
        for folder in os.environ["PATH"].split(os.pathsep):
            for program in sorted(Path(folder).glob("*")) if Path(folder).is_dir() else []:
                if program.name != tool and not (links / program.name).exists():
                    (links / program.name).symlink_to(program)
        monkeypatch.setenv("PATH", str(links))
        forget()

    yield hide
    monkeypatch.undo()
    forget()


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_without_slirp4netns_a_container_shares_the_nodes_network_and_says_so(
    fidelity_sif: Path,
    tmp_path: Path,
    host_listener: tuple[str, int],
    path_without: Callable[[str], None],
) -> None:
    path_without("slirp4netns")
    assert "slirp4netns is not on PATH" in network_finding().detail
    closed = NetworkPolicy(network_mode=NetworkMode.NO_NETWORK)

    async def main() -> tuple[str, str]:
        async with started(fidelity_sif, tmp_path / "open") as shared:
            out = await run(shared, connect_command(*host_listener))
        async with started(fidelity_sif, tmp_path / "closed", network_policy=closed) as offline:
            interfaces = await run(offline, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
        return out, interfaces

    assert asyncio.run(main()) == ("connected\n", "lo\n")  # no network needs no slirp4netns
    limits = read_limits(tmp_path / "open" / "trial")
    assert any("slirp4netns is not on PATH" in limit for limit in limits), limits


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_without_nft_an_allowlist_is_refused_naming_why(
    fidelity_sif: Path, tmp_path: Path, path_without: Callable[[str], None]
) -> None:
    path_without("nft")
    assert "nft is not on PATH" in network_policy_finding().detail
    allowlist = NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["example.org"])
    with pytest.raises(UnsupportedTask, match=r"allowlist of hosts.*nft is not on PATH"):
        make_environment(fidelity_sif, tmp_path / "listed", network_policy=allowlist)

    async def main() -> str:
        async with started(fidelity_sif, tmp_path / "open") as own:
            return await run(own, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort")

    assert asyncio.run(main()) == "lo\ntap0\n"  # a network of its own needs no nft


@pytest.mark.apptainer
@pytest.mark.docker
def test_the_watchdog_sees_the_whole_container(fidelity_sif: Path, tmp_path: Path) -> None:
    """A daemon that left the exec's process tree (tmux's server does this) is killed as Docker's
    OOM killer kills it, and the container goes on; /dev/shm and /dev hold Docker's 64 MB each
    at most; files in them are RAM that no process is charged for and no kill frees: past
    memory_mb, the container is killed."""
    daemon = (
        "setsid python3 -c 'import time; b = bytearray(600 << 20); time.sleep(60)' "
        "> /dev/null 2>&1 < /dev/null & sleep 5; pgrep -fc 'bytearray[(]600' || echo none"
    )

    async def main() -> None:
        async with started(fidelity_sif, tmp_path, memory_mb=256) as environment:
            survived = await environment.exec(daemon, timeout_sec=60)
            assert (survived.return_code, survived.stdout) == (0, "0\nnone\n"), survived
            shm = await environment.exec("head -c 600000000 /dev/zero > /dev/shm/big")
            assert "No space left on device" in shm.stderr, shm  # Docker's 64 MB
            dev = await environment.exec("head -c 600000000 /dev/zero > /dev/big")
            assert "No space left on device" in dev.stderr, dev  # Docker's 64 MB too
        async with started(fidelity_sif, tmp_path / "small", memory_mb=96) as environment:
            # Both full (128 MB of memory no kill frees) pass memory_mb: the container ends.
            with pytest.raises(MemoryLimitExceededError, match="memory limit of 96 MB"):
                await environment.exec(
                    "head -c 70000000 /dev/zero > /dev/big; "
                    "head -c 70000000 /dev/zero > /dev/shm/big; sleep 30"
                )

    asyncio.run(main())


@pytest.mark.apptainer
@pytest.mark.docker
def test_the_root_takes_the_path_doctor_names_and_installs_packages(
    fidelity_sif: Path, tmp_path: Path
) -> None:
    """Every CI stage runs this: the container's root is what doctor's `container root` line
    names for the node (this machine, Linux 6.18: the kernel's overlay in a namespace of our
    own, which maps the user's subuid range, or root alone with Apptainer's fakeroot command
    where there is none), and on it directories of the image are renamed and a package is
    installed with dpkg, as under Docker."""
    path = root_path(Path(tempfile.gettempdir()), subids=not missing_subid_ranges())
    assert container_root_finding().detail == f"{path.describe()}; forks and snapshots: yes"
    assert path.own and path.subids == (not missing_subid_ranges()), path
    package = (
        "mkdir -p /tmp/p/DEBIAN /tmp/p/usr/share/hh-pkg"
        " && printf 'Package: hh-pkg\\nVersion: 1\\nArchitecture: all\\nMaintainer: t <t@t>\\n"
        "Description: t\\n' > /tmp/p/DEBIAN/control && echo 42 > /tmp/p/usr/share/hh-pkg/answer"
        " && dpkg-deb --build /tmp/p /tmp/p.deb >/dev/null && dpkg -i /tmp/p.deb >/dev/null"
        " && cat /usr/share/hh-pkg/answer && mv /usr/share/doc /usr/share/doc.old && echo renamed"
    )

    async def main() -> tuple[str, str]:
        async with started(fidelity_sif, tmp_path) as environment:
            root = await run(environment, "awk '$2 == \"/\" {print $3}' /proc/mounts | tail -n 1")
            return root, await run(environment, package)

    root, installed = asyncio.run(main())
    assert root == "overlay\n"
    assert installed == "42\nrenamed\n"


@pytest.mark.apptainer
@pytest.mark.docker
def test_the_writable_image_is_on_disk_and_removed_with_the_trial(
    fidelity_sif: Path, tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch"

    async def main() -> None:
        async with started(fidelity_sif, tmp_path, scratch_dir=scratch) as environment:
            # Twice Apptainer's 64 MB tmpfs overlay; files of another user of the range.
            await run(environment, "head -c 128000000 /dev/urandom > /app/big.bin")
            await run(environment, "su nobody -s /bin/sh -c 'mkdir /tmp/n && touch /tmp/n/f'")
            assert await run(environment, "stat -c %s /app/big.bin") == "128000000\n"
            assert list(scratch.iterdir())

    asyncio.run(main())
    # The trial's folder is gone; the node's unpacked roots stay for the next trials (one
    # start of an image only marks it seen there).
    roots = f"harbor-hpc-roots-{os.getuid()}"
    assert {path.name for path in scratch.iterdir()} <= {roots}
    assert not [path for path in scratch.glob(f"{roots}/*") if path.is_dir()]


@pytest.mark.apptainer
@pytest.mark.docker
def test_a_user_that_looks_like_an_option_never_runs(fidelity_sif: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with started(fidelity_sif, tmp_path) as environment:
            with pytest.raises(ValueError, match="not a user name"):
                await environment.exec("id -u", user="-c id")
            assert await run(environment, "id -un", user="nobody") == "nobody\n"

    asyncio.run(main())


def test_unknown_kwargs_are_refused_with_the_accepted_ones(tmp_path: Path) -> None:
    with pytest.raises(
        ContainerStartFailed,
        match=r"(?s)Unknown option 'fakerot'.*harbor environment schema.*accepted: .*scratch_dir",
    ):
        make_environment(tmp_path / "x.sif", tmp_path, fakerot=True)


def test_compose_features_one_pod_cannot_honour_are_unsupported_not_ignored(
    tmp_path: Path,
) -> None:
    environment = make_environment(tmp_path / "x.sif", tmp_path)
    (tmp_path / "environment" / "docker-compose.yaml").write_text(
        "services:\n  db:\n    image: x\n    network_mode: host\n"
    )
    with pytest.raises(UnsupportedTask, match=r"docker-compose\.yaml: service 'db': network_mode"):
        asyncio.run(environment.start(force_build=False))


# -- the same through `harbor-hpc submit` on Slurm -----------------------------------------

VERIFY = """\
#!/bin/bash
mkdir -p /logs/verifier
if ( {check} ) > /dev/null 2>&1; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


def task_specs(host: str, port: int) -> dict[str, dict[str, Any]]:
    """The tasks, `host:port` being a listener on the node (see `host_listener`)."""
    return {
        # Writes to the image's root-owned WORKDIR, /tmp and HOME; apt-installs a package;
        # reaches out, and binds port 80. The slowest (apt): named to start first.
        "as-root": {
            "solve": "echo 42 > answer.txt && echo t > /tmp/t && echo h > ~/h\n"
            "apt-get update -qq && apt-get install -y -qq --no-install-recommends jq >/dev/null\n"
            f"{connect_command(host, port)} > /tmp/out\n{BIND_80} > /tmp/bound\n",
            "check": '[ "$(cat /app/answer.txt)" = 42 ] && [ -f /tmp/t ] && [ -f /root/h ]'
            " && command -v jq && grep -q connected /tmp/out && grep -q bound /tmp/bound",
        },
        "no-network": {
            "solve": connect_command(host, port) + " > /app/answer.txt\n",
            "check": "grep -q unreachable /app/answer.txt",
            "toml": "allow_internet = false\n",
        },
        **SELF_CONTAINED,
    }


# The tasks that need no listener.
SELF_CONTAINED: dict[str, dict[str, Any]] = {
    "entrypoint": {
        "solve": "true\n",
        "check": "grep -q entry.test /etc/hosts && [ -f /tmp/entrypoint-ran ]",
    },
    "hog-daemon": {
        "solve": "setsid python3 -c 'import time; b = bytearray(600 << 20); time.sleep(60)' "
        "> /dev/null 2>&1 < /dev/null &\nsleep 30\n",
        "check": "true",
        "toml": "memory_mb = 256\n",
    },
    "hog-shm": {
        "solve": "head -c 600000000 /dev/zero > /dev/shm/big; sleep 30\n",
        "check": "true",
        "toml": "memory_mb = 256\n",
    },
    # The agent and the verifier as the users a published task names ([agent] user, [verifier]
    # user): Harbor's log folders are theirs to write, as Docker leaves them (the oracle's own
    # log, /logs/agent/oracle.txt, is written as the agent's user).
    "agent-user": {
        "solve": "id -un > /logs/agent/who\n",
        "check": '[ "$(cat /logs/agent/who)" = agent ] && [ "$(id -un)" = checker ]'
        " && [ -f /logs/agent/oracle.txt ]",
        "agent": 'user = "agent"\n',
        "verifier": 'user = "checker"\n',
    },
    # A user the solution adds, with a folder it owns and a file it made there, as tasks that
    # set up a service account do (useradd needs /etc/shadow and /etc/gshadow).
    "add-user": {
        "solve": "useradd -m bob && mkdir -p /srv/data && chown bob:bob /srv/data"
        " && su bob -c 'touch /srv/data/mine'\n",
        "check": 'id bob && [ "$(stat -c %U /srv/data)" = bob ]'
        ' && [ "$(stat -c %U /srv/data/mine)" = bob ]',
    },
    # A service beside the task, reached by its name once healthy.
    "compose": {
        "solve": FETCH_ANSWER.replace("/tmp/answer", "/tmp/fetched"),
        "check": '[ "$(cat /tmp/fetched)" = 42 ]',
        "compose": "answers",
    },
    # What one pod cannot give (a fixed address on a network of its own) is named.
    "compose-fixed-address": {
        "solve": "true\n",
        "check": "true",
        "compose": "fixed",
    },
}
EXPECTED = {
    "as-root": ("done", 1.0, None),
    "no-network": ("done", 1.0, None),
    "entrypoint": ("done", 1.0, None),
    "agent-user": ("done", 1.0, None),
    "add-user": ("done", 1.0, None),
    # The daemon is killed as Docker's OOM killer kills it, and the task goes on.
    "hog-daemon": ("done", 1.0, None),
    # Its /dev/shm is Docker's 64 MB: the write fails and the task goes on.
    "hog-shm": ("done", 1.0, None),
    "compose": ("done", 1.0, None),
    "compose-fixed-address": ("failed", None, "unsupported"),
}


def write_task(root: Path, name: str, spec: dict[str, Any], image: Path) -> None:
    task = root / name
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True)
    (task / "task.toml").write_text(
        'version = "1.0"\n[agent]\ntimeout_sec = 120.0\n'
        + spec.get("agent", "")
        + "[verifier]\ntimeout_sec = 60.0\n"
        + spec.get("verifier", "")
        + f'[environment]\ndocker_image = "{image}"\n'
        + spec.get("toml", "")
    )
    (task / "instruction.md").write_text(f"{name}\n")
    (task / "environment" / "Dockerfile").write_text("FROM local/debian:bookworm\n")
    if spec.get("compose") == "answers":
        (task / "environment" / "docker-compose.yaml").write_text(answer_service(str(image)))
    elif spec.get("compose"):
        (task / "environment" / "docker-compose.yaml").write_text(
            "services:\n  db:\n    image: postgres\n    networks:\n"
            "      n: {ipv4_address: 10.0.0.5}\n"
        )
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + spec["solve"])
    (task / "tests" / "test.sh").write_text(VERIFY.format(check=spec["check"]))
    for script in (task / "solution" / "solve.sh", task / "tests" / "test.sh"):
        script.chmod(0o755)


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_published_task_features_through_submit(
    fidelity_sif: Path, tmp_path: Path, host_listener: tuple[str, int]
) -> None:
    tasks = tmp_path / "tasks"
    for name, spec in task_specs(*host_listener).items():
        write_task(tasks, name, spec, fidelity_sif)
    run_dir = tmp_path / "run"
    # One array element running three trials at a time: a second element would wait for the
    # first (each asks for the whole node) and pay Slurm's and the worker's start-up again.
    submitted = cli(
        "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir),
        "--executor", "slurm", "--concurrency", "3", "--tasks-per-job", "8", "--wait",
        check=False,
    )  # fmt: skip
    assert submitted.returncode in (0, 1), submitted.stderr
    statuses = {row["task"]: row for row in cli_json("status", str(run_dir))}
    seen = {name: (row["state"], row["reward"], row["failure"]) for name, row in statuses.items()}
    # Without a subuid range the container has one id: bob's file is root's, and the trial
    # says that it ran so (its reward is not silently Docker's).
    one_id = bool(missing_subid_ranges())
    expected = {**EXPECTED, "add-user": ("done", 0.0 if one_id else 1.0, None)}
    assert (ONE_ID in statuses["add-user"]["limits"]) == one_id
    # Where the user may make no network namespace, no network is refused naming why, and the
    # rest share the node's network, which they say (root's port 80 is then not theirs).
    if netns_problem() is not None:
        expected |= {"no-network": ("failed", None, "unsupported"), "as-root": ("done", 0.0, None)}
        assert "network namespace" in (statuses["no-network"]["message"] or "")
        assert any("node's network" in limit for limit in statuses["as-root"]["limits"])
    wrong = {name: row for name, row in statuses.items() if seen[name] != expected.get(name)}
    assert seen == expected, "\n".join(
        f"{name}: {row}\n{trial_logs(run_dir / 'trials' / str(row['trial']))}"
        for name, row in wrong.items()
    )
    assert "ipv4_address" in (statuses["compose-fixed-address"]["message"] or "")


def trial_logs(trial: Path) -> str:
    """The tail of what the agent and the verifier of `trial` printed, for a failure message."""
    logs = sorted([*trial.glob("agent/*.txt"), *trial.glob("verifier/*.txt")])
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}" for log in logs)


# Published tasks still say `allow_internet = false`, as the no-network one does: Harbor reads
# it as network_mode, with a deprecation warning that is not this test's news.
@pytest.mark.filterwarnings("ignore:The 'allow_internet' field is deprecated")
def test_write_task_is_a_valid_harbor_task(tmp_path: Path) -> None:
    from harbor.models.task.task import Task

    write_task(tmp_path, "no-network", task_specs("192.0.2.1", 1)["no-network"], tmp_path / "x.sif")
    config = Task(tmp_path / "no-network").config
    assert config.environment.network_mode == NetworkMode.NO_NETWORK
