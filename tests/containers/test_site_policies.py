"""Sites' apptainer.conf policies, through Apptainer's own `--config` (a wrapper named by
HARBOR_HPC_APPTAINER, as a site's module would put its apptainer first): what doctor says of
each, and what a task container gets there, as an ordinary user (CI: the test user).

Each policy is the system's apptainer.conf with one setting changed."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harbor_hpc.containers import holder, probes
from harbor_hpc.containers.errors import ContainerStartFailed
from harbor_hpc.containers.limits import WRITABLE_TMPFS, read_limits
from harbor_hpc.core.probe import Finding, Status
from harbor_hpc.runtimes import apptainer as runtime
from tests.support.environments import make_environment

# apptainer.conf's policies: Apptainer's own (enroot reads none of it).
pytestmark = [pytest.mark.apptainer, pytest.mark.docker, pytest.mark.apptainer_only]

SYSTEM_CONF = Path("/etc/apptainer/apptainer.conf")
Policy = Callable[[str, str], None]


def forget() -> None:
    """What this process learnt of the install: the binary, its flags, its overlays."""
    runtime.find_apptainer.cache_clear()
    runtime.run_flags.cache_clear()
    runtime.apptainer_version.cache_clear()
    runtime._writable_in_memory.clear()
    holder._paths.clear()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Policy]:
    """`site(key, value)`: Apptainer from here on runs with apptainer.conf's `key = value`."""
    if not SYSTEM_CONF.is_file():
        pytest.skip(f"no {SYSTEM_CONF} to start from")
    system = runtime.find_apptainer()

    def policy(key: str, value: str) -> None:
        text = SYSTEM_CONF.read_text()
        line = f"{key} = {value}"
        pattern = re.compile(rf"^#?\s*{re.escape(key)} = .*$", re.MULTILINE)
        text = pattern.sub(line, text, count=1) if pattern.search(text) else f"{text}\n{line}\n"
        conf = tmp_path / "apptainer.conf"
        conf.write_text(text)
        wrapper = tmp_path / "apptainer"
        wrapper.write_text(f'#!/bin/sh\nexec {system} --config {conf} "$@"\n')
        wrapper.chmod(0o755)
        monkeypatch.setenv("HARBOR_HPC_APPTAINER", str(wrapper))
        forget()

    yield policy
    monkeypatch.delenv("HARBOR_HPC_APPTAINER")
    forget()


def container_finding(cache_dir: Path) -> Finding:
    with probes.probe_image(runtime.find_apptainer(), cache_dir) as image:
        return probes.task_container_finding(image)


@pytest.mark.parametrize(
    ("key", "value", "status", "fix"),
    [
        # The node takes roots of our own: tasks run (Apptainer's overlays unused).
        ("enable overlay", "no", Status.WARN, "`enable overlay = yes`"),
        ("allow container dir", "no", Status.WARN, "`allow container dir = yes`"),
        ("allow container sif", "no", Status.MISSING, "`allow container sif = yes`"),
        ("enable fusemount", "no", Status.OK, ""),
        ("sessiondir max size", "16", Status.OK, ""),
    ],
)
def test_doctor_says_what_each_policy_leaves(
    site: Policy, tmp_path: Path, key: str, value: str, status: Status, fix: str
) -> None:
    """No false alarm, no false ok, and the fix names apptainer.conf's key (not subuid ranges
    and user namespaces, which are there)."""
    site(key, value)
    found = container_finding(tmp_path / "cache")
    assert found.status is status, found
    assert fix in (found.fix or ""), found


@pytest.mark.parametrize("roots", [0, 2], ids=["from-sif", "unpacked-roots-asked"])
def test_no_overlay_folders_write_in_memory_and_say_so(
    site: Policy, debian_sif: Path, tmp_path: Path, roots: int
) -> None:
    """`allow container dir = no`: a root of our own (a folder) and an overlay folder are
    sandboxes to Apptainer, so the container gives way to the .sif and writes in memory
    (--writable-tmpfs), and its trial says so."""
    site("allow container dir", "no")

    async def main() -> str:
        env = make_environment(
            debian_sif,
            tmp_path / "env",
            name="site",
            unpacked_roots=roots,
            scratch_dir=str(tmp_path / "s"),
        )
        await env.start(force_build=False)
        try:
            made = await env.exec("echo 42 > /root/answer && id -u && cat /root/answer")
            return made.stdout or ""
        finally:
            await env.stop(delete=True)

    assert asyncio.run(main()) == "0\n42\n"
    limits = read_limits(tmp_path / "env" / "trial")
    assert WRITABLE_TMPFS in limits


def test_overlays_off_leave_roots_of_our_own(
    site: Policy, debian_sif: Path, tmp_path: Path
) -> None:
    """`enable overlay = no` turns Apptainer's overlays off, not ours: a task's root is as
    writable as ever."""
    site("enable overlay", "no")

    async def main() -> str:
        env = make_environment(debian_sif, tmp_path / "env", name="site")
        await env.start(force_build=False)
        try:
            return (await env.exec("echo 42 > /root/answer && cat /root/answer")).stdout or ""
        finally:
            await env.stop(delete=True)

    assert asyncio.run(main()) == "42\n"


def test_extra_bind_paths_stay_out_of_the_container(
    site: Policy, debian_sif: Path, tmp_path: Path
) -> None:
    """A site's `bind path` is the host's, which Docker would not show a task (Harbor's
    default, `--no-mount bind-paths`)."""
    shown = tmp_path / "site-data"
    shown.mkdir()
    site("bind path", str(shown))

    async def main() -> str:
        env = make_environment(debian_sif, tmp_path / "env", name="site")
        await env.start(force_build=False)
        try:
            return (await env.exec(f"ls -d {shown} 2>&1 || echo absent")).stdout or ""
        finally:
            await env.stop(delete=True)

    assert asyncio.run(main()).endswith("absent\n")


def test_limited_container_paths_say_where_images_must_be(
    site: Policy, debian_sif: Path, tmp_path: Path
) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    site("limit container paths", str(allowed))
    env = make_environment(debian_sif, tmp_path / "env", name="site")
    with pytest.raises(ContainerStartFailed, match="limit container paths"):
        asyncio.run(env.start(force_build=False))
