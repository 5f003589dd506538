"""What the tests share: the integration markers, and the fixtures of more than one test folder.

Integration tests are marked by the real part they need: docker, registry, slurm, apptainer,
other_user (another local user that the tests can act as: tests/support/users.py), lab_group
(that user and the tester share a group, as a lab does), small_disk (a filesystem of the tester's
own to fill: tests/support/small_disk.py), ray (Ray, the `ray` extra: tests/ray), egress (the
egress test host), multinode (the three-node Slurm cluster beside the one-node one: `MultiNode`),
trl (TRL's Harbor integration, importable).

Where a part is missing the test skips, so `uv run pytest` passes on a laptop. CI sets
HARBOR_HPC_REQUIRE_INTEGRATION=1, which turns every such skip into a failure. Whether a part
works is asked of `harbor_hpc.steps.doctor`, the same probes users see in `harbor-hpc doctor`.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import psutil
import pytest

from harbor_hpc.containers.network import egress_problem
from harbor_hpc.containers.store import ensure_sif
from harbor_hpc.core.cluster_name import slurm_cluster_name
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.fetch.hub import Hub
from harbor_hpc.ray.cluster import ray_missing
from harbor_hpc.runtimes.apptainer_nodes import load_answers
from harbor_hpc.runtimes.enroot import find_enroot
from harbor_hpc.slurm.cluster import SlurmPlacement
from harbor_hpc.steps import doctor
from tests.support.fake_slurm import BIN as FAKE_SLURM_BIN
from tests.support.fake_slurm import FakeSlurm
from tests.support.fakehub import FakeHub
from tests.support.hub_data import ARCHIVES, REPO_ID, write_task_archive
from tests.support.images import (
    RECORDER,
    SLIM_DOCKERFILE,
    SLIM_TAG,
    TINY_DOCKERFILE,
    Recorder,
    TinyImage,
    build_debian_sif,
    build_fidelity_sif,
    session_builder,
)
from tests.support.small_disk import small_disk_problem
from tests.support.users import lab_group_problem, other_user_problem

PARTS = (
    "docker",
    "registry",
    "slurm",
    "apptainer",
    "other_user",
    "lab_group",
    "small_disk",
    "ray",
    "egress",
    "multinode",
    "limits",
    "trl",
    "enroot",
    "pyxis",
)


@cache
def missing(part: str) -> str | None:
    """Why `part` cannot be used here, or None when it works."""
    if part == "registry":
        return _registry_missing()
    if part == "other_user":
        return other_user_problem()
    if part == "lab_group":
        return lab_group_problem()
    if part == "small_disk":
        return small_disk_problem()
    if part == "ray":
        return ray_missing()
    if part == "egress":
        return _egress_missing()
    if part == "multinode":
        return _multinode_missing()
    if part == "limits":
        return _limits_missing()
    if part == "trl":
        return _trl_missing()
    if part == "enroot":
        return _enroot_missing()
    if part == "pyxis":
        return _enroot_missing() or _pyxis_missing()
    return doctor.part_problem(part)


def _enroot_missing() -> str | None:
    """enroot on PATH (CI's enroot stage puts the one .ci/provision.sh builds there)."""
    if find_enroot() is None:
        return "enroot is not on PATH (.ci/provision.sh builds it: HARBOR_HPC_TEST_ENROOT_BIN)"
    return None


def _pyxis_missing() -> str | None:
    """pyxis loaded into the one-node cluster (.ci/provision.sh, 7d): srun takes its options."""
    try:
        said = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"srun --help: {exc}"
    if "--container-image" not in said.stdout + said.stderr:
        return "srun has no --container-image: pyxis is not in plugstack.conf (.ci/provision.sh)"
    return None


def _trl_missing() -> str | None:
    """TRL's Harbor integration, importable (CI installs trl without its dependencies:
    .ci/provision.sh puts it on the test user's PYTHONPATH)."""
    try:
        import trl.experimental.harbor  # noqa: F401
    except ImportError as exc:
        return f"trl is not importable ({exc}): pip install --no-deps 'trl==1.16.0'"
    return None


def _limits_missing() -> str | None:
    conf = os.environ.get("HARBOR_HPC_TEST_LIMITS_SLURM_CONF", "")
    if not conf or not Path(conf).is_file():
        return "HARBOR_HPC_TEST_LIMITS_SLURM_CONF names no slurm.conf (.ci/provision.sh makes one)"
    try:
        ran = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], env={**os.environ, "SLURM_CONF": conf},
            capture_output=True, text=True, timeout=15,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo of the cluster with low limits failed: {exc}"
    if ran.stdout.split()[:1] not in (["idle"], ["mix"], ["alloc"]):
        return f"the cluster with low limits ({conf}) has no node up: {ran.stdout or ran.stderr}"
    return None


def _multinode_missing() -> str | None:
    conf = os.environ.get("HARBOR_HPC_TEST_MULTI_SLURM_CONF", "")
    shared = os.environ.get("HARBOR_HPC_TEST_SHARED_DIR", "")
    if not conf or not Path(conf).is_file():
        return "HARBOR_HPC_TEST_MULTI_SLURM_CONF names no slurm.conf (.ci/provision.sh makes one)"
    if not shared or not os.access(shared, os.W_OK):
        return f"HARBOR_HPC_TEST_SHARED_DIR={shared!r} is not a folder you can write"
    try:
        ran = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], env={**os.environ, "SLURM_CONF": conf},
            capture_output=True, text=True, timeout=15,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo of the multi-node cluster failed: {exc}"
    states = dict(line.split() for line in ran.stdout.splitlines() if len(line.split()) == 2)
    up = [node for node, state in states.items() if state in ("idle", "mix", "alloc")]
    if len(up) < 3:
        return f"the multi-node cluster ({conf}) has {len(up)} node(s) up: {states or ran.stderr}"
    tool = os.environ.get("HARBOR_HPC_TEST_NODE_TOOL", "")
    listed = subprocess.run(
        ["sudo", "-n", tool, "pids", "n1"], capture_output=True, text=True, timeout=30
    ) if tool else None  # fmt: skip
    if listed is None or listed.returncode != 0:
        why = listed.stderr.strip() if listed else "unset"
        return f"HARBOR_HPC_TEST_NODE_TOOL={tool!r} does not run with sudo -n: {why}"
    return None


def _egress_missing() -> str | None:
    host = os.environ.get("HARBOR_HPC_TEST_EGRESS_HOST")
    if not host:
        return "HARBOR_HPC_TEST_EGRESS_HOST is not set (the test host .ci/provision.sh makes)"
    try:
        socket.create_connection((host, 80), timeout=5).close()
    except OSError as exc:
        return f"the egress test host {host} does not answer on port 80 ({exc})"
    return egress_problem()


def _registry_missing() -> str | None:
    for var in ("HARBOR_HPC_TEST_REGISTRY", "HARBOR_HPC_TEST_AUTH_REGISTRY"):
        host = os.environ.get(var)
        if not host:
            return f"{var} is not set"
        try:
            urllib.request.urlopen(f"http://{host}/v2/", timeout=3)
        except urllib.error.HTTPError:
            pass  # 401 from the password-protected registry: it answers
        except OSError as exc:
            return f"{var}={host} does not answer ({exc})"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Which tests run on one worker, one after another (tests/support/scheduling.py): the
    multi-node cluster's, which crash its nodes and count this user's jobs and processes on
    them; the cluster with low limits', which share the user's limit on queued jobs there; and
    a module's tests that share a fixture of the module's (made once). The rest go to whichever
    worker is free. Longest first: the multi-node chain, the groups, the other
    integration tests, then the unit tests, which fill the gaps at the end."""
    groups, order = {}, {}
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = fixtures.name2fixturedefs.values() if fixtures else ()
        if item.get_closest_marker("multinode"):
            groups[item.nodeid], order[item.nodeid] = "multinode", 0
        elif item.get_closest_marker("limits"):  # they share the user's limit on queued jobs
            groups[item.nodeid], order[item.nodeid] = "limits", 0
        elif any(definition[-1].scope == "module" for definition in defs):
            groups[item.nodeid], order[item.nodeid] = item.nodeid.split("::")[0], 1
        else:
            integration = any(item.get_closest_marker(part) for part in PARTS)
            order[item.nodeid] = 2 if integration else 3
    items.sort(key=lambda item: order[item.nodeid])
    if "PYTEST_XDIST_WORKER" in os.environ:
        from tests.support.scheduling import write_groups

        write_groups(Path(os.environ[RUN_FOLDER]), groups)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from tests.support.scheduling import GroupScheduling

    return GroupScheduling(config, log, folder=Path(os.environ[RUN_FOLDER]))


def pytest_runtest_setup(item: pytest.Item) -> None:
    required = os.environ.get("HARBOR_HPC_REQUIRE_INTEGRATION") == "1"
    for part in PARTS:
        if item.get_closest_marker(part) is None:
            continue
        problem = missing(part)
        if problem is None:
            continue
        if required:
            pytest.fail(f"{part} is required (HARBOR_HPC_REQUIRE_INTEGRATION=1): {problem}")
        pytest.skip(f"{part} missing: {problem}")


# -- images ----------------------------------------------------------------------------


# Tests run side by side in several processes (pytest-xdist's workers, docs/development.md): what
# is slow to make is made once per run, in a folder every worker of the run shares, which the
# first process (the only one without xdist) makes and removes.
RUN_FOLDER = "HARBOR_HPC_TEST_RUN_FOLDER"


_RUN_PREFIX = "harbor-hpc-test-run-"
# In a run's folder: the pid of the process that made it (and removes it when the run ends).
_RUN_OWNER = "pid"


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # xdist's workers inherit it
        _remove_killed_runs()
        folder = Path(tempfile.mkdtemp(prefix=_RUN_PREFIX))
        folder.chmod(0o755)
        (folder / _RUN_OWNER).write_text(f"{os.getpid()}\n")
        os.environ[RUN_FOLDER] = str(folder)
        _ask_the_nodes(folder)


def _ask_the_nodes(store: Path) -> None:
    """The test user's Slurm nodes asked once (`harbor-hpc doctor --nodes`), as a cluster user
    asks them, so that images are made as there: zstd, which the test cluster's node reads.
    Their answers stay in the user's ~/.cache/harbor-hpc/nodes.json; tests of the asking
    itself give it a HOME of their own."""
    if shutil.which("sbatch") is None:
        return
    if any(asked.cluster == slurm_cluster_name() for asked in load_answers()):
        return  # this cluster's nodes answered already (the answers are kept per cluster)
    partition = os.environ.get("HARBOR_HPC_TEST_SLURM_PARTITION")
    try:
        doctor.ask_nodes(SlurmPlacement(partition=partition), store, timeout=120)
    except HarborHpcError as exc:  # no Slurm or Apptainer here: the parts' tests skip or fail
        print(f"conftest: the nodes were not asked ({exc.message}): images are gzip")


def _remove_killed_runs() -> None:
    """The folders of this user's runs that were killed before they could remove theirs (the
    process that made one is gone): each holds images and .sifs, hundreds of MB."""
    for folder in Path(tempfile.gettempdir()).glob(_RUN_PREFIX + "*"):
        try:
            if folder.stat().st_uid != os.geteuid():
                continue
            pid = int((folder / _RUN_OWNER).read_text())
        except (OSError, ValueError):  # not ours, or not yet or no longer a run's folder
            continue
        if not psutil.pid_exists(pid):
            shutil.rmtree(folder, ignore_errors=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and RUN_FOLDER in os.environ:
        shutil.rmtree(os.environ.pop(RUN_FOLDER), ignore_errors=True)


@cache
def _shared_folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="shared-", dir=os.environ[RUN_FOLDER]))
    folder.chmod(0o755)
    return folder


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """A world-readable scratch folder of this process's (pytest's own is private), for what
    the other local user must be able to run too. Removed at the end of the run."""
    return _shared_folder()


# Two images take 10-15 s of CPU each to build (the base image's .sif, and a published task's
# image for tests/e2e/test_docker_fidelity.py), while most tests mostly wait (on timeouts,
# subprocesses, Slurm). Each is built once per run, in the background from the moment a
# worker knows that a selected test needs it, in the order the tests need them, at the lowest
# CPU priority: the tests running meanwhile keep the processors they use. The first worker to
# need one builds it; the others wait for it.
_AHEAD: dict[str, Callable[..., Path]] = {
    "debian_sif": build_debian_sif,
    "fidelity_sif": build_fidelity_sif,
}
_builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="images-ahead")
_built: dict[str, Future[Path]] = {}


def _build_once(name: str, env: dict[str, str], *, background: bool) -> Path:
    """Image `name` of _AHEAD in the run's folder, built by the first process that asks."""
    folder = Path(env[RUN_FOLDER])
    sif = folder / f"{name}.sif"
    with (folder / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not sif.exists():
            partial = _AHEAD[name](folder / f"{name}.partial.sif", env, background=background)
            partial.rename(sif)
    return sif


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    used = (name for item in session.items for name in getattr(item, "fixturenames", ()))
    wanted = dict.fromkeys(name for name in used if name in _AHEAD)
    if wanted and missing("apptainer") is None and missing("docker") is None:
        env = dict(os.environ)  # as it is now: tests change os.environ while the builds run
        session_builder()  # and hide Apptainer from find_apptainer: asked now, once
        for name in wanted:
            _built[name] = _builder.submit(_build_once, name, env, background=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _builder.shutdown(wait=True, cancel_futures=True)


def built_ahead(name: str) -> Path:
    """The image `name` of _AHEAD, built ahead (or now, when the session did not start it), as
    a file of this process's own: a hard link to the run's, so that what runs it is told apart
    from what the other workers run (tests/support/processes.py)."""
    built = (
        _built[name].result()
        if name in _built
        else _build_once(name, dict(os.environ), background=False)
    )
    own = _shared_folder() / f"{name}.sif"
    if not own.exists():
        os.link(built, own)
    return own


@pytest.fixture(scope="session")
def debian_sif() -> Path:
    """The test base image (python3 included) as a .sif, from the local Docker daemon: built
    once per session, readable by every local user."""
    return built_ahead("debian_sif")


@dataclass(frozen=True)
class MultiNode:
    """The three-node Slurm cluster .ci/provision.sh makes beside the one-node one (n1..n3 in
    partition `multi`, each node its own network, hostname and /tmp), and a folder of the
    test's own that every node sees (their /tmp is each node's own, pytest's tmp_path too)."""

    conf: Path
    work: Path
    # Each node's /tmp, as this machine sees it.
    node_tmp: dict[str, Path]

    @property
    def env(self) -> dict[str, str]:
        """This environment with the multi-node cluster as the one Slurm's commands talk to."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def node(self, action: str, node: str) -> str:
        """What happens to `node` (.ci/node, as root): `crash` (every process of it killed),
        `start` (its slurmd again: it comes back), `cut` (its network down), `heal`; or what
        the tool says of it (`pids`)."""
        tool = os.environ["HARBOR_HPC_TEST_NODE_TOOL"]
        done = subprocess.run(
            ["sudo", "-n", tool, action, node], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{action} {node}: {done.stderr}"
        return done.stdout

    def slurm(self, *command: str) -> str:
        """A Slurm command's output, on the multi-node cluster."""
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        return done.stdout

    def node_pids_of_user(self, node: str) -> list[int]:
        """This user's processes on `node`."""
        mine = []
        for pid in self.node("pids", node).split():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}").st_uid == os.getuid():
                    mine.append(int(pid))
        return mine

    def state(self, node: str) -> str:
        """Slurm's state of `node`: idle, alloc, down*, ..."""
        return self.slurm("sinfo", "-h", "-N", "-n", node, "-o", "%t").strip()

    def restore(self) -> None:
        """Every node linked, its slurmd running, and up in Slurm's eyes (a test that failed
        midway leaves the cluster as it found it)."""
        for node in self.node_tmp:
            self.node("heal", node)
            self.node("start", node)
        # A node back from a partition is seen at its next registration: Slurm asks one every
        # 20 pings (a ping a third of SlurmdTimeout: 10 s in .ci/slurm-multi.conf.in).
        deadline = time.monotonic() + 150
        while any(self.state(node).rstrip("*~#") not in _UP for node in self.node_tmp):
            assert time.monotonic() < deadline, f"nodes not back: {self.slurm('sinfo', '-N')}"
            time.sleep(1)


_UP = ("idle", "mix", "alloc", "comp")


def _shared_work(prefix: str) -> Path:
    root = Path(os.environ["HARBOR_HPC_TEST_SHARED_DIR"])
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getuid()}-", dir=root))


@pytest.fixture
def multinode() -> Iterator[MultiNode]:
    work = _shared_work("test")
    nodes_tmp = Path(os.environ.get("HARBOR_HPC_TEST_MULTI_NODE_TMP", "/var/tmp/harbor-hpc-nodes"))
    yield MultiNode(
        Path(os.environ["HARBOR_HPC_TEST_MULTI_SLURM_CONF"]),
        work,
        {node: nodes_tmp / node for node in ("n1", "n2", "n3")},
    )
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def faulty_nodes(multinode: MultiNode) -> Iterator[MultiNode]:
    """The multi-node cluster for a test that crashes or cuts off nodes: every node is back
    (linked, its slurmd running, up) after it, whatever happened."""
    yield multinode
    multinode.restore()


@pytest.fixture(scope="session")
def multinode_sif(debian_sif: Path) -> Iterator[Path]:
    """The test base image's .sif where every node of the multi-node cluster sees it."""
    folder = _shared_work("sif")
    folder.chmod(0o755)
    sif = folder / "debian.sif"
    shutil.copyfile(debian_sif, sif)
    yield sif
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def fidelity_sif() -> Path:
    """A published task's image as a .sif (tests/support/images.py FIDELITY_DOCKERFILE)."""
    return built_ahead("fidelity_sif")


@pytest.fixture(scope="session")
def base_image() -> str:
    """The test base image in the test registry, for Apptainer builds, which cannot see Docker's
    images (pushed by Docker: test setup only)."""
    local = os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    reference = f"{os.environ['HARBOR_HPC_TEST_REGISTRY']}/harbor-hpc-test/base:bookworm"
    for command in (["docker", "tag", local, reference], ["docker", "push", reference]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    return reference


@pytest.fixture(scope="session")
def slim_image() -> str:
    """The test image without python3, less its documentation, locales and perl: 60 MB with
    bash and coreutils, for tests that convert images from the registry (a third of the time
    of the 170 MB base). Kept in Docker under a fixed tag, so that later sessions find it built."""
    import docker

    client = docker.from_env()
    base = os.environ.get("HARBOR_HPC_TEST_NOPY_IMAGE", "local/debian-nopython:bookworm")
    client.images.build(
        fileobj=io.BytesIO(SLIM_DOCKERFILE.format(base=base).encode()), tag=SLIM_TAG, rm=True
    )
    client.close()
    return SLIM_TAG


@pytest.fixture(scope="session")
def tiny_image() -> Iterator[TinyImage]:
    import docker

    client = docker.from_env()
    base = os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    open_registry = os.environ["HARBOR_HPC_TEST_REGISTRY"]
    auth_registry = os.environ["HARBOR_HPC_TEST_AUTH_REGISTRY"]
    user = os.environ["HARBOR_HPC_TEST_AUTH_USER"]
    password = os.environ["HARBOR_HPC_TEST_AUTH_PASSWORD"]
    # A fresh label per session: a new digest, so no earlier run's .sif can stand in.
    nonce = uuid.uuid4().hex[:12]
    dockerfile = TINY_DOCKERFILE.format(base=base, nonce=nonce).encode()
    image, _ = client.images.build(
        fileobj=io.BytesIO(dockerfile), tag=f"harbor-hpc-test/tiny:{nonce}", rm=True
    )
    refs = []
    for registry, auth in (
        (open_registry, None),
        (auth_registry, {"username": user, "password": password}),
    ):
        repository = f"{registry}/harbor-hpc-test/tiny"
        image.tag(repository, tag=nonce)
        digest = None
        # The login goes with this one push only: no Docker config file is read or written.
        for line in client.images.push(
            repository, tag=nonce, auth_config=auth, stream=True, decode=True
        ):
            if "error" in line:
                raise RuntimeError(f"push to {registry} failed: {line['error']}")
            digest = line.get("aux", {}).get("Digest", digest)
        assert digest, f"push to {registry} reported no digest"
        refs.append(f"{repository}@{digest}")
    yield TinyImage(f"harbor-hpc-test/tiny:{nonce}", image.id, refs[0], refs[1], user, password)
    for name in (
        f"harbor-hpc-test/tiny:{nonce}",
        f"{open_registry}/harbor-hpc-test/tiny:{nonce}",
        f"{auth_registry}/harbor-hpc-test/tiny:{nonce}",
    ):
        client.images.remove(name, noprune=False)
    client.close()


@pytest.fixture(scope="session")
def session_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sif-store")


@pytest.fixture(scope="session")
def tiny_sif(tiny_image: TinyImage, session_store: Path) -> Path:
    """The tiny image converted once from the open registry, for tests that only read a .sif."""
    return ensure_sif(tiny_image.open_ref, session_store, nohttps=True)


@pytest.fixture
def recorder(tmp_path: Path) -> Recorder:
    """An `apptainer` that logs its calls; point HARBOR_HPC_APPTAINER at `binary`."""
    log = tmp_path / "apptainer-calls.log"
    binary = tmp_path / "apptainer-recorder"
    real = shutil.which("apptainer") or shutil.which("singularity") or "false"
    binary.write_text(RECORDER.format(log=log, real=real))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return Recorder(binary, log)


# -- Slurm commands that answer what the test says ---------------------------------------


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    """sbatch, squeue, sinfo, scontrol and scancel first on PATH, for this process and the CLI
    it runs: each prints nothing and succeeds until `answer` says otherwise."""
    fake = FakeSlurm(tmp_path / "fake-slurm")
    fake.state.mkdir()
    monkeypatch.setenv("PATH", f"{FAKE_SLURM_BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(fake.state))
    # A cluster of its own for each test: what is asked once per process and cluster (the
    # array size, the cluster's name) is asked of this one, not read from an earlier test's.
    monkeypatch.setenv("SLURM_CONF", str(fake.state / "slurm.conf"))
    return fake


# -- a Hugging Face hub on loopback ------------------------------------------------------


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for path, tasks in ARCHIVES.items():
        write_task_archive(root / path, tasks)
    (root / "README.md").write_text("# terminal tasks\n")
    return root


@pytest.fixture
def fake_hub(dataset: Path) -> Iterator[FakeHub]:
    with FakeHub(dataset, REPO_ID) as hub:
        yield hub


@pytest.fixture
def hf_cache(tmp_path: Path) -> Path:
    return tmp_path / "hf-home" / "hub"


@pytest.fixture
def hub(fake_hub: FakeHub, hf_cache: Path) -> Hub:
    """Where in-process fetches go: huggingface_hub reads HF_ENDPOINT/HF_HOME at import only."""
    return Hub(endpoint=fake_hub.url, cache_dir=hf_cache)
