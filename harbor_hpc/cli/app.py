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
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harbor_hpc.core.config import Config, load_config
from harbor_hpc.core.errors import InputError

if TYPE_CHECKING:
    from harbor_hpc.slurm.convert import SlurmOptions

app = typer.Typer(
    name="harbor-hpc",
    help="Run Harbor agent tasks on Slurm clusters with Apptainer, one subcommand a step:\n\n"
    "fetch -> build -> rewrite -> setup-sh -> convert -> submit -> status / resubmit / export.\n\n"
    "Defaults for options can live in ./harbor-hpc.toml (see the README); flags win.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
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


# Options shared by several subcommands: the same name, letter and meaning everywhere.
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print the result as JSON on stdout, for scripts.")
]
DryRunOption = Annotated[
    bool, typer.Option("--dry-run", help="Show what would be done; write and touch nothing.")
]
JobsOption = Annotated[
    int | None,
    typer.Option("--jobs", "-j", min=1, help="How many to work on in parallel. \\[default: 2]"),
]
ManifestOption = Annotated[
    Path | None,
    typer.Option(
        "--manifest",
        help="The image manifest (JSON) that `build` writes and the later steps read. "
        "\\[config: manifest]",
    ),
]
CacheDirOption = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        help="The .sif store, shared by users and nodes. \\[default: $HARBOR_HPC_CACHE, else "
        "cache_dir from the config, else ~/.cache/harbor-hpc/sif]",
    ),
]
PartitionOption = Annotated[
    str | None, typer.Option("--partition", "-p", help="Slurm partition. \\[config: partition]")
]
AccountOption = Annotated[
    str | None, typer.Option("--account", help="Slurm account. \\[config: account]")
]
QosOption = Annotated[str | None, typer.Option("--qos", help="Slurm QOS. \\[config: qos]")]
VerboseOption = Annotated[
    int, typer.Option("--verbose", "-v", count=True, help="More detail: -v info, -vv debug.")
]

console = Console(stderr=True, soft_wrap=True)  # one line per message, in logs too
stdout = Console(soft_wrap=True)
_verbosity = 0


def unit_job_options(
    config: Config,
    partition: str | None,
    account: str | None,
    qos: str | None,
    time_min: int | None,
) -> SlurmOptions:
    """Slurm options for an array job of one element per image or context (`convert --slurm`,
    `build --slurm`): `--time` is per element, never the config's time_min, which sizes trials."""
    from harbor_hpc.slurm.convert import SlurmOptions

    return SlurmOptions(
        partition=config.pick("partition", partition, None),
        account=config.pick("account", account, None),
        qos=config.pick("qos", qos, None),
        time_min=time_min or 60,
        array_parallelism=config.pick("array_parallelism", None, None),
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
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


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
