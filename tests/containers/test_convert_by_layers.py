"""`convert` on a node without Apptainer (an enroot cluster): the image's layers, from its
registry, Docker or a `docker save` archive, laid into a root folder as Docker lays them and
squashed into a .sif (images/layers.py, sif.write_sif). Apptainer is hidden from the converter
(HARBOR_HPC_APPTAINER naming no file); it is called here only to show that it runs the .sif as
its own, and enroot starts it as the task's container (CI's enroot stage)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_hpc.containers.sif import raw_config, root_partition
from harbor_hpc.containers.store import ensure_sif, is_ready
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.runtimes.apptainer import apptainer_here, find_apptainer, zstd_here
from tests.support.environments import started

REPO = Path(__file__).resolve().parents[2]

# Owners, a whiteout, an opaque folder, setuid, a hard link, a fifo, a folder through a link;
# the image's ENV, WORKDIR and USER.
LAYERS_DOCKERFILE = """\
FROM {base}
LABEL harbor-hpc-test.nonce={nonce}
RUN useradd -m -u 1234 app && mkdir -p /srv/data && echo hi > /srv/data/owned \\
    && chown -R app:app /srv/data && echo gone > /etc/gone && mkdir -p /opt/opq \\
    && echo old > /opt/opq/old && ln -s /srv/data /srv/link
RUN rm /etc/gone && rm -rf /opt/opq && mkdir /opt/opq && echo new > /opt/opq/new \\
    && ln /srv/data/owned /srv/hard && chmod 4755 /usr/bin/env && mkfifo /srv/fifo \\
    && echo through > /srv/link/through
ENV GREETING=hello
WORKDIR /srv/data
USER app
"""


@pytest.fixture(scope="module")
def layered_image() -> Iterator[tuple[str, str]]:
    """The image above, as Docker's tag and as its digest reference in the test registry."""
    import docker

    client = docker.from_env()
    base = os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    nonce = uuid.uuid4().hex[:12]
    tag = f"harbor-hpc-test/layers:{nonce}"
    dockerfile = LAYERS_DOCKERFILE.format(base=base, nonce=nonce).encode()
    image, _ = client.images.build(fileobj=io.BytesIO(dockerfile), tag=tag, rm=True)
    repository = f"{os.environ['HARBOR_HPC_TEST_REGISTRY']}/harbor-hpc-test/layers"
    image.tag(repository, tag=nonce)
    digest = None
    for line in client.images.push(repository, tag=nonce, stream=True, decode=True):
        assert "error" not in line, line
        digest = line.get("aux", {}).get("Digest", digest)
    assert digest
    yield tag, f"{repository}@{digest}"
    for name in (tag, f"{repository}:{nonce}"):
        client.images.remove(name, noprune=False)
    client.close()


@pytest.fixture
def no_apptainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HARBOR_HPC_APPTAINER", str(tmp_path / "no-apptainer"))
    find_apptainer.cache_clear()  # asked once per process
    zstd_here.cache_clear()
    yield
    monkeypatch.undo()
    find_apptainer.cache_clear()
    zstd_here.cache_clear()


@pytest.fixture(scope="module")
def layered_sif(layered_image: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image above converted from the registry, with Apptainer out of reach."""
    folder = tmp_path_factory.mktemp("layers")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("HARBOR_HPC_APPTAINER", str(folder / "no-apptainer"))
        find_apptainer.cache_clear()
        zstd_here.cache_clear()
        sif = ensure_sif(layered_image[1], folder / "store")
    find_apptainer.cache_clear()
    zstd_here.cache_clear()
    assert list((folder / "store" / ".tmp").iterdir()) == []  # nothing of the work is left
    return sif


def listing(sif: Path) -> dict[str, str]:
    """Each path of the .sif's root partition: its mode and owner, as unsquashfs lists them."""
    partition = root_partition(sif)
    assert partition is not None
    out = subprocess.run(
        ["unsquashfs", "-o", str(partition.offset), "-lln", str(sif)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found = {}
    for line in out.splitlines():
        fields = line.split(" -> ")[0].split()
        if len(fields) >= 6 and fields[5].startswith("squashfs-root"):
            found[fields[5].removeprefix("squashfs-root") or "/"] = f"{fields[0]} {fields[1]}"
    return found


@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.apptainer
def test_without_apptainer_a_registry_image_becomes_a_sif_as_docker_lays_it_out(
    layered_sif: Path,
) -> None:
    sif = layered_sif
    assert is_ready(sif)
    files = listing(sif)
    assert files["/srv/data/owned"] == "-rw-r--r-- 1234/1234"
    assert files["/home/app"].endswith(" 1234/1234")
    assert files["/etc/shadow"] == "-rw-r----- 0/42"
    assert files["/usr/bin/env"].startswith("-rwsr-xr-x")
    assert files["/srv/fifo"].startswith("p")
    assert files["/srv/link"].startswith("l")
    assert "/srv/data/through" in files  # written through the link, as in the container
    assert "/etc/gone" not in files and "/opt/opq/old" not in files
    assert "/opt/opq/new" in files
    assert not [path for path in files if "/.wh." in path]
    config = raw_config(sif)
    assert config is not None
    assert (config["User"], config["WorkingDir"]) == ("app", "/srv/data")
    assert "GREETING=hello" in config["Env"]

    # Apptainer runs it as its own (where a node has one: the file is the same).
    if apptainer_here():
        said = subprocess.run(
            [find_apptainer(), "exec", str(sif), "sh", "-c", "cat /opt/opq/new /srv/hard"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert said.stdout == "new\nhi\n", said.stderr


@pytest.mark.docker
def test_without_apptainer_docker_and_its_archives_give_the_same_files(
    layered_image: tuple[str, str], tmp_path: Path, no_apptainer: None
) -> None:
    tag, _ = layered_image
    from_daemon = ensure_sif(f"docker-daemon://{tag}", tmp_path / "daemon")
    archive = tmp_path / "saved.tar"
    subprocess.run(["docker", "save", "-o", str(archive), tag], check=True, timeout=300)
    from_archive = ensure_sif(f"docker-archive://{archive}", tmp_path / "archive")
    assert listing(from_daemon) == listing(from_archive)
    assert listing(from_daemon)["/srv/data/owned"] == "-rw-r--r-- 1234/1234"
    assert raw_config(from_daemon) == raw_config(from_archive)


def saved_archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    """A `docker save` archive of one image whose one layer holds `members`."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    config = json.dumps({"architecture": "amd64", "config": {"Cmd": ["sh"]}}).encode()
    index = json.dumps([{"Config": "config.json", "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(path, "w") as saved:
        for name, data in (("manifest.json", index), ("config.json", config)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            saved.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("layer.tar")
        info.size = len(layer.getvalue())
        saved.addfile(info, io.BytesIO(layer.getvalue()))
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o755
    return info


@pytest.mark.parametrize(
    ("members", "said"),
    [
        ([(member("../escaped"), b"x")], "member '../escaped' climbs out with '..'"),
        (
            [(member("etc/passwd", tarfile.LNKTYPE, "/no/such/file"), b"")],
            "hard link 'etc/passwd' to '/no/such/file', which the image does not hold",
        ),
    ],
    ids=["dot-dot", "hard-link-to-nothing"],
)
def test_a_layer_that_writes_outside_its_image_is_refused_naming_the_member(
    tmp_path: Path,
    no_apptainer: None,
    members: list[tuple[tarfile.TarInfo, bytes]],
    said: str,
) -> None:
    archive = saved_archive(tmp_path / "bad.tar", members)
    with pytest.raises(HarborHpcError) as refused:
        ensure_sif(f"docker-archive://{archive}", tmp_path / "store")
    assert refused.value.message.endswith(f"layer layer-0: {said}"), refused.value.message
    assert not (tmp_path / "escaped").exists()
    assert [p.name for p in (tmp_path / "store").iterdir() if p.suffix == ".sif"] == []


def test_a_link_out_of_the_image_leads_inside_it_as_in_the_container(
    tmp_path: Path, no_apptainer: None
) -> None:
    """A link to / and a file written through it: the file is the image's, the node's own
    folders untouched (the link's target is the container's root)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    archive = saved_archive(
        tmp_path / "links.tar",
        [
            (member("up", tarfile.SYMTYPE, "/"), b""),
            (member("far", tarfile.SYMTYPE, "../../../../../../../.."), b""),
            (member(f"up{outside}/written"), b"a"),
            (member(f"far{outside}/also"), b"b"),
        ],
    )
    sif = ensure_sif(f"docker-archive://{archive}", tmp_path / "store")
    assert list(outside.iterdir()) == []
    files = listing(sif)
    assert f"{outside}/written" in files and f"{outside}/also" in files


@pytest.mark.enroot
@pytest.mark.registry
@pytest.mark.docker
def test_enroot_starts_the_image_converted_without_apptainer_as_docker_would(
    layered_sif: Path, tmp_path: Path, no_apptainer: None
) -> None:
    """What a task sees: the image's USER, WORKDIR and ENV, its files' owners."""

    async def main() -> str:
        async with started(layered_sif, tmp_path, runtime="enroot") as environment:
            result = await environment.exec(
                "id -un; pwd; echo $GREETING; stat -c %U /srv/data/owned; cat /srv/hard",
                timeout_sec=60,
            )
            assert result.return_code == 0, result
            return result.stdout or ""

    assert asyncio.run(main()) == "app\n/srv/data\nhello\napp\nhi\n"


def path_without_apptainer(folder: Path) -> str:
    """This PATH with Apptainer left out: one folder of links to every other program on it."""
    folder.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        with contextlib.suppress(OSError):
            for entry in os.scandir(directory):
                target = folder / entry.name
                if entry.name not in APPTAINER_PROGRAMS and not target.exists():
                    target.symlink_to(entry.path)
    return str(folder)


APPTAINER_PROGRAMS = {"apptainer", "singularity", "run-singularity"}


@pytest.mark.enroot
@pytest.mark.docker
@pytest.mark.registry
@pytest.mark.slurm
def test_the_quickstart_runs_where_enroot_is_the_only_runtime(tmp_path: Path) -> None:
    """examples/quickstart.sh on a node (and Slurm jobs) with enroot and no Apptainer on PATH:
    Docker builds and pushes, `convert` makes the .sif files from the layers, enroot runs each
    trial to reward 1."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{path_without_apptainer(tmp_path / 'bin')}",
        "HARBOR_HPC_RUNTIME": "auto",
    }
    env.pop("HARBOR_HPC_APPTAINER", None)
    assert shutil.which("apptainer", path=env["PATH"]) is None
    assert shutil.which("enroot", path=env["PATH"]) is not None
    if os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE"):
        env["HARBOR_HPC_BASE_IMAGE"] = os.environ["HARBOR_HPC_TEST_BASE_IMAGE"]
    work = tmp_path / "quickstart"
    done = subprocess.run(
        ["bash", str(REPO / "examples" / "quickstart.sh"), str(work)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rollouts = [json.loads(line) for line in (work / "rollouts.jsonl").read_text().splitlines()]
    assert sorted((r["task"], r["reward"]) for r in rollouts) == [
        ("fix-python", 1.0), ("hello-world", 1.0), ("word-count", 1.0)
    ]  # fmt: skip
    logs = [path.read_text() for path in (work / "run" / "trials").glob("*/trial.log")]
    assert len(logs) == 3 and all("started by enroot" in log for log in logs)


CONVERTER = """\
import sys
from pathlib import Path
from harbor_hpc.containers.store import ensure_sif
ensure_sif(sys.argv[1], Path(sys.argv[2]))
"""


@pytest.mark.registry
@pytest.mark.docker
def test_a_converter_killed_while_it_lays_out_the_layers_leaves_nothing_after_the_next(
    layered_image: tuple[str, str], tmp_path: Path, no_apptainer: None
) -> None:
    """Killed (-9, its namespace's processes too) with the image's files half laid out, some
    of them the image's other users' (the user's subordinate ids): the next conversion of the
    image removes them and makes the .sif."""
    store = tmp_path / "store"
    converter = subprocess.Popen(
        [sys.executable, "-c", CONVERTER, layered_image[1], str(store)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(store.glob(".tmp/*/root/home/app")) and time.monotonic() < deadline:
        assert converter.poll() is None, converter.communicate()
        time.sleep(0.01)
    os.killpg(converter.pid, signal.SIGKILL)
    converter.wait()
    assert list(store.glob(".tmp/*/root/home/app"))  # what it left, owned by a subordinate id
    sif = ensure_sif(layered_image[1], store)
    assert is_ready(sif)
    assert list((store / ".tmp").iterdir()) == []
