"""Every subcommand's --help, as a user reads it: with an example, and with the brackets in its
text (`harbor-hpc[ray]`, `[verifier]`) kept, not taken for Rich markup."""

from __future__ import annotations

import typer.main
from typer.testing import CliRunner

from harbor_hpc.cli.app import app


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


def test_every_subcommand_shows_an_example() -> None:
    runner = CliRunner()
    missing = []
    for words in commands():
        shown = runner.invoke(app, [*words, "--help"], env={"COLUMNS": "100"})
        assert shown.exit_code == 0, (words, shown.output)
        if "Example: harbor-hpc " + " ".join(words) not in " ".join(shown.output.split()):
            missing.append(" ".join(words))
    assert missing == []


def test_brackets_in_help_are_text() -> None:
    runner = CliRunner()
    top = " ".join(runner.invoke(app, ["--help"], env={"COLUMNS": "100"}).output.split())
    assert "pip install 'harbor-hpc[ray]'" in top
    build = " ".join(runner.invoke(app, ["build", "--help"], env={"COLUMNS": "100"}).output.split())
    assert '[verifier] environment_mode = "separate"' in build


def test_the_command_line_loads_what_a_command_needs_when_it_runs() -> None:
    """`--help`, `status` and `doctor` start without Harbor, the Hugging Face client, docker-py
    or submitit: each step imports those when it runs (bench/bench_startup.py times it)."""
    import subprocess
    import sys

    heavy = ("harbor", "huggingface_hub", "docker", "submitit", "pydantic", "yaml", "psutil")
    # Our own modules that only some steps need: the build planner, Ray clusters, probes.
    steps = ("harbor_hpc.images.build", "harbor_hpc.ray.cluster", "harbor_hpc.apptainer.probes")
    script = (
        "import sys; import harbor_hpc.cli; "
        f"print(sorted(({{m.split('.')[0] for m in sys.modules}} | set(sys.modules)) & "
        f"set({heavy + steps!r})))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert loaded.strip() == "[]", loaded
