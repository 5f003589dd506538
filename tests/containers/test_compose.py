"""Docker Compose tasks as one pod: the compose files read as Harbor's Docker environment merges
them, then services beside the task's container, each from its own image, reachable by name,
waited for as `depends_on` asks, counted by the watchdog and open to Harbor's per-service
operations; as an ordinary user, on the real Apptainer.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from harbor_hpc.containers.errors import ImageUnavailable, UnsupportedTask
from harbor_hpc.containers.pod import image_healthcheck, service_sif
from harbor_hpc.containers.probes import missing_subid_ranges
from harbor_hpc.containers.sif import ImageConfig
from harbor_hpc.runtimes.apptainer import find_apptainer
from harbor_hpc.tasks.compose import (
    Healthcheck,
    HealthProbe,
    Service,
    UnsupportedCompose,
    Volume,
    load_compose,
)
from tests.containers.test_environment import ENVIRONMENT, HARBOR, reward
from tests.support.cli import cli
from tests.support.environments import make_environment
from tests.support.sample_tasks import answer_service, make_task


def write_compose(folder: Path, text: str, name: str = "docker-compose.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


# -- reading compose files ----------------------------------------------------------------


def test_compose_files_merge_as_docker_compose_merges_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DB_TAG", "16")
    monkeypatch.delenv("UNSET_HERE", raising=False)
    env_dir = tmp_path / "environment"
    (env_dir / "web").mkdir(parents=True)
    (env_dir / "web" / "Dockerfile").write_text("FROM x\n")
    (env_dir / ".env").write_text("PORT=5432\n")
    write_compose(
        env_dir,
        """\
services:
  main:
    depends_on: [db]
    environment: [A=1]
    volumes: [./data:/data:ro]
  db:
    image: registry.test/postgres:${DB_TAG}
    environment: {PORT: "${PORT}", LEVEL: "${UNSET_HERE:-info}", COST: "$$5"}
    command: postgres -p 5432
    healthcheck: {test: "pg_isready", interval: 1m30s, retries: 5}
    volumes: [pgdata:/var/lib/postgresql]
  web:
    build: ./web
    depends_on: {db: {condition: service_healthy}}
    expose: ["80"]
""",
    )
    extra = write_compose(tmp_path, "services:\n  main:\n    environment: {B: '2'}\n", "extra.yaml")
    compose = load_compose(env_dir, [extra])
    assert compose is not None
    assert [service.name for service in compose.services] == ["db", "web"]  # start order
    assert compose.main.environment == {"A": "1", "B": "2"}
    assert compose.main.depends_on == {"db": "service_started"}
    assert compose.main.volumes == [Volume(str(env_dir / "data"), "/data", read_only=True)]
    db, web = compose.services
    assert db.image == "registry.test/postgres:16"
    assert db.environment == {"PORT": "5432", "LEVEL": "info", "COST": "$5"}
    assert db.command == ("postgres", "-p", "5432")
    assert db.healthcheck == Healthcheck(("/bin/sh", "-c", "pg_isready"), 90.0, None, 5, None)
    assert db.volumes == [Volume("pgdata", "/var/lib/postgresql", named=True)]
    assert web.build == (env_dir / "web").resolve() and web.depends_on == {"db": "service_healthy"}
    assert load_compose(tmp_path / "none") is None


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            "services:\n  dns:\n    image: x\n    networks:\n"
            "      net: {ipv4_address: 10.0.0.53}\n",
            "networks.net.ipv4_address",
        ),
        ("services:\n  db:\n    image: x\n    privileged: true\n", "`privileged`"),
        ("services:\n  main:\n    entrypoint: [x]\n", "`entrypoint` (the main service's)"),
        ("services:\n  db:\n    image: x\n    depends_on: [cache]\n", "'cache'"),
        (
            "services:\n  a:\n    image: x\n    depends_on: [b]\n"
            "  b:\n    image: x\n    depends_on: [a]\n",
            "cycle",
        ),
        ("services:\n  db:\n    build: {context: ., args: {A: 1}}\n", "build.args"),
        ("services:\n  db:\n    image: x\n    network_mode: host\n", "network_mode 'host'"),
        ("secrets: {}\n", "top-level `secrets`"),
        ("services: [1\n", "not a readable compose file"),
    ],
)
def test_what_one_pod_cannot_honour_is_named(tmp_path: Path, text: str, named: str) -> None:
    write_compose(tmp_path, text)
    with pytest.raises(UnsupportedCompose, match=r"docker-compose\.yaml") as caught:
        load_compose(tmp_path)
    assert named in str(caught.value)


def test_a_task_asking_for_a_fixed_address_fails_unsupported_naming_it(tmp_path: Path) -> None:
    write_compose(
        tmp_path / "env",
        "services:\n  dns:\n    image: x\n    networks:\n      n: {ipv4_address: 10.0.0.53}\n",
    )
    environment = make_environment(str(tmp_path / "x.sif"), tmp_path, tmp_path / "env")
    with pytest.raises(UnsupportedTask, match=r"task unit: .*ipv4_address"):
        asyncio.run(environment.start(force_build=False))


# -- the pod ------------------------------------------------------------------------------------


PROBE = "import socket; socket.create_connection(('localhost', 5000), 2)"
POD = """\
services:
  main:
    depends_on:
      api: {{condition: service_healthy}}
      init: {{condition: service_completed_successfully}}
    environment: {{API_URL: "http://api:5000"}}
    volumes: [shared:/shared]
  init:
    image: {image}
    command: ["sh", "-c", "echo seeded > /shared/seed"]
    volumes: [shared:/shared]
  api:
    image: {image}
    command: ["sh", "-c", "sleep 1; exec python3 -m http.server 5000"]
    working_dir: /srv
    environment: [GREETING=hi]
    healthcheck:
      test: ["CMD", "python3", "-c", "{probe}"]
      interval: 0.5s
      retries: 60
    volumes: [shared:/shared]
"""


@pytest.mark.apptainer
@pytest.mark.parametrize("roots", [0, 2], ids=["from-sif", "unpacked-roots"])
def test_services_run_beside_the_task_as_docker_compose_runs_them(
    debian_sif: Path, tmp_path: Path, roots: int
) -> None:
    """The same pod over the .sif, and with every container's root (services too) over the
    image unpacked on the node (`unpacked_roots`), where the user can: roots of our own (the
    kernel's overlay), else Apptainer's (fuse-overlayfs)."""
    env_dir = tmp_path / "environment"
    write_compose(env_dir, POD.format(image=debian_sif, probe=PROBE))
    environment = make_environment(
        str(debian_sif), tmp_path, env_dir, memory_mb=1024, unpacked_roots=roots,
        scratch_dir=str(tmp_path / "scratch"),
    )  # fmt: skip
    assert environment.capabilities.docker_compose
    mounts = (
        'awk \'$2 == "/" {print $3, ($4 ~ /harbor-hpc-roots-/ ? "unpacked" : "packed")}\''
        " /proc/mounts | tail -n 1"
    )
    # Unpacked where the user's subuid range lets the unpack keep the image's owners.
    unpacked = roots and not missing_subid_ranges()
    root = "overlay unpacked\n" if unpacked else "overlay packed\n"

    async def scenario() -> dict[str, str]:
        await environment.start(force_build=False)
        try:
            seen = {}
            # Reachable by name as soon as the task starts: main waited for `healthy`.
            main = await environment.exec(
                "getent hosts api | cut -d' ' -f1; cat /shared/seed; python3 -c "
                "\"import os, urllib.request as u; print(u.urlopen(os.environ['API_URL']).status)\""
            )
            seen["main"] = main.stdout
            api = await environment.service_exec(
                "id -u; hostname; pwd; echo $GREETING; echo from-api > /shared/note",
                service="api",
            )
            seen["api"] = api.stdout
            seen["roots"] = (await environment.exec(mounts)).stdout + (
                await environment.service_exec(mounts, service="api")
            ).stdout
            seen["shared"] = (await environment.exec("cat /shared/note")).stdout
            await environment.service_download_file("/etc/hostname", tmp_path / "h", service="api")
            seen["download"] = (tmp_path / "h").read_text()
            # Stopping main leaves the rest of the pod running (sidecar evidence collection).
            await environment.stop_service("main")
            seen["after"] = (
                await environment.service_exec(
                    "python3 -c \"import socket; socket.create_connection(('localhost', 5000), 2)\""
                    " && echo up",
                    service="api",
                )
            ).stdout
            with pytest.raises(ValueError, match="no running compose service 'nope'"):
                await environment.service_exec("true", service="nope")
            return seen
        finally:
            await environment.stop(delete=True)

    seen = asyncio.run(scenario())
    assert seen["main"].split() == ["127.0.0.1", "seeded", "200"]
    assert seen["api"].split() == ["0", "api", "/srv", "hi"]
    assert seen["shared"] == "from-api\n" and seen["download"] == "api\n"
    assert seen["after"] == "up\n"
    assert seen["roots"] == root * 2
    assert list(tmp_path.glob("trial/**/harbor-hpc-env-*")) == []


@pytest.mark.apptainer
def test_the_watchdog_counts_every_service_against_the_tasks_memory(
    debian_sif: Path, tmp_path: Path
) -> None:
    """A service's process over the task's memory_mb is the biggest of the pod's: killed, as
    Docker's OOM killer kills it, and the main container goes on; the service's server too."""
    env_dir = tmp_path / "environment"
    write_compose(
        env_dir,
        f"""\
services:
  hog:
    image: {debian_sif}
    command: ["python3", "-c", "import time; b = bytearray(400 << 20); time.sleep(600)"]
""",
    )
    environment = make_environment(str(debian_sif), tmp_path, env_dir, memory_mb=256)

    async def scenario() -> tuple[str, str]:
        await environment.start(force_build=False)
        try:
            for _ in range(100):
                if environment._watchdog is not None and environment._watchdog.kills:
                    break
                await environment.exec("sleep 0.1")
            main = await environment.exec("echo main")
            service = await environment.service_exec(
                "pgrep -fc 'bytearray[(]400' || true", service="hog"
            )
            return main.stdout, service.stdout
        finally:
            await environment.stop(delete=True)

    assert asyncio.run(scenario()) == ("main\n", "0\n")
    assert environment._watchdog is not None
    (kill,) = environment._watchdog.kills
    assert "bytearray(400 << 20)" in kill.command and kill.limit_bytes == 256 << 20


@pytest.mark.apptainer
def test_an_unhealthy_service_fails_the_start_with_its_output(
    debian_sif: Path, tmp_path: Path
) -> None:
    env_dir = tmp_path / "environment"
    write_compose(
        env_dir,
        f"""\
services:
  main:
    depends_on: {{db: {{condition: service_healthy}}}}
  db:
    image: {debian_sif}
    command: ["sh", "-c", "echo db is broken; sleep 600"]
    healthcheck: {{test: "false", interval: 0.2s, retries: 3}}
""",
    )
    environment = make_environment(str(debian_sif), tmp_path, env_dir)
    with pytest.raises(
        RuntimeError, match=r"service db is unhealthy after 3 healthchecks:\ndb is broken"
    ):
        asyncio.run(environment.start(force_build=False))


# -- a published compose task's shape, through Harbor ---------------------------------------------

SERVER = """\
from http.server import BaseHTTPRequestHandler, HTTPServer
import json

items = [{"id": 1, "name": "alpha"}]


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps(items).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        items.append({"id": len(items) + 1, "name": body["name"]})
        self.send_response(201)
        self.end_headers()


HTTPServer(("0.0.0.0", 5000), Handler).serve_forever()
"""


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.apptainer_only  # Apptainer builds the Dockerfile (no Docker)
def test_a_build_context_service_is_built_into_the_store_and_the_oracle_scores(
    debian_sif: Path, base_image: str, tmp_path: Path
) -> None:
    """The cookbook's multi-container shape: main waits for `api-server`, built from its own
    context (here FROM the test base image in the registry), healthy; the oracle talks to it
    by name. The first trial builds the service's image into the store, as `docker compose up`
    would; then `build` finds it there and records it, `rewrite --sif` points the compose file
    at it (and the task at its own), and a second trial runs from those .sif files. A third
    runs the same task as Harbor's terminal-bench mapper writes such a task (the service's
    `image:` only naming what its `build:` makes, its healthcheck the image's HEALTHCHECK): its
    image is found in the store by context."""
    task = make_task(tmp_path / "tasks", "multi", image=str(debian_sif), kind="solved")
    env_dir = task / "environment"
    (env_dir / "Dockerfile").write_text(f"FROM {base_image}\n")
    (env_dir / "api-server").mkdir()
    (env_dir / "api-server" / "Dockerfile").write_text(
        f"FROM {base_image}\nWORKDIR /app\nCOPY server.py .\nEXPOSE 5000\n"
        f'HEALTHCHECK --interval=1s --retries=30 CMD ["python3", "-c", "{PROBE}"]\n'
        'CMD ["python3", "server.py"]\n'
    )
    (env_dir / "api-server" / "server.py").write_text(SERVER)
    write_compose(
        env_dir,
        """\
services:
  main:
    depends_on:
      api-server:
        condition: service_healthy
  api-server:
    build:
      context: ./api-server
    expose: ["5000"]
    healthcheck:
      test: ["CMD", "python3", "-c", "{probe}"]
      interval: 2s
      timeout: 5s
      retries: 15
      start_period: 5s
""".replace("{probe}", PROBE),
    )
    (task / "solution" / "solve.sh").write_text(
        "#!/bin/bash\nset -e\npython3 - <<'PY'\nimport json, urllib.request as u\n"
        "u.urlopen(u.Request('http://api-server:5000/items', json.dumps({'name': 'harbor'})"
        ".encode(), {'Content-Type': 'application/json'}))\n"
        "names = [i['name'] for i in json.load(u.urlopen('http://api-server:5000/items'))]\n"
        "open('/tmp/answer', 'w').write('42' if 'harbor' in names else '0')\nPY\n"
    )
    store, manifest = tmp_path / "store", tmp_path / "manifest.json"
    for attempt in ("first", "rewritten", "terminal-bench"):
        if attempt == "terminal-bench":
            write_terminal_bench_compose(env_dir)
        if attempt == "rewritten":
            prep = ["--manifest", str(manifest)]
            for command in (
                ["build", str(task.parent), "--builder", "apptainer", "--cache-dir", str(store),
                 "--nohttps", *prep],
                ["rewrite", str(task.parent), "--sif", *prep],
            ):  # fmt: skip
                ran = cli(*command, check=False)
                assert ran.returncode == 0, ran.stdout + ran.stderr
            compose = (env_dir / "docker-compose.yaml").read_text()
            assert f'image: "{store}/env-' in compose, compose
        trials = tmp_path / f"trials-{attempt}"
        done = subprocess.run(
            [HARBOR, "trial", "start", "-p", str(task), "-a", "oracle", "-e", ENVIRONMENT,
             "--environment-kwarg", f"singularity_image_cache_dir={store}",
             "--environment-kwarg", "nohttps=true", "--trials-dir", str(trials)],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        (trial,) = trials.iterdir()
        result = json.loads((trial / "result.json").read_text())
        assert result.get("exception_info") is None, result["exception_info"]
        assert reward(result) == 1.0
    # The task's own image and the service's: the service's built once.
    built = sorted(path.name for path in store.glob("env-*.sif"))
    assert len(built) == 2, built


def write_terminal_bench_compose(env_dir: Path) -> None:
    """The task's compose file as Harbor's terminal-bench mapper writes it from a
    terminal-bench task (`client` is the agent's container)."""
    from harbor.mappers.terminal_bench import DockerComposeProcessor

    original = {
        "services": {
            "client": {
                "build": {"context": ".", "dockerfile": "Dockerfile"},
                "image": "${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}",
                "command": ["sh", "-c", "sleep infinity"],
                "depends_on": {"api-server": {"condition": "service_healthy"}},
            },
            "api-server": {
                "build": {"context": "./api-server"},
                "image": "${T_BENCH_TASK_DOCKER_NAME_PREFIX}__api-server",
                "container_name": "${T_BENCH_TASK_DOCKER_NAME_PREFIX}__api-server",
            },
        }
    }
    processor = DockerComposeProcessor("tb")
    processor.write_harbor_compose(original, env_dir / "docker-compose.yaml")


def test_a_build_context_on_a_node_without_apptainer_says_where_to_build_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An enroot cluster's node has nothing that builds a Dockerfile: the service is named, and
    so is what to do, before anything is tried."""
    monkeypatch.setenv("HARBOR_HPC_APPTAINER", str(tmp_path / "no-apptainer"))
    find_apptainer.cache_clear()  # asked once per process
    try:
        context = tmp_path / "api-server"
        context.mkdir()
        (context / "Dockerfile").write_text("FROM scratch\n")
        service = Service(name="api-server", build=context)
        with pytest.raises(ImageUnavailable) as raised:
            service_sif(service, tmp_path, tmp_path / "store", nohttps=None)
    finally:
        find_apptainer.cache_clear()
    said = str(raised.value)
    assert said.startswith(f"service 'api-server': its build context {context} is not in ")
    assert "no Apptainer to build it" in said and "`harbor-hpc build`" in said
    assert not (tmp_path / "store").exists()


def test_answer_service_task_reads_as_a_pod(tmp_path: Path) -> None:
    task = make_task(
        tmp_path, "t", image="x.sif", kind="from_service", compose=answer_service("y.sif")
    )
    compose = load_compose(task / "environment")
    assert compose is not None and compose.names() == ["main", "answers"]
    assert compose.main.depends_on == {"answers": "service_healthy"}


def test_a_terminal_bench_task_as_harbors_mapper_writes_it_reads_as_a_pod(tmp_path: Path) -> None:
    """Harbor's own terminal-bench mapper writes `main` with Harbor's image, command and
    resources, and keeps the other services as the task had them (an `image:` that only names
    what `build:` makes, a container_name)."""
    from harbor.mappers.terminal_bench import DockerComposeProcessor

    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "Dockerfile").write_text("FROM x\n")
    original = {
        "services": {
            "client": {
                "build": {"context": ".", "dockerfile": "Dockerfile"},
                "image": "${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}",
                "container_name": "${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}",
                "command": ["sh", "-c", "sleep infinity"],
                "environment": ["TEST_DIR=${T_BENCH_TEST_DIR}"],
                "volumes": ["${T_BENCH_TASK_LOGS_PATH}:${T_BENCH_CONTAINER_LOGS_PATH}"],
                "depends_on": ["server"],
            },
            "server": {
                "build": {"context": "./server"},
                "image": "${T_BENCH_TASK_DOCKER_NAME_PREFIX}__server",
                "container_name": "${T_BENCH_TASK_DOCKER_NAME_PREFIX}__server",
                "command": ["python3", "-m", "http.server", "8000"],
            },
        }
    }
    DockerComposeProcessor("tb").write_harbor_compose(original, tmp_path / "docker-compose.yaml")
    compose = load_compose(tmp_path)
    assert compose is not None and compose.names() == ["main", "server"]
    assert compose.main.depends_on == {"server": "service_started"}
    (server,) = compose.services
    assert (server.image, server.build) == ("hb__server", (tmp_path / "server").resolve())
    assert server.command == ("python3", "-m", "http.server", "8000")


@pytest.mark.parametrize(
    ("compose", "image", "probe"),
    [
        # The image's HEALTHCHECK where compose sets none; compose's fields win one by one.
        (None, Healthcheck(("ready",), 5.0, None, 2, None), HealthProbe(("ready",), 5, 30, 2, 0)),
        (
            Healthcheck(None, 1.0),
            Healthcheck(("ready",), 5.0, 4.0),
            HealthProbe(("ready",), 1, 4, 3, 0),
        ),
        (Healthcheck(("mine",)), None, HealthProbe(("mine",), 30, 30, 3, 0)),
        # Disabled on either side (compose's `disable`, the image's NONE): none to run.
        (Healthcheck(disabled=True), Healthcheck(("ready",)), None),
        (None, Healthcheck(disabled=True), None),
        (None, None, None),
    ],
)
def test_a_healthcheck_is_composes_over_the_images_as_docker_merges_them(
    compose: Healthcheck | None, image: Healthcheck | None, probe: HealthProbe | None
) -> None:
    assert (compose or Healthcheck()).over(image) == probe


def test_an_images_healthcheck_reads_from_its_oci_config() -> None:
    config = ImageConfig.from_json(
        {"Healthcheck": {"Test": ["CMD-SHELL", "pg_isready"], "Interval": 2 * 10**9, "Retries": 4}}
    )
    assert image_healthcheck(config, "db") == Healthcheck(
        ("/bin/sh", "-c", "pg_isready"), 2.0, None, 4, None
    )
    assert image_healthcheck(ImageConfig(), "db") is None
