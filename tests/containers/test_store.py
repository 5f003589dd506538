import grp
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from harbor_hpc.containers.store import (
    checked_sif,
    ensure_sif,
    failure_hint,
    is_ready,
    sif_file,
    sif_path_for,
    verify,
)
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.runtimes.apptainer import (
    SQUASHFS_ARGS,
    SQUASHFS_COMPRESSION,
    find_apptainer,
    run_flags,
    sif_compression,
    zstd_here,
)
from tests.support.images import Recorder, TinyImage, damage, squashfs_compression
from tests.support.users import lab_group, other_user_command

DIGEST = "sha256:" + "ab" * 32
PRETEND_SHA256 = "sha256:" + hashlib.sha256(b"pretend image").hexdigest()

# Run in separate processes: one converter each, as separate shells or nodes would be.
CONVERTER = """\
import sys
from pathlib import Path
from harbor_hpc.containers.store import ensure_sif
force = sys.argv[3:] == ["--force"]
print(ensure_sif(sys.argv[1], Path(sys.argv[2]), nohttps=True, force=force), flush=True)
"""


def start_converter(
    source: str, store: Path, recorder: Recorder, **delays: str
) -> subprocess.Popen[str]:
    """`ensure_sif` in a process of its own (and session, to kill it with its children)."""
    return subprocess.Popen(
        [sys.executable, "-c", CONVERTER, source, str(store)],
        env={**os.environ, "HARBOR_HPC_APPTAINER": str(recorder.binary), **delays},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finished_looking(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir() if p.name.endswith(".sif"))


def debris(store: Path) -> list[str]:
    leftovers = [p.name for p in store.iterdir() if p.name.endswith(".partial")]
    work = store / ".tmp"
    return leftovers + ([p.name for p in work.iterdir()] if work.exists() else [])


# --- naming and defaults: no Apptainer, no network -------------------------------------------


def test_digest_reference_is_named_by_digest_without_asking_anyone(tmp_path: Path) -> None:
    path = sif_path_for(f"docker://nowhere.invalid/ns/name@{DIGEST}", tmp_path)
    assert path == tmp_path / f"sha256-{'ab' * 32}.sif"


def test_a_sif_path_is_returned_as_is(tmp_path: Path) -> None:
    sif = tmp_path / "mine.sif"
    sif.write_bytes(b"x")
    assert ensure_sif(str(sif), tmp_path / "store") == sif
    assert sif_path_for(str(sif), tmp_path / "store") == sif
    with pytest.raises(InputError, match=r"missing\.sif: no such \.sif file"):
        ensure_sif(str(tmp_path / "missing.sif"), tmp_path / "store")


def test_images_are_compressed_as_this_mksquashfs_can(monkeypatch: pytest.MonkeyPatch) -> None:
    sif_compression.cache_clear()
    zstd_here.cache_clear()
    try:
        if shutil.which("mksquashfs"):
            assert sif_compression().options == ("--mksquashfs-args", " ".join(SQUASHFS_ARGS))
        sif_compression.cache_clear()
        zstd_here.cache_clear()
        monkeypatch.setenv("PATH", "/nonexistent")
        assert sif_compression().options == ()  # mksquashfs's default, which Apptainer then finds
    finally:
        sif_compression.cache_clear()
        zstd_here.cache_clear()


def test_unknown_source_scheme_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="unsupported image source"):
        ensure_sif("oras://reg.io/x:1", tmp_path)


def _docker_save_archive(path: Path, config_hex: str) -> None:
    manifest = json.dumps([{"Config": f"blobs/sha256/{config_hex}", "Layers": []}]).encode()
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))


def test_docker_archive_is_named_by_its_image_id(tmp_path: Path) -> None:
    archive = tmp_path / "image.tar"
    _docker_save_archive(archive, "cd" * 32)
    assert sif_path_for(f"docker-archive://{archive}", tmp_path).name == f"sha256-{'cd' * 32}.sif"
    with pytest.raises(InputError, match="no such file"):
        sif_path_for(f"docker-archive://{tmp_path / 'gone.tar'}", tmp_path)


def test_checked_image_is_used_without_running_apptainer(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker written after the check is what makes later runs cheap; a changed file is
    not trusted (here: re-checked with an Apptainer that fails, so it is converted again)."""
    monkeypatch.setenv("HARBOR_HPC_APPTAINER", str(recorder.binary))
    monkeypatch.setenv("PULL_DELAY_BEFORE", "0")
    find_apptainer.cache_clear()
    source = f"nowhere.invalid/ns/name@{DIGEST}"
    sif = sif_path_for(source, tmp_path)
    sif.write_bytes(b"pretend image")
    stat_ = sif.stat()
    (tmp_path / f".{sif.stem}.ok").write_text(
        json.dumps({"size": stat_.st_size, "mtime_ns": stat_.st_mtime_ns, "sha256": PRETEND_SHA256})
    )
    try:
        assert is_ready(sif)
        assert ensure_sif(source, tmp_path) == sif
        assert recorder.calls() == []
        sif.write_bytes(b"changed behind our back")
        assert not is_ready(sif)
        with pytest.raises(HarborHpcError):
            ensure_sif(source, tmp_path)  # nowhere.invalid cannot be pulled
        assert "build" in recorder.calls()
        assert debris(tmp_path) == []
    finally:
        find_apptainer.cache_clear()


# --- the real Apptainer and registries ----------------------------------------------------------


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.apptainer_only
def test_conversion_from_open_registry_with_nohttps(tiny_image: TinyImage, tiny_sif: Path) -> None:
    digest = tiny_image.open_ref.rsplit("@", 1)[1]
    assert tiny_sif.name == digest.replace(":", "-") + ".sif"
    assert is_ready(tiny_sif)
    assert run_flags(tiny_sif) is not None  # it runs: `exec ... /bin/sh -c true`
    assert squashfs_compression(tiny_sif) == (
        SQUASHFS_COMPRESSION if sif_compression().options else "gzip"
    )
    assert debris(tiny_sif.parent) == []
    marker = json.loads((tiny_sif.parent / f".{tiny_sif.stem}.ok").read_text())
    assert marker["source"] == tiny_image.open_ref


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
def test_a_loopback_registry_is_plain_http_without_being_told_as_for_docker(
    tiny_image: TinyImage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("APPTAINER_NOHTTPS", raising=False)
    sif = ensure_sif(tiny_image.open_ref, tmp_path, nohttps=False)
    assert is_ready(sif) and debris(tmp_path) == []


def test_a_plain_http_registry_elsewhere_is_named_with_the_flag_that_reaches_it() -> None:
    # Apptainer's words when it spoke HTTPS to a registry that answers plain HTTP.
    said = (
        'FATAL: While making image from oci registry: error fetching image: Get "https://'
        'registry.lab:5000/v2/": http: server gave HTTP response to HTTPS client'
    )
    assert "--nohttps" in failure_hint(said, use_http=False)


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.apptainer_only
def test_password_registry_needs_and_uses_apptainer_credentials(
    tiny_image: TinyImage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("APPTAINER_DOCKER_USERNAME", raising=False)
    monkeypatch.delenv("APPTAINER_DOCKER_PASSWORD", raising=False)
    with pytest.raises(HarborHpcError) as failure:
        ensure_sif(tiny_image.auth_ref, tmp_path, nohttps=True)
    assert "APPTAINER_DOCKER_USERNAME" in (failure.value.hint or "")
    assert finished_looking(tmp_path) == []

    monkeypatch.setenv("APPTAINER_DOCKER_USERNAME", tiny_image.user)
    monkeypatch.setenv("APPTAINER_DOCKER_PASSWORD", tiny_image.password)
    sif = ensure_sif(tiny_image.auth_ref, tmp_path, nohttps=True)
    assert is_ready(sif)
    # A tag reference is resolved to the same digest (with the same credentials): same file.
    tagged = tiny_image.auth_ref.rsplit("/", 1)[0] + "/tiny:" + tiny_image.tag.rsplit(":", 1)[1]
    assert sif_path_for(tagged, tmp_path, nohttps=True) == sif


@pytest.mark.apptainer
@pytest.mark.registry  # the shared test image is pushed to both registries
@pytest.mark.docker
def test_docker_daemon_and_archive_sources(tiny_image: TinyImage, tmp_path: Path) -> None:
    from_daemon = ensure_sif(f"docker-daemon://{tiny_image.tag}", tmp_path / "daemon")
    assert from_daemon.name == tiny_image.image_id.replace(":", "-") + ".sif"
    assert is_ready(from_daemon)

    archive = tmp_path / "tiny.tar"
    subprocess.run(["docker", "save", "-o", str(archive), tiny_image.tag], check=True)
    from_archive = ensure_sif(f"docker-archive://{archive}", tmp_path / "archive")
    assert from_archive.name == from_daemon.name  # `docker save` keeps the image ID
    assert is_ready(from_archive)


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.apptainer_only
def test_concurrent_converters_make_one_good_sif(
    tiny_image: TinyImage, tmp_path: Path, recorder: Recorder
) -> None:
    store = tmp_path / "store"
    # The build is slowed so that all three surely overlap.
    converters = [
        start_converter(tiny_image.open_ref, store, recorder, PULL_DELAY_BEFORE="2")
        for _ in range(3)
    ]
    outputs = [converter.communicate(timeout=120) for converter in converters]
    assert [c.returncode for c in converters] == [0, 0, 0], outputs
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    sif = Path(paths.pop())
    assert recorder.calls().count("build") == 1
    assert finished_looking(store) == [sif.name]
    assert debris(store) == []
    assert is_ready(sif) and run_flags(sif) is not None


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.apptainer_only
def test_killed_converter_leaves_nothing_that_looks_finished(
    tiny_image: TinyImage, tmp_path: Path, recorder: Recorder
) -> None:
    store = tmp_path / "store"
    # The build finishes, then the converter is killed before it checks and renames the image:
    # the worst moment, a complete-looking file on disk.
    converter = start_converter(tiny_image.open_ref, store, recorder, PULL_DELAY_AFTER="60")
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.endswith(".partial") and p.stat().st_size for p in _files(store)):
            assert time.monotonic() < deadline, "the conversion never wrote its temporary file"
            assert converter.poll() is None, "the converter ended early"
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        os.killpg(converter.pid, signal.SIGKILL)
        converter.wait()
    assert finished_looking(store) == []
    assert debris(store) != []

    # The dead converter's lock went with it: a new one must not wait for it (a hang would
    # time out here).
    again = subprocess.run(
        [sys.executable, "-c", CONVERTER, tiny_image.open_ref, str(store)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    sif = Path(again.stdout.strip())
    assert is_ready(sif)
    assert finished_looking(store) == [sif.name]
    assert debris(store) == []


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.apptainer_only
def test_a_damaged_sif_is_converted_again_before_it_is_used(
    tiny_image: TinyImage, tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARBOR_HPC_APPTAINER", str(recorder.binary))
    find_apptainer.cache_clear()
    store = tmp_path / "store"
    try:
        sif = ensure_sif(tiny_image.open_ref, store, nohttps=True)
        assert recorder.calls().count("build") == 1

        damage(sif)
        assert is_ready(sif)  # size and mtime as recorded
        assert not verify(sif)  # what `convert --verify` asks: the content is not
        assert ensure_sif(tiny_image.open_ref, store, nohttps=True) == sif
        assert recorder.calls().count("build") == 2
        assert verify(sif)

        # Damaged again, then used by path (as `rewrite --sif` writes it) on a node that never
        # used it: hashed before its first use there, and made again from its recorded source.
        damage(sif)
        other_node = tmp_path / "other-node-tmp"
        other_node.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(other_node))
        assert checked_sif(sif, nohttps=True) == sif
        assert recorder.calls().count("build") == 3
        assert checked_sif(sif, nohttps=True) == sif  # now verified on this node: not hashed
        assert recorder.calls().count("build") == 3 and verify(sif)

        own = tmp_path / "own.sif"  # a .sif the user made: no record, used as it is
        own.write_bytes(b"not from the store")
        assert checked_sif(own) == own
    finally:
        find_apptainer.cache_clear()


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.other_user
@pytest.mark.lab_group
def test_a_lab_shares_one_store_whatever_each_member_s_umask(
    tiny_image: TinyImage, shared_dir: Path
) -> None:
    group = grp.getgrnam(lab_group() or "")
    store = shared_dir / f"lab-store-{uuid.uuid4().hex[:8]}"
    store.mkdir()
    os.chown(store, -1, group.gr_gid)
    store.chmod(0o2775)  # what docs/convert.md asks a lab to make
    private = ["sh", "-c", 'umask 077 && exec "$@"', "sh", sys.executable, "-c", CONVERTER]

    def convert(argv: list[str]) -> Path:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        return Path(done.stdout.strip().splitlines()[-1])

    mine = convert([*private, tiny_image.open_ref, str(store)])
    # The other member converts it again over the tester's lock, marker and .sif...
    theirs = convert(other_user_command([*private, tiny_image.open_ref, str(store), "--force"]))
    assert theirs == mine
    assert mine.stat().st_uid != os.geteuid()
    # ...and the tester uses what they made, trusting it after hashing it once.
    made_by_them = mine.stat().st_ino
    assert convert([*private, tiny_image.open_ref, str(store)]) == mine
    assert mine.stat().st_ino == made_by_them

    made = [store / ".tmp", mine, store / f".{mine.stem}.ok", store / f".{mine.stem}.lock"]
    for path in made:
        mode = path.stat().st_mode
        assert path.stat().st_gid == group.gr_gid, path
        assert mode & stat.S_IRGRP, f"{path}: {oct(mode)}"
    assert (store / ".tmp").stat().st_mode & 0o7777 == 0o2775
    assert (store / f".{mine.stem}.lock").stat().st_mode & stat.S_IWGRP
    assert [p.name for p in store.iterdir() if p.name.endswith(".partial")] == []


def _files(folder: Path) -> list[Path]:
    return list(folder.iterdir()) if folder.exists() else []


def test_sif_file_names_a_task_s_own_sif_or_nothing_for_a_reference(tmp_path: Path) -> None:
    environment = tmp_path / "environment"
    environment.mkdir()
    (environment / "own.sif").write_bytes(b"")
    assert sif_file("own.sif", environment) == environment / "own.sif"
    assert sif_file("/abs/x.sif", environment) == Path("/abs/x.sif")
    assert sif_file("elsewhere.sif", environment) == Path("elsewhere.sif")
    assert sif_file("localhost:5000/ns/env@sha256:" + "0" * 64, environment) is None
    assert sif_file("docker-archive://img.sif", environment) is None
