"""enroot as the runtime (enroot.py), for nodes without Apptainer: CI's enroot stage runs these
with enroot 4.1.2 built from the workspace's vendored sources on PATH, beside the Apptainer
tests it runs again there (HARBOR_HPC_RUNTIME=enroot). The .sif is built with Apptainer by the
fixtures; the environment then runs with Apptainer out of reach (HARBOR_HPC_APPTAINER naming no
file), as on a node that has none."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import psutil
import pytest

from harbor_hpc.containers.probes import findings
from harbor_hpc.core.errors import InputError
from harbor_hpc.core.probe import Status
from harbor_hpc.runtimes import container_runtime
from harbor_hpc.runtimes.apptainer import find_apptainer
from harbor_hpc.runtimes.enroot import find_enroot
from tests.support.cli import cli
from tests.support.environments import started
from tests.support.processes import ENDED_WITHIN_S, container_processes, gone_within

pytestmark = [pytest.mark.enroot, pytest.mark.apptainer, pytest.mark.docker]


def test_auto_takes_enroot_where_there_is_no_apptainer(monkeypatch: pytest.MonkeyPatch) -> None:
    enroot = find_enroot()
    assert enroot is not None
    monkeypatch.delenv("HARBOR_HPC_RUNTIME", raising=False)
    monkeypatch.delenv("HARBOR_HPC_APPTAINER", raising=False)
    monkeypatch.setenv("PATH", str(Path(enroot).parent))
    find_apptainer.cache_clear()  # it is asked once per process
    assert container_runtime("auto").name == "enroot"
    assert container_runtime("apptainer").name == "apptainer"  # forced: its own error says why
    monkeypatch.setenv("HARBOR_HPC_RUNTIME", "docker")
    with pytest.raises(InputError, match="'docker' is none of apptainer, enroot, auto"):
        container_runtime()
    monkeypatch.undo()
    find_apptainer.cache_clear()


def test_a_task_under_enroot_sees_what_it_sees_under_apptainer(
    debian_sif: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Root, the image writable, Docker's /dev and environment, nothing of enroot's own (its
    lock file, its variables), its own name and network, and nothing left after the stop: with
    no Apptainer to call."""
    monkeypatch.setenv("HARBOR_HPC_APPTAINER", str(tmp_path / "no-apptainer"))
    monkeypatch.setenv("SECRET_OF_THE_NODE", "hush")
    find_apptainer.cache_clear()  # it is asked once per process

    async def main() -> dict[str, str]:
        said = {}
        async with started(debian_sif, tmp_path, runtime="enroot") as environment:
            assert environment._main is not None and environment._main.pid is not None
            tree = psutil.Process(environment._main.pid).children(recursive=True)
            assert not [p for p in tree if "apptainer" in " ".join(p.cmdline())]
            for name, command in {
                "id": "id -u; touch /usr/x && echo writable",
                "root": "ls -A /",
                "dev": "ls /dev; df -k /dev | tail -n 1 | awk '{print $2}'",
                "env": "env | sort",
                "name": "hostname; cat /etc/hostname",
                "lo": "cat /sys/class/net/lo/operstate 2>/dev/null || grep -c lo: /proc/net/dev",
                "pid1": "cat /proc/1/cmdline | tr '\\0' ' '",
            }.items():
                result = await environment.exec(command, timeout_sec=30)
                assert result.return_code == 0, (name, result)
                said[name] = result.stdout or ""
        return said

    with caplog.at_level(logging.INFO):
        said = asyncio.run(main())
    assert "started by enroot" in caplog.text
    assert said["id"] == "0\nwritable\n"
    assert ".lock" not in said["root"].split()
    assert {"null", "zero", "urandom", "pts", "shm", "fd"} <= set(said["dev"].split())
    assert said["dev"].split()[-1] == "65536"  # Docker's 64 MB
    env = dict(line.split("=", 1) for line in said["env"].splitlines() if "=" in line)
    assert env["HOME"] == "/root" and env["PATH"].startswith("/usr/local/sbin")
    assert not {"SECRET_OF_THE_NODE", "TERM", "SHELL", "USER"} & set(env)
    assert not [name for name in env if name.startswith("ENROOT")]
    name, file = said["name"].split()
    assert name == file and name != os.uname().nodename
    assert said["pid1"].split()[1:3] == ["-I", "-S"]  # the command server, the container's init
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []
    monkeypatch.undo()
    find_apptainer.cache_clear()


def test_enroot_without_root_in_the_container_is_refused_naming_why(
    debian_sif: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        async with started(debian_sif, tmp_path, runtime="enroot", fakeroot=False):
            pass

    with pytest.raises(Exception, match="fakeroot=false needs Apptainer"):
        asyncio.run(main())


def test_doctor_names_enroot_and_what_its_containers_get(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARBOR_HPC_RUNTIME", "enroot")
    said = {finding.name: finding for finding in findings(Path("/nonexistent"))}
    assert said["runtime"].status is Status.OK and "enroot 4.1.2" in said["runtime"].detail
    assert said["container root"].status is Status.OK
    assert said["gpus"].status is Status.WARN and "Apptainer" in said["gpus"].fix
    assert "binary" not in said  # no Apptainer asked for


def test_doctor_on_an_enroot_node_without_squashfuse_says_no_container_starts(
    tmp_path: Path,
) -> None:
    """A node with enroot, no Apptainer (whose install ships a squashfuse_ll) and no squashfuse:
    no root of our own, so no container starts; doctor says so and what to install."""
    path = tmp_path / "bin"
    path.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        for tool in Path(folder).glob("*") if Path(folder).is_dir() else ():
            if tool.name != "squashfuse_ll" and not (path / tool.name).exists():
                (path / tool.name).symlink_to(tool)
    env = {**os.environ, "PATH": str(path), "HARBOR_HPC_RUNTIME": "enroot"}
    env["HARBOR_HPC_APPTAINER"] = str(tmp_path / "no-apptainer")
    done = cli("doctor", "--json", check=False, env=env)
    root = next(c for c in json.loads(done.stdout) if c["check"] == "container root")
    assert root["status"] == "missing", root
    assert root["detail"] == (
        "Apptainer's own overlay on the .sif (no squashfuse_ll (squashfuse) to mount the .sif "
        "with): enroot starts containers on a root of our own only"
    )
    assert root["fix"] == "install squashfuse (its squashfuse_ll) on the nodes"
    assert done.returncode == 1
