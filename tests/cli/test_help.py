"""Every subcommand's --help, as a user reads it: with an example that parses, within 80
columns, and with the brackets in its text (`harbor-hpc[ray]`, `[verifier]`) kept."""

from __future__ import annotations

import shlex

import typer.main
from typer.testing import CliRunner

from harbor_hpc.cli.app import app
from tests.test_docs import parse_error


def commands() -> list[list[str]]:
    """Each subcommand as the words that name it (`ray up`), from the app itself."""
    group = typer.main.get_group(app)
    found = []
    for name, command in group.commands.items():
        subcommands = getattr(command, "commands", None)
        if subcommands:
            found += [[name, sub] for sub in subcommands]
        else:
            found.append([name])
    return found


def examples(text: str) -> list[list[str]]:
    """The `Example:` command lines of a help text, as words (continuation lines joined)."""
    joined = text.replace("\\\n", " ")
    return [
        shlex.split(line.split("Example: ", 1)[1])
        for line in joined.splitlines()
        if "Example: harbor-hpc " in line
    ]


def test_every_subcommand_shows_an_example_that_parses_within_80_columns() -> None:
    runner = CliRunner()
    missing, wide, wrong = [], [], []
    for words in commands():
        shown = runner.invoke(app, [*words, "--help"], env={"COLUMNS": "80"})
        assert shown.exit_code == 0, (words, shown.output)
        wide += [line for line in shown.output.splitlines() if len(line) > 80]
        found = [e for e in examples(shown.output) if e[1 : 1 + len(words)] == words]
        if not found:
            missing.append(" ".join(words))
        wrong += [" ".join(e) for e in found if parse_error(app, e) is not None]
    assert (missing, wide, wrong) == ([], [], [])


def test_brackets_in_help_are_text() -> None:
    runner = CliRunner()
    ray = " ".join(runner.invoke(app, ["ray", "--help"], env={"COLUMNS": "100"}).output.split())
    assert "pip install 'harbor-hpc[ray]'" in ray
    build = " ".join(runner.invoke(app, ["build", "--help"], env={"COLUMNS": "100"}).output.split())
    assert '[verifier] environment_mode = "separate"' in build


def test_the_command_line_loads_what_a_command_needs_when_it_runs() -> None:
    """`--help`, `status` and `doctor` start without Harbor, the Hugging Face client, docker-py
    or submitit: each step imports those when it runs (bench/bench_startup.py times it)."""
    import subprocess
    import sys

    heavy = ("harbor", "huggingface_hub", "docker", "submitit", "pydantic", "yaml", "psutil")
    # Our own modules that only some steps need: the build planner, Ray clusters, probes.
    steps = ("harbor_hpc.images.build", "harbor_hpc.ray.cluster", "harbor_hpc.containers.probes")
    script = (
        "import sys; import harbor_hpc.cli; "
        f"print(sorted(({{m.split('.')[0] for m in sys.modules}} | set(sys.modules)) & "
        f"set({heavy + steps!r})))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert loaded.strip() == "[]", loaded
