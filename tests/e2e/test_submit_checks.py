"""What `submit` checks before anything is queued: environment kwargs the environment does not
take or values it refuses, an environment that does not import, and the separate verifier's
image; and `--scratch-dir`.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from harbor.environments.base import BaseEnvironment

from harbor_hpc.api import InputError, RolloutRequest, run_rollouts, run_status
from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.environment_kwargs import accepted_environment_kwargs
from harbor_hpc.core.imports import import_class
from harbor_hpc.runtimes.apptainer import find_apptainer
from harbor_hpc.steps.submit.checks import image_problem, reference_check
from harbor_hpc.tasks.discovery import Task, load_task
from tests.support.images import TinyImage
from tests.support.sample_tasks import make_task
from tests.support.users import other_user, other_user_command

REPO = Path(__file__).resolve().parents[2]


class ScratchEnvironment(SingularityEnvironment):
    """An environment of a user's own: one more kwarg of its own, the rest inherited."""

    def __init__(self, *args: Any, flavour: str = "plain", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


def submit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`harbor-hpc submit TASKS --agent oracle --dry-run --json ARGS` on one ready task."""
    sif = tmp_path / "there.sif"
    sif.write_text("")
    if not (tmp_path / "tasks").exists():
        make_task(tmp_path / "tasks", "a", image=str(sif))
    command = [sys.executable, "-m", "harbor_hpc", "submit", str(tmp_path / "tasks")]
    command += ["--agent", "oracle", "--executor", "local", "--run-dir", str(tmp_path / "run")]
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if k not in ("HARBOR_HPC_CONFIG", "HARBOR_HPC_CACHE")
        },
        "PYTHONPATH": str(REPO),  # the test environment class above, by its import path
        "COLUMNS": "400",
    }
    return subprocess.run(
        [*command, "--dry-run", "--json", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_accepted_kwargs_come_from_the_init_signatures_up_to_harbors_base() -> None:
    accepted = accepted_environment_kwargs(SingularityEnvironment)
    for own in ("singularity_image_cache_dir", "fakeroot", "memory_kill_fraction", "scratch_dir"):
        assert own in accepted
    for harbor_fills in ("environment_dir", "session_id", "task_env_config", "logger", "mounts"):
        assert harbor_fills not in accepted
    for users_may in ("override_cpus", "override_memory_mb", "persistent_env"):
        assert users_may in accepted  # BaseEnvironment's, filled by the factory, overridable
    assert "kwargs" not in accepted and "args" not in accepted and "self" not in accepted
    assert accepted_environment_kwargs(ScratchEnvironment) == sorted([*accepted, "flavour"])
    assert set(accepted_environment_kwargs(BaseEnvironment)) < set(accepted)


@pytest.mark.parametrize(
    "environment",
    [
        "harbor_hpc.environment:SingularityEnvironment",
        "harbor_hpc.environment:RaySingularityEnvironment",
    ],
)
def test_harbor_lists_our_typed_options_and_refuses_a_misspelt_one(environment: str) -> None:
    """`harbor environment schema` shows every kwarg we take (the same list our checks use),
    and Harbor's own parsing refuses one we do not."""
    harbor = Path(sys.executable).parent / "harbor"
    shown = subprocess.run(
        [str(harbor), "environment", "schema", environment, "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    listed = set(json.loads(shown.stdout)["properties"])
    cls: Any = import_class("-e", environment)
    assert listed - {"suppress_override_warnings"} <= set(accepted_environment_kwargs(cls))
    assert {"fakeroot", "scratch_dir", "unpacked_roots"} <= listed
    assert ("ray_cpus" in listed) == environment.endswith("RaySingularityEnvironment")
    with pytest.raises(ValueError, match="Unknown option 'fakerot'"):
        cls.parse_options({"fakerot": True})
    assert cls.parse_options({"fakeroot": "false", "unpacked_roots": "2"}).fakeroot is False


def test_an_environment_kwarg_of_the_wrong_kind_is_refused_before_anything_runs(
    tmp_path: Path,
) -> None:
    """Harbor's parsing of our typed options, before the batch (it was each trial's start that
    failed): from the CLI, exit 2, and from a trainer's Python, an InputError in its words."""
    refused = submit(
        tmp_path, "--environment-kwarg", "unpacked_roots=sometimes", "--environment-kwarg",
        "fakeroot=maybe",
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    error, hint = [line for line in refused.stderr.splitlines() if line.strip()]
    assert error.startswith(
        "error: --environment-kwarg fakeroot='maybe', unpacked_roots='sometimes' refused: "
        "fakeroot: Input should be a valid boolean"
    )
    assert error.endswith(
        "unpacked_roots: Input should be a valid number, unable to parse string as a number; "
        "unpacked_roots: Input should be 'auto'"
    )
    assert "harbor environment schema harbor_hpc.environment:SingularityEnvironment" in hint
    assert not (tmp_path / "run").exists()

    request = RolloutRequest(
        tasks=tmp_path / "tasks", run_dir=tmp_path / "run", agent="oracle",
        environment_kwargs={"unpacked_roots": -1},
    )  # fmt: skip
    with pytest.raises(InputError) as raised:
        run_rollouts(request)
    assert str(raised.value).startswith("environment_kwargs unpacked_roots=-1 refused: ")
    assert "greater than or equal to 0" in str(raised.value)
    assert not (tmp_path / "run").exists()

    # A size is no yes/no (pydantic alone would take true for 1 GiB), nor infinite.
    flag = submit(tmp_path, "--environment-kwarg", "unpacked_roots=true")
    assert flag.returncode == 2
    assert "unpacked_roots: Value error, a number of GiB, not true or false" in flag.stderr
    endless = submit(tmp_path, "--environment-kwarg", "unpacked_roots=inf")
    assert endless.returncode == 2
    assert "unpacked_roots: Input should be a finite number" in endless.stderr


def test_an_unknown_environment_kwarg_is_refused_in_one_line(tmp_path: Path) -> None:
    refused = submit(tmp_path, "--environment-kwarg", "fakerot=true", "--environment-kwarg", "x=1")
    assert refused.returncode == 2
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in refused.stderr
    assert "fakerot, x: not accepted by harbor_hpc.environment:SingularityEnvironment" in lines[0]
    assert "fakeroot" in lines[0] and "singularity_image_cache_dir" in lines[0]
    assert not (tmp_path / "run").exists()

    fine = submit(tmp_path, "--environment-kwarg", "fakeroot=true", "--environment-kwarg",
                  "override_cpus=2")  # fmt: skip
    assert fine.returncode == 0, fine.stderr
    kwargs = json.loads(fine.stdout)["environment_kwargs"]
    assert kwargs == {"fakeroot": True, "override_cpus": 2}


def test_an_environment_or_agent_that_does_not_import_is_named_in_one_line(
    tmp_path: Path,
) -> None:
    for option, path, error in (
        (
            "--environment",
            "no_such_module_here:Env",
            "ModuleNotFoundError: No module named 'no_such_module_here'",
        ),
        ("--environment", "harbor_hpc.environment:NoSuchClass", "AttributeError"),
        ("--agent", "no_such_pkg.agents:Agent", "ModuleNotFoundError: No module named"),
        ("--agent", "harbor_hpc.environment:NoSuchAgent", "AttributeError"),
    ):
        refused = submit(tmp_path, option, path)
        assert refused.returncode == 2, refused.stderr
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert f"{option} {path}: cannot import it ({error}" in lines[0]
        assert "Traceback" not in refused.stderr


def test_scratch_dir_goes_to_the_environment_as_scratch_dir(tmp_path: Path) -> None:
    scratch = tmp_path / "local" / "scratch"  # made by the trials that need it
    given = submit(tmp_path, "--scratch-dir", str(scratch))
    assert given.returncode == 0, given.stderr
    assert json.loads(given.stdout)["environment_kwargs"] == {"scratch_dir": str(scratch)}

    # Trials on this machine (the local executor) that could not write it are not started.
    (tmp_path / "a-file").write_text("")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    for path, said in (
        (tmp_path / "a-file", "not a folder"),
        (locked, "you cannot write it"),
        (locked / "below", f"you cannot write it (of {locked}, where it would be made)"),
    ):
        refused = submit(tmp_path, "--scratch-dir", str(path))
        assert refused.returncode == 2 and "Traceback" not in refused.stderr
        error, hint = [line for line in refused.stderr.splitlines() if line.strip()]
        assert error == f"error: --scratch-dir {path}: {said}"
        assert (
            hint
            == "hint: name a folder of yours on a local disk with room, or leave it out ($TMPDIR)"
        )
    assert not (tmp_path / "run").exists()

    (tmp_path / "harbor-hpc.toml").write_text(f'scratch_dir = "{tmp_path / "from-config"}"\n')
    configured = submit(
        tmp_path,
        "--environment",
        "tests.e2e.test_submit_checks:ScratchEnvironment",
        "--environment-kwarg",
        "flavour=spicy",
    )
    assert configured.returncode == 0, configured.stderr
    assert json.loads(configured.stdout)["environment_kwargs"] == {
        "flavour": "spicy",
        "scratch_dir": str(tmp_path / "from-config"),
    }
    (tmp_path / "harbor-hpc.toml").unlink()
    assert (
        "--scratch-dir"
        in subprocess.run(
            [sys.executable, "-m", "harbor_hpc", "submit", "--help"],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
        ).stdout
    )


def _task(root: Path, verifier: str, tests_dockerfile: bool = True) -> Task:
    root.mkdir(parents=True)
    sif = root / "main.sif"
    sif.write_text("")
    path = make_task(root, "t", image=str(sif))
    text = (path / "task.toml").read_text().replace("[verifier]\n", f"[verifier]\n{verifier}")
    (path / "task.toml").write_text(text)
    if tests_dockerfile:
        (path / "tests" / "Dockerfile").write_text("FROM local/debian:bookworm\n")
    task = load_task(root, path)
    assert isinstance(task, Task)
    return task


# These tasks name .sif files only: the registry is never asked.
CHECK = reference_check({})


def test_image_check_covers_the_separate_verifier(tmp_path: Path) -> None:
    unbuilt = _task(tmp_path / "1", 'environment_mode = "separate"\n')
    problem = image_problem(unbuilt, CHECK) or ""
    assert problem.startswith(f"{unbuilt.task_toml}: the separate verifier builds tests/Dockerfile")
    assert "verifier.environment.docker_image" in problem and "harbor-hpc build" in problem

    # Shared mode: tests/Dockerfile is not Harbor's concern, nor ours.
    assert image_problem(_task(tmp_path / "2", ""), CHECK) is None
    # Separate, but no image of its own: the verifier runs in the task's image.
    assert (
        image_problem(_task(tmp_path / "3", 'environment_mode = "separate"\n', False), CHECK)
        is None
    )

    gone = tmp_path / "gone.sif"
    missing = _task(tmp_path / "4", f'environment = {{ docker_image = "{gone}" }}\n')
    assert image_problem(missing, CHECK) == (
        f"{missing.task_toml}: verifier.environment.docker_image {gone} does not exist (build "
        "or convert into that store, or run `harbor-hpc rewrite --sif` with the manifest that "
        "has its .sif)"
    )
    gone.write_text("")
    assert image_problem(missing, CHECK) is None


@pytest.mark.registry
@pytest.mark.docker
def test_submit_refuses_references_no_node_could_get(tiny_image: TinyImage, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    make_task(tasks, "pushed", image=tiny_image.open_ref)
    absent = f"{os.environ['HARBOR_HPC_TEST_REGISTRY']}/harbor-hpc-test/absent:1"
    make_task(tasks, "absent", image=absent)
    make_task(tasks, "placeholder", image="<REGISTRY>/task-image")
    command = [sys.executable, "-m", "harbor_hpc", "submit", str(tasks), "--agent", "oracle"]
    command += ["--run-dir", str(tmp_path / "run"), "--environment-kwarg", "nohttps=true"]
    done = subprocess.run(
        [*command, "--dry-run", "--json"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    problems = json.loads(done.stdout)["image_problems"]
    assert sorted(problems) == ["absent", "placeholder"]
    assert f"docker_image {absent} cannot be had" in problems["absent"]
    assert "is not an image reference" in problems["placeholder"]


def test_an_agent_that_cannot_be_made_is_refused_before_anything_is_queued(
    tmp_path: Path,
) -> None:
    """What would fail on every node (Harbor makes the agent there) fails at submit."""
    for args, said in (
        (
            ("--agent", "terminus-2"),
            "--agent terminus-2 cannot be made with no --model (for task a): model_name is "
            "required for Terminus 2",
        ),
        (
            (
                "--agent",
                "terminus-2",
                "--model",
                "openai/policy",
                "--agent-kwarg",
                "temperature=hot",
            ),
            "--agent terminus-2 cannot be made with --model openai/policy and --agent-kwarg "
            "temperature (for task a): Invalid kwargs for agent 'terminus-2'",
        ),
    ):
        refused = submit(tmp_path, *args)
        assert refused.returncode == 2, refused.stderr
        assert said in refused.stderr and "Traceback" not in refused.stderr
        assert "DEBUG" not in refused.stderr  # Harbor's own debug lines stay out
        assert not (tmp_path / "run").exists()
    fine = submit(tmp_path, "--agent", "terminus-2", "--model", "openai/policy")
    assert fine.returncode == 0, fine.stderr


def test_a_task_without_tests_test_sh_is_named_before_the_batch(tmp_path: Path) -> None:
    """Harbor's trial refuses a task without its test script: submit and run_rollouts name the
    task and the file, not the agent (which Harbor's own check was mistaken for)."""
    sif = tmp_path / "there.sif"
    sif.write_text("")
    make_task(tmp_path / "tasks", "a", image=str(sif))
    untested = make_task(tmp_path / "tasks", "b", image=str(sif))
    (untested / "tests" / "test.sh").unlink()
    said = "task b: tests/test.sh is missing: Harbor's verifier runs it to give the reward"
    refused = submit(tmp_path)
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert said in lines[0] and "Traceback" not in refused.stderr, refused.stderr
    assert "--agent" not in refused.stderr
    assert not (tmp_path / "run").exists()

    request = RolloutRequest(tasks=tmp_path / "tasks", run_dir=tmp_path / "run", agent="oracle")
    with pytest.raises(InputError, match=said):
        run_rollouts(request)
    assert not (tmp_path / "run").exists()


def test_a_local_batch_where_no_container_runtime_is_is_refused_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither Apptainer nor enroot on this node: a local batch is refused once, in one line
    naming both, before any trial (the environment's preflight, as Harbor calls it), where
    every trial failed with "neither apptainer nor singularity is on PATH"; a Slurm batch's
    nodes are not this one, and a dry run queues nothing here."""
    sif = tmp_path / "there.sif"
    sif.write_text("")
    make_task(tmp_path / "tasks", "a", image=str(sif))
    for name in ("HARBOR_HPC_APPTAINER", "HARBOR_HPC_ENROOT", "HARBOR_HPC_RUNTIME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # this Python, no runtime
    said = "no container runtime here: neither Apptainer (apptainer, singularity) nor enroot"
    command = [sys.executable, "-m", "harbor_hpc", "submit", str(tmp_path / "tasks")]
    command += ["--agent", "oracle", "--executor", "local", "--run-dir", str(tmp_path / "run")]
    refused = subprocess.run(command, capture_output=True, text=True, check=False)
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0] and "module load" in lines[0], refused.stderr
    assert not (tmp_path / "run").exists()

    find_apptainer.cache_clear()  # asked once per process
    try:
        request = RolloutRequest(tasks=tmp_path / "tasks", run_dir=tmp_path / "run", agent="oracle")
        with pytest.raises(InputError, match=re.escape(said)):
            run_rollouts(request)
        assert not (tmp_path / "run").exists()
        assert submit(tmp_path).returncode == 0  # a dry run: nothing to start here
    finally:
        monkeypatch.undo()
        find_apptainer.cache_clear()


@pytest.mark.other_user
def test_a_run_dir_in_another_users_private_folder_is_named_in_one_line(
    tmp_path: Path, shared_dir: Path
) -> None:
    """submit, run_rollouts and status name the folder in the way, whose it is, and what to do,
    where they raised a bare PermissionError (or named run.json)."""
    sif = tmp_path / "there.sif"
    sif.write_text("")
    make_task(tmp_path / "tasks", "a", image=str(sif))
    place = shared_dir / f"theirs-{uuid.uuid4().hex[:8]}"
    place.mkdir()
    place.chmod(0o1777)
    private = place / "private"
    made = ["sh", "-c", f"mkdir -m 700 {private} && mkdir {private}/run"]
    subprocess.run(other_user_command(made), check=True, capture_output=True)
    try:
        said = f"{private} is {other_user()}'s (mode 0700) and you ({getpass.getuser()})"
        for run_dir in (private / "run", private / "new"):
            command = [sys.executable, "-m", "harbor_hpc", "submit", str(tmp_path / "tasks")]
            command += ["--agent", "oracle", "--executor", "local", "--run-dir", str(run_dir)]
            refused = subprocess.run(command, capture_output=True, text=True, check=False)
            assert refused.returncode == 2, refused.stderr
            assert f"error: {run_dir}: {said} may not enter it" in refused.stderr
            assert "--run-dir in a folder of your own" in refused.stderr
            assert "Traceback" not in refused.stderr and "run.json" not in refused.stderr

            request = RolloutRequest(tasks=tmp_path / "tasks", run_dir=run_dir, agent="oracle")
            with pytest.raises(InputError) as raised:
                run_rollouts(request)
            assert str(raised.value) == f"{run_dir}: {said} may not enter it"
            assert raised.value.hint is not None and "pick a run_dir" in raised.value.hint

        status = [sys.executable, "-m", "harbor_hpc", "status", str(private / "run")]
        refused = subprocess.run(status, capture_output=True, text=True, check=False)
        assert refused.returncode == 2, refused.stderr
        assert f"{said} may not enter it" in refused.stderr
        assert f"ask its owner to let you into {private}" in refused.stderr
        with pytest.raises(InputError, match="may not enter it"):
            run_status(private / "run")
    finally:
        subprocess.run(other_user_command(["rm", "-rf", str(private)]), check=False)
