"""`harbor-hpc submit`, `status`, `resubmit`, `export`: runs of Harbor trials on Slurm."""

from __future__ import annotations

import itertools
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.columns import Columns
from rich.console import Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.text import Text

from harbor_hpc.cli.app import (
    AccountOption,
    CacheDirOption,
    DryRunOption,
    JsonOption,
    PartitionOption,
    QosOption,
    SbatchArgOption,
    SetupOption,
    VerboseOption,
    app,
    console,
    info,
    render,
    setup,
    stdout,
    warn,
)
from harbor_hpc.containers.environment_kwargs import ENVIRONMENT
from harbor_hpc.core.errors import ReportedFailure
from harbor_hpc.results.classify import AttemptState
from harbor_hpc.results.export import ExportFormat
from harbor_hpc.results.status import NOT_QUEUED

if TYPE_CHECKING:  # what a step needs loads when it runs: `--help` stays quick
    from harbor_hpc.results.export import Export
    from harbor_hpc.results.status import RunStatus, Summary
    from harbor_hpc.slurm.resources import Resources
    from harbor_hpc.steps.submit.launch import SubmitResult

RunDirArgument = Annotated[
    Path,
    # Not click's readability check: a folder closed to this user is named by load_run.
    typer.Argument(
        help="The run folder that `harbor-hpc submit` created.", show_default=False, readable=False
    ),
]
WaitOption = Annotated[
    bool,
    typer.Option(
        "--wait",
        help="Follow the run with a live display until every trial has ended; then exit 1 "
        "when attempts failed (listed by failure class), 0 when all are done.",
    ),
]
RerunChangedOption = Annotated[
    bool,
    typer.Option(
        "--rerun-changed",
        help="Into a run whose tasks changed since it ran them (instruction, task.toml, tests, "
        "environment; the solution for the oracle): run every attempt of those tasks again, "
        "where it is otherwise refused.",
    ),
]
# `--wait` names this many failed attempts per failure class; `status` shows them all.
FAILED_SHOWN = 20


@app.command(short_help="Run every task with an agent, as Slurm array jobs.")
def submit(
    tasks_dir: Annotated[
        Path, typer.Argument(help="Folder holding the tasks (folders with task.toml).")
    ],
    agent: Annotated[
        str,
        typer.Option(
            "--agent", "-a", help="Harbor agent name (oracle, terminus-2, ...) or module:Class."
        ),
    ],
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model for the agent.")] = None,
    agent_kwarg: Annotated[
        list[str] | None,
        typer.Option("--agent-kwarg", help="KEY=VALUE passed to the agent; repeatable."),
    ] = None,
    agent_env: Annotated[
        list[str] | None,
        typer.Option(
            "--agent-env",
            help="NAME (from your environment) or NAME=VALUE, for the agent; repeatable. For "
            "secrets: the value reaches the jobs' environment only, never a file.",
        ),
    ] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            "--run-dir",
            help="Folder for run.json, logs and trials. [default: config run_dir/<time>, "
            "else ./runs/<time>]",
        ),
    ] = None,
    executor: Annotated[
        str | None,
        typer.Option(
            "--executor",
            help="auto (Slurm when sbatch is on PATH, else local processes), slurm, local. "
            "[default: auto]",
        ),
    ] = None,
    partition: PartitionOption = None,
    account: AccountOption = None,
    qos: QosOption = None,
    array_parallelism: Annotated[
        int | None,
        typer.Option(
            "--array-parallelism",
            min=1,
            help="Array elements running at once (local: processes). [default: Slurm 256, local 1]",
        ),
    ] = None,
    tasks_per_job: Annotated[
        int | None,
        typer.Option("--tasks-per-job", "-k", min=1, help="Tasks per array element. [default: 1]"),
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency", "-c", min=1, help="Trials at a time within an element. [default: 1]"
        ),
    ] = None,
    attempts: Annotated[
        int, typer.Option("--attempts", min=1, help="Trials per task (pass@k, RL rollouts).")
    ] = 1,
    cache_dir: CacheDirOption = None,
    environment: Annotated[
        str,
        typer.Option(
            "--environment",
            help="The Harbor environment, as module:Class (e.g. Harbor's own "
            "harbor.environments.singularity:SingularityEnvironment). [default: harbor-hpc's, "
            "harbor_hpc.environment:SingularityEnvironment]",
            show_default=False,
        ),
    ] = ENVIRONMENT,
    environment_kwarg: Annotated[
        list[str] | None,
        typer.Option(
            "--environment-kwarg",
            help="KEY=VALUE for the environment; repeatable. Names it does not take are refused.",
        ),
    ] = None,
    scratch_dir: Annotated[
        Path | None,
        typer.Option(
            "--scratch-dir",
            help="Where each trial's private writable overlay and staging live on the compute "
            "node (a local disk with room; the environment kwarg scratch_dir). [default: "
            "Slurm's $TMPDIR, else the system temp folder, decided on the node; config: "
            "scratch_dir]",
        ),
    ] = None,
    time_min: Annotated[
        int | None,
        typer.Option(
            "--time", min=1, help="Minutes per element. [default: from the tasks' timeouts]"
        ),
    ] = None,
    mem_mb: Annotated[
        int | None,
        typer.Option("--mem", min=1, help="MB per element. [default: from the tasks' memory_mb]"),
    ] = None,
    cpus: Annotated[
        int | None,
        typer.Option("--cpus", min=1, help="CPUs per element. [default: from the tasks' cpus]"),
    ] = None,
    sbatch_arg: SbatchArgOption = None,
    setup_line: SetupOption = None,
    group_readable: Annotated[
        bool,
        typer.Option(
            "--group-readable",
            help="Let your group read the run folder (never write it). [default: only you]",
        ),
    ] = False,
    no_model_check: Annotated[
        bool,
        typer.Option(
            "--no-model-check",
            help="Do not ask the agent's model server (its api_base) before queueing whether "
            "it answers, serves --model and sends token ids: for a server only the compute "
            "nodes reach.",
        ),
    ] = False,
    reward_key: Annotated[
        str | None,
        typer.Option(
            "--reward-key",
            help="The key of the verifier's reward.json that is each trial's reward. "
            "[default: `reward`, else a lone value; several, none named `reward`: not "
            "trainable; config: reward_key]",
        ),
    ] = None,
    rerun_changed: RerunChangedOption = False,
    wait: WaitOption = False,
    json: JsonOption = False,
    dry_run: DryRunOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Run every task of TASKS_DIR with an agent, as Slurm array jobs of Harbor trials.

    Each array element runs --tasks-per-job tasks, --concurrency trials at a time, in harbor-hpc's
    Apptainer environment. Trials land in RUN_DIR/trials as standard Harbor trial folders
    (`harbor view RUN_DIR --jobs` shows them). Tasks whose image is missing are reported, not
    run. The same submit again into the same --run-dir continues that run: it queues only the
    attempts that have no finished trial, and refuses tasks that changed since the run ran
    them (--rerun-changed runs those again).

    Example: harbor-hpc submit tasks/ --agent oracle -c 2 -k 4 --wait \\
                 --run-dir runs/oracle
    """
    from harbor_hpc.steps.submit.launch import submit_run
    from harbor_hpc.steps.submit.options import configured_options, parse_key_values

    config = setup(verbose)
    options = configured_options(
        config,
        agent=agent,
        model=model,
        agent_kwargs=parse_key_values(agent_kwarg or [], "--agent-kwarg"),
        agent_env=agent_env or [],
        environment=environment,
        environment_kwargs=parse_key_values(environment_kwarg or [], "--environment-kwarg"),
        cache_dir=cache_dir,
        scratch_dir=scratch_dir,
        executor=executor,
        partition=partition,
        account=account,
        qos=qos,
        array_parallelism=array_parallelism,
        tasks_per_job=tasks_per_job,
        concurrency=concurrency,
        attempts=attempts,
        time_min=time_min,
        mem_mb=mem_mb,
        cpus=cpus,
        sbatch_args=sbatch_arg,
        setup=setup_line,
        group_readable=group_readable,
        model_check=not no_model_check,
        reward_key=reward_key,
        rerun_changed=rerun_changed,
    )
    default_root = Path(config.pick("run_dir", None, "runs"))
    target = run_dir or default_root / time.strftime("%Y%m%d-%H%M%S")
    result = submit_run(tasks_dir, target, options, dry_run=dry_run)
    _warn_before_submitting(result)
    render(result, json=json, show=_show_submission)
    if wait and not dry_run:
        _follow(result.run_dir)


@app.command(short_help="Where each task attempt of a run stands, and why it failed.")
def status(run_dir: RunDirArgument, json: JsonOption = False, verbose: VerboseOption = 0) -> None:
    """Where every task attempt of a run stands: pending, running, done (reward) or failed (why).

    Works while the run goes on and after; needs squeue for Slurm runs, not sacct. Failure
    classes: image, environment, unsupported, setup, memory, timeout (the agent's), verifier
    (tests/test.sh, its time too), model, agent, infrastructure (resubmit those). Each
    failure's message follows the table, cut to one line; -v shows its first 300 characters,
    wrapped, and the trial folder of every attempt (whose exception.txt holds the rest).

    Example: harbor-hpc status runs/oracle -v
    """
    from harbor_hpc.steps.runs import run_status, unset_agent_env

    setup(verbose)
    found = run_status(run_dir)
    render(found, json=json, show=lambda shown: _show_status(shown, verbose=verbose > 0))
    if unset := unset_agent_env(run_dir):
        warn(
            f"elements wait to be queued, but the run's --agent-env {', '.join(unset)} is not "
            "set here, which their agent needs: set it, then run status again"
        )


@app.command(short_help="Stop a run: its trials end, its queued elements never start.")
def cancel(run_dir: RunDirArgument) -> None:
    """Stop what is left of a run: its workers end their trials within seconds (each fails,
    infrastructure, for `resubmit`), its elements still in the queue leave it, and those that
    wait to be queued (a limit on queued jobs) never are. Finished trials stay as they are.

    Example: harbor-hpc cancel runs/oracle
    """
    from harbor_hpc.steps.runs import cancel_run

    cancel_run(run_dir)
    info(f"cancelled {run_dir}: `harbor-hpc status` shows what had ended")


@app.command(short_help="Rerun the attempts of a run that have no finished trial.")
def resubmit(
    run_dir: RunDirArgument,
    failed: Annotated[
        bool,
        typer.Option("--failed", help="Also rerun attempts that failed (not only lost ones)."),
    ] = False,
    rerun_changed: RerunChangedOption = False,
    wait: WaitOption = False,
    json: JsonOption = False,
    dry_run: DryRunOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Rerun the attempts of a run that have no finished trial (dead jobs, lost results).

    With --failed, failed attempts too. Finished trials are kept and never run again; the new
    trials go into the same run folder as a new submission. A task changed since the run ran
    it (its instruction, task.toml, tests, environment) is refused, exit 2; with
    --rerun-changed all its attempts run again and its old trials no longer count.

    Example: harbor-hpc resubmit runs/oracle --failed --wait
    """
    from harbor_hpc.steps.submit.launch import resubmit_run

    setup(verbose)
    result = resubmit_run(run_dir, failed=failed, dry_run=dry_run, rerun_changed=rerun_changed)
    if result.skipped:
        unqueued = sum(1 for s in result.skipped if (s.message or "").startswith(NOT_QUEUED))
        waits = f" ({unqueued} {NOT_QUEUED}: queued as your limits leave room)" if unqueued else ""
        warn(f"{len(result.skipped)} attempt(s) still pending or running{waits}; left alone")
    _warn_before_submitting(result)
    render(result, json=json, show=_show_submission)
    if wait and not dry_run:
        _follow(result.run_dir)


@app.command(short_help="Write a run's rollouts as JSON lines for RL trainers.")
def export(
    run_dir: RunDirArgument,
    out: Annotated[Path, typer.Option("--out", "-o", help="The JSONL file to write.")],
    fmt: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            "-f",
            help="full: every trial in harbor-hpc's rollout schema; harbor-rl, nemo-gym: "
            "the trainable rollouts with tokens, as those trainers read them.",
        ),
    ] = ExportFormat.FULL,
    json: JsonOption = False,
    dry_run: DryRunOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Write the run's rollouts as JSON lines for RL trainers (docs/results.md: "Rollout schema").

    full: one line per trial that ended (and per attempt that failed without one): rewards,
    per-step rewards, failure, trainable, chat messages and token ids per turn, flattened
    token_ids/mask_ids. Fails, writing nothing, when the run asked for token ids and the model
    server sent none. The file is replaced atomically, as private as the run.

    Example: harbor-hpc export runs/grpo --out rollouts.jsonl --format nemo-gym
    """
    setup(verbose)
    from harbor_hpc.steps import runs

    render(runs.export(run_dir, out, fmt=fmt, dry_run=dry_run), json=json, show=_show_export)


def _show_export(written: Export) -> None:
    verb = "would write" if written.dry_run else "wrote"
    info(f"{verb} {written.rollouts} line(s) ({written.format}) to {written.out}")
    if written.left_out:
        reasons = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in written.left_out.items())
        info(f"left out: {reasons}")


def _warn_before_submitting(result: SubmitResult) -> None:
    """On stderr before the result, with --json too."""
    for task, problem in sorted(result.image_problems.items()):
        warn(f"not submitted, image missing: {task}: {problem}")
    for group in result.groups:
        for task, seconds in group.too_long.items():
            warn(
                f"{task}: a trial may take {seconds} s (its timeouts), more than an element "
                f"works before its requeue warning ({group.resources.time_min} min less "
                f"{group.requeue_warning_s} s): it would be cut off at every requeue; "
                "give a longer --time, or leave --time out to have it sized"
            )
        if group.memory_needed_mb is not None:
            warn(
                f"{', '.join(group.tasks[:3])}{' ...' if len(group.tasks) > 3 else ''}: an "
                f"element asks for {group.resources.mem_mb} MB, less than its trials' memory_mb "
                f"at once and harbor-hpc's own processes need ({group.memory_needed_mb} MB): "
                "where "
                "Slurm holds jobs to their memory, the job, not the watchdog, may end trials "
                f"(they fail `memory`, naming it); give --mem {group.memory_needed_mb} or "
                "fewer --concurrency"
            )


def _sizing(resources: Resources) -> str:
    gpus = f", {_count(resources.gpus, 'gpu')}" if resources.gpus else ""
    memory = f"{resources.mem_mb} MB"
    if 0 < resources.worker_mb < resources.mem_mb:  # why it asks more than the memory_mb
        trials = resources.mem_mb - resources.worker_mb
        memory += f" ({trials} for trials, {resources.worker_mb} for Harbor)"
    return f"{_count(resources.cpus, 'cpu')}{gpus}, {memory}, {resources.time_min} min each"


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" if n == 1 else f"{n} {thing}s"


def _show_submission(result: SubmitResult) -> None:
    if result.rerun:
        shown = ", ".join(result.rerun[:5]) + (
            f" and {len(result.rerun) - 5} more" if len(result.rerun) > 5 else ""
        )
        verb = "would be run" if result.dry_run else "run"
        info(f"{len(result.rerun)} task(s) changed since the run ran them, {verb} again: {shown}")
    if not result.units:
        info("nothing to submit")
        return
    what = f"{len(result.units)} trial(s) in {len(result.chunks)} element(s)"
    if len(result.groups) == 1:
        what += f" ({_sizing(result.groups[0].resources)})"
    if result.dry_run:
        info(f"would submit {what} with the {result.executor} executor to {result.run_dir}")
        if result.waiting:
            waits = len(result.chunks) - result.queued
            info(
                f"{_count(waits, 'element')} would wait to be queued: {result.waiting} "
                f"({result.queued} more now); they are queued as your jobs leave the queue"
            )
    else:
        jobs = ", ".join(result.job_ids) or "none yet"
        if result.waiting:
            what += f", {result.queued} queued now"
        info(f"submitted {what}: {result.executor} job(s) {jobs}")
        if result.waiting:
            waits = len(result.chunks) - result.queued
            info(
                f"{_count(waits, 'element')} not queued yet: {result.waiting}; they are queued "
                "as your jobs leave the queue, by the run's elements as they end, and by "
                "`submit --wait` or `harbor-hpc status` (with the run's --agent-env variables set)"
            )
    if len(result.groups) > 1:  # one array each, sized for its tasks
        for group in result.groups:
            elements = f"{len(group.tasks)} task(s) in {len(group.chunks)} element(s)"
            info(f"  {elements} ({_sizing(group.resources)})")
    from harbor_hpc.slurm.cluster import REQUEUE_WARNING_S

    for group in result.groups:
        warning = group.requeue_warning_s
        if warning is not None and warning < REQUEUE_WARNING_S:
            info(
                f"elements of {group.resources.time_min} min are told to requeue {warning} s "
                f"before their time limit (a quarter of it, not {REQUEUE_WARNING_S} s)"
            )
    if not result.dry_run:
        info(f"follow it with: harbor-hpc status {result.run_dir}")


def _show_status(found: RunStatus, *, verbose: bool) -> None:
    """One row per attempt; below them each failed attempt's message, indented on a line of its
    own and cut to the terminal's width (`verbose`: whole, with the trial folders)."""
    width = stdout.width
    for lines in itertools.batched(_status_lines(found, verbose, width), LINES_AT_ONCE):
        if stdout.color_system is None:  # a file, a pipe: text alone, without rich's cost
            stdout.file.write("".join(f"{line}\n" for line, _ in lines))
            continue
        text = Text("\n".join(line for line, _ in lines))
        at = 0
        for line, style in lines:
            for begin, end, name in style:
                text.stylize(name, at + begin, at + end)
            at += len(line) + 1
        stdout.print(text, soft_wrap=True, highlight=False)
    limited = Counter(limit for s in found.attempts for limit in s.limits)
    for limit, count in limited.items():  # the node's, not the task's: once per kind
        said = Text(f"{count} attempt(s) ran weaker than in Docker: {limit}", style="yellow")
        stdout.print(said, soft_wrap=False)  # wrapped at the terminal's width
    stdout.print(_summary_line(found.summary), soft_wrap=False, highlight=False)


# The status table's lines are printed this many at a time: a rich Table of a run's 80,000
# attempts took most of `status`'s time and memory.
LINES_AT_ONCE = 1000
STATE_COLOURS = {"done": "green", "failed": "red", "running": "cyan", "pending": "dim"}
# A line of the table, and where it is styled: (start, end, style).
Line = tuple[str, list[tuple[int, int, str]]]


def _status_lines(found: RunStatus, verbose: bool, width: int) -> Iterator[Line]:
    """The table of `status`: a header, then a row per attempt, each column as wide as its
    widest cell, the task's (and the trial's) folded onto more lines where the whole would be
    wider than `width`; then each ended attempt's message, cut to one line (`verbose`: folded,
    whole, and the messages of those that wait too)."""
    header = ["task", "#", "state", "reward", "failure"] + (["trial"] if verbose else [])
    rows = [
        [
            s.task,
            str(s.attempt),
            s.state,
            "" if s.reward is None else f"{s.reward:.3f}",  # as the summary's mean
            s.failure or "",
        ]
        + ([s.trial or ""] if verbose else [])
        for s in found.attempts
    ]
    widths = [max(map(len, column)) for column in zip(header, *rows, strict=True)]
    for index in [0, 5] if verbose else [0]:  # the task's, the trial's: as narrow as need be
        over = sum(widths) + 2 * (len(widths) - 1) - width
        widths[index] = max(8, widths[index] - max(0, over))
    yield from _row(header, widths, None)
    yield "  ".join("─" * w for w in widths), []
    for row, s in zip(rows, found.attempts, strict=True):
        yield from _row(row, widths, STATE_COLOURS[s.state])
    for s in found.attempts:
        # Why attempts wait is counted in the summary line below; each is named with -v.
        if s.message and (verbose or s.state not in (AttemptState.PENDING, AttemptState.RUNNING)):
            said = f"{s.task} #{s.attempt}"
            yield said, [(0, len(said), "bold")]
            for line in s.message.splitlines() or [""]:
                if verbose:
                    wrapped = textwrap.wrap(line, max(1, width - 2), break_on_hyphens=False)
                    yield from (("  " + part, []) for part in wrapped)
                elif len(line) + 2 > width:
                    yield "  " + line[: max(0, width - 3)] + "…", []
                else:
                    yield "  " + line, []


def _row(cells: list[str], widths: list[int], state: str | None) -> Iterator[Line]:
    """One table row, on as many lines as its longest folded cell needs, its state in the
    colour `state` (None: the header, bold)."""
    parts = [
        [cell[at : at + w] for at in range(0, len(cell), w)] or [""]
        for cell, w in zip(cells, widths, strict=True)
    ]
    for number in range(max(map(len, parts))):
        pieces = [part[number] if number < len(part) else "" for part in parts]
        line = "  ".join(piece.ljust(w) for piece, w in zip(pieces, widths, strict=True))
        line = line.rstrip()
        if state is None:
            yield line, [(0, len(line), "bold")]
        elif number == 0:
            start = sum(widths[:2]) + 4
            yield line, [(start, start + len(pieces[2]), state)]
        else:
            yield line, []


def _summary_line(summary: Summary) -> str:
    states = ", ".join(f"{count} {state}" for state, count in summary.states.items())
    failures = ", ".join(f"{count} {name}" for name, count in summary.failures.items())
    mean = "n/a" if summary.mean_reward is None else f"{summary.mean_reward:.3f}"
    line = f"{summary.total} attempt(s): {states}; mean reward {mean}"
    if summary.waiting:
        line += "; waiting: " + ", ".join(f"{why} ({n})" for why, n in summary.waiting.items())
    return f"{line}; failures: {failures}" if failures else line


def _progress_view(summary: Summary) -> Group:
    ended = summary.states[AttemptState.DONE] + summary.states[AttemptState.FAILED]
    bar = ProgressBar(total=max(1, summary.total), completed=ended, width=40)
    return Group(Columns([bar, f"{ended}/{summary.total}"]), _summary_line(summary))


def _follow(run_dir: Path) -> None:
    """Show the run's counts live until nothing is pending or running; then, when attempts
    failed, which ones by failure class, and exit 1 (every attempt done, whatever its
    reward: 0)."""
    from harbor_hpc.steps.runs import follow

    try:
        if console.is_terminal:
            with Live(console=console, refresh_per_second=2, transient=True) as live:
                for now in follow(run_dir):
                    live.update(_progress_view(now.summary))
        else:  # a log: Live would leave its last frame there, beside the line below
            *_, now = follow(run_dir)
    except KeyboardInterrupt:  # Ctrl-C: local jobs ignore it, as Slurm's never see it
        info(
            f"interrupted: the waiting stopped, the run goes on (harbor-hpc status {run_dir}; "
            "each status also queues elements that wait for room under your limits)"
        )
        raise SystemExit(130) from None
    info(_summary_line(now.summary))
    failed: dict[str, list[str]] = {}
    for s in now.attempts:
        if s.state == AttemptState.FAILED:
            failed.setdefault(str(s.failure), []).append(f"{s.task} #{s.attempt}")
    if not failed:
        return
    info("failed attempts, by failure class:")
    for failure, attempts in sorted(failed.items()):
        shown = ", ".join(attempts[:FAILED_SHOWN])
        more = f" and {len(attempts) - FAILED_SHOWN} more" if len(attempts) > FAILED_SHOWN else ""
        info(f"  {failure} ({len(attempts)}): {shown}{more}")
    info(f"details: harbor-hpc status {run_dir}")
    raise ReportedFailure
