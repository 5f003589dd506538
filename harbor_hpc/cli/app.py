"""The typer app and what every subcommand shares: options with one meaning, output, config.

Subcommands live one module per step next to this file; each is a thin function that parses
options, calls the module that does the work, and prints its typed result with `render` (a rich
table, or with `--json` the result's `to_json()` on stdout). Messages and progress go to stderr
so that `--json` output stays clean.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from harbor_hpc.core.config import Config, configured, load_config
from harbor_hpc.core.errors import InputError

if TYPE_CHECKING:
    from rich.progress import Progress

    from harbor_hpc.slurm.cluster import SlurmPlacement
    from harbor_hpc.tasks.discovery import TaskProblem

app = typer.Typer(
    name="harbor-hpc",
    help="Run Harbor agent tasks on Slurm clusters with Apptainer, one subcommand a step, in "
    "this order:\n\n"
    "fetch -> build -> convert -> rewrite -> submit -> status / resubmit / export\n\n"
    "(doctor first: is this machine ready?). Defaults for options can live in ./harbor-hpc.toml "
    "(docs/configuration.md); flags win.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Click's plain help: it starts in a third of the time Rich's takes (bench_startup.py),
    # wraps whole words at any width and cuts no default short.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"harbor-hpc {version('harbor-hpc')}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Run Harbor agent tasks on Slurm clusters with Apptainer."""


# Options shared by several subcommands: the same name, letter and meaning everywhere. Those
# that place Slurm jobs (partition, account, QOS, sbatch args, with each step's --time) make
# one `SlurmPlacement` (`placement`).
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print the result as JSON on stdout, for scripts.")
]
DryRunOption = Annotated[
    bool, typer.Option("--dry-run", help="Show what would be done; write and touch nothing.")
]
JobsOption = Annotated[
    int | None,
    typer.Option("--jobs", "-j", min=1, help="How many to work on in parallel. [default: 2]"),
]
ManifestOption = Annotated[
    Path | None,
    typer.Option(
        "--manifest",
        help="The image manifest (JSON) that `build` writes and the later steps read. "
        "[config: manifest]",
    ),
]
CacheDirOption = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        help="The .sif store, shared by users and nodes. [default: $HARBOR_HPC_CACHE, else "
        "cache_dir from the config, else ~/.cache/harbor-hpc/sif]",
    ),
]
PartitionOption = Annotated[
    str | None, typer.Option("--partition", "-p", help="Slurm partition. [config: partition]")
]
AccountOption = Annotated[
    str | None, typer.Option("--account", help="Slurm account. [config: account]")
]
QosOption = Annotated[str | None, typer.Option("--qos", help="Slurm QOS. [config: qos]")]
SbatchArgOption = Annotated[
    list[str] | None,
    typer.Option(
        "--sbatch-arg",
        metavar="KEY[=VALUE]",
        help="Extra sbatch option, e.g. constraint=a100; repeatable.",
    ),
]
SetupOption = Annotated[
    list[str] | None,
    typer.Option(
        "--setup",
        metavar="LINE",
        help="A shell line every Slurm job runs first, e.g. 'module load apptainer'; "
        "repeatable, after those of the config. [config: setup]",
    ),
]
NoHttpsOption = Annotated[
    bool,
    typer.Option(
        "--nohttps",
        help="Reach the registry over plain HTTP, as a lab's may need (a loopback one always "
        "is). Off unless given, set in the config (nohttps) or by APPTAINER_NOHTTPS=1.",
    ),
]
VerboseOption = Annotated[
    int, typer.Option("--verbose", "-v", count=True, help="More detail: -v info, -vv debug.")
]

console = Console(stderr=True, soft_wrap=True)  # one line per message, in logs too
stdout = Console(soft_wrap=True)
_verbosity = 0


def placement(
    config: Config,
    partition: str | None,
    account: str | None,
    qos: str | None,
    time_min: int | None,
    sbatch_args: list[str] | None,
    setup_lines: list[str] | None,
) -> SlurmPlacement:
    """The Slurm placement the shared options gave (`--partition`, `--account`, `--qos`, the
    step's `--time`, `--sbatch-arg`, `--setup`), harbor-hpc.toml filling in what they leave
    out."""
    from harbor_hpc.slurm.cluster import SlurmPlacement

    return configured(
        SlurmPlacement,
        config,
        partition=partition,
        account=account,
        qos=qos,
        time_min=time_min,
        sbatch_args=tuple(sbatch_args or ()),
        setup=setup_lines,
    )


def setup(verbose: int) -> Config:
    """Call first in every subcommand: sets up logging for `-v` and loads the config file."""
    global _verbosity
    _verbosity = verbose
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    # The handler's own level too: Harbor sets its logger to DEBUG, which the root's level
    # does not hold back from the handler.
    handler = RichHandler(console=console, show_path=False, level=level)
    logging.basicConfig(level=level, format="%(message)s", handlers=[handler], force=True)
    return config()


@cache
def config() -> Config:
    return load_config()


def manifest_path(flag: Path | None) -> Path:
    """`--manifest`, else the config file's `manifest`; one of them is required."""
    value = config().pick("manifest", None if flag is None else str(flag), None)
    if value is None:
        raise InputError(
            "no manifest given", hint="pass --manifest FILE (written by `harbor-hpc build`)"
        )
    return Path(value)


def verbosity() -> int:
    return _verbosity


def _print_json(data: Any) -> None:
    """Indented; a list (status's 80,000 attempts) an item a line: JSON's own encoder, in C,
    indents nothing, and Python's took seconds."""
    if not isinstance(data, list) or not data:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        return
    sys.stdout.write("[\n")
    for index, item in enumerate(data):
        comma = "," if index < len(data) - 1 else ""
        sys.stdout.write(f"  {json.dumps(item, default=str)}{comma}\n")
    sys.stdout.write("]\n")


class JsonResult(Protocol):
    """A subcommand's typed result: what it shows people, and `to_json()` for scripts."""

    def to_json(self) -> Any: ...


def render[R: JsonResult](result: R, *, json: bool, show: Callable[[R], None]) -> None:
    """Print a subcommand's result: `--json` prints `result.to_json()` on stdout, else `show`
    prints it for people. One object behind both, so scripts and people never see different
    results; warnings and errors go to stderr (`warn`, `console`) before or after."""
    if json:
        _print_json(result.to_json())
    else:
        show(result)


def progress() -> Progress:
    """The progress display for long work: a bar, done/total, elapsed time, on stderr."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[current]}"),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )


def warn(message: str) -> None:
    # Messages carry task names, paths and tool output: `[v2]` in them is text, not markup
    # (unescaped it vanished from the line, and `[/x]` ended the command with a MarkupError).
    console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False)


def info(message: str) -> None:
    console.print(message, highlight=False, markup=False)  # text as is, as in warn


# What the steps over a folder of tasks share.
TasksArgument = Annotated[
    Path,
    typer.Argument(
        help="Folder holding the tasks: every folder below it with task.toml is one.",
        show_default=False,
    ),
]
BuildArgOption = Annotated[
    list[str] | None,
    typer.Option(
        "--build-arg",
        metavar="NAME=VALUE",
        help="A value for the Dockerfiles' ARG NAME (repeatable), passed to every build as "
        "`docker build --build-arg` does. Those a Dockerfile declares are part of its image's "
        "content hash: other values, another image. Added to config build_args (a list of "
        '"NAME=VALUE"); a flag wins for its NAME.',
    ),
]
# How many named problems a step lists before it says how many more there are.
LISTED = 20


def show_problems(problems: list[TaskProblem]) -> None:
    for problem in problems[:LISTED]:
        warn(str(problem))
    if len(problems) > LISTED:
        warn(f"... and {len(problems) - LISTED} more")


def keep_examples(typer_app: typer.Typer) -> None:
    """Mark every `Example` paragraph of the help of `typer_app`'s commands (and its groups')
    for Click to print as written (`\\b`), not rewrapped with the others. Help comes from
    `help=` or else the command's docstring."""
    import inspect

    for command in typer_app.registered_commands:
        text = command.help
        if text is None and command.callback is not None and command.callback.__doc__:
            text = inspect.cleandoc(command.callback.__doc__)
        if text:
            command.help = "\n\n".join(
                f"\b\n{part}" if part.startswith("Example") else part for part in text.split("\n\n")
            )
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            keep_examples(group.typer_instance)
