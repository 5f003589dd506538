"""What each trial of a run came to, read in a few files rather than four or more per trial.

A trial's files are the truth: its marker, Harbor's result.json, environment-limits.json and
model-calls.json. A run of 10,000 tasks x 8 attempts holds 80,000 trials, and a shared
filesystem makes each file read a round trip, so the worker that runs trials also notes what
each came to in the run's outcomes index, once it is done with the trial (its marker final,
its folder sealed: nothing of ours writes them again):

    outcomes/<job>.<host>.<pid>.jsonl   one file per worker process, its only writer; one line
                                        per trial it ran that ended: the trial's marker and its
                                        outcome (`classify.Outcome`), appended in one write

The index is a cache that is never trusted further than this: a reader takes an entry only when
its line is whole (one that a killed worker half wrote is skipped), when it was made by the
rules this reader would apply (`rules`: the code that decides an outcome and Harbor's error
policy; and the run's reward key), when the trial's marker and folder are still there, and when
no other entry says otherwise of the same trial. Every other trial (those still running, those
of a worker killed before its note, those of runs made before the index) is read from its
folder, as it always was, many folders at once. So deleting `outcomes/` loses nothing but time.
A trial's files changed by hand after it ended are not noticed while its entry stands: delete
`outcomes/` then.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from harbor_hpc.containers.limits import read_limits
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import read_bytes, read_in_threads, read_json
from harbor_hpc.results.classify import (
    FailureClass,
    Outcome,
    failure_class,
    outcome_of_trial,
    short_message,
)
from harbor_hpc.results.record import Marker, RunPaths, read_marker, run_umask

SCHEMA = "harbor-hpc/outcome/v1"


def read_outcome(run_dir: Path, reward_key: str | None, marker: Marker) -> Outcome | None:
    """The trial's outcome when it has ended (result.json, or a failure before Harbor began),
    from its folder; its reward read by the run's `reward_key`."""
    trial_dir = RunPaths(run_dir).trial(marker.trial)
    try:
        result = read_json(trial_dir / "result.json")
    except HarborHpcError as exc:
        if not isinstance(exc.__context__, FileNotFoundError):  # read_json's "no such file"
            message = f"unreadable result: {exc.message}"
            limits = tuple(read_limits(trial_dir))
            return Outcome(FailureClass.INFRASTRUCTURE, message, None, {}, limits=limits)
        if not marker.error_type:
            return None
        message = short_message(marker.error_type, marker.error_message or "")
        failure = failure_class(marker.error_type, agent_started=False)
        limits = tuple(read_limits(trial_dir))
        return trial_outcome(marker, Outcome(failure, message, None, {}, limits=limits))
    return trial_outcome(marker, outcome_of_trial(trial_dir, result, reward_key=reward_key))


def trial_outcome(marker: Marker, outcome: Outcome) -> Outcome:
    """What the trial of `marker` came to, given what Harbor (or the worker) recorded.

    A trial that the job's end broke is infrastructure, to run again, whatever it recorded: the
    error the dying container raised, or a reward (often 0) that the verifier gave an agent
    the signal cut short.
    """
    if not marker.terminated_by:
        return outcome
    said = outcome.message or f"reward {outcome.reward}"
    message = f"job {marker.job} got {marker.terminated_by} during the trial ({said})"
    return replace(outcome, failure=FailureClass.INFRASTRUCTURE, message=message, valid=False)


@functools.cache
def rules() -> str:
    """What an outcome is made by: the source of the modules that decide it and of Harbor's
    error policy (read, not imported). An entry made by other rules (another harbor-hpc or
    Harbor) is read again from its trial's folder."""
    from harbor_hpc.containers import errors, limits
    from harbor_hpc.results import calls, classify

    harbor = importlib.util.find_spec("harbor")
    policy = Path(str(harbor.origin if harbor else "")).parent / "models/trial/error_policy.py"
    ours = [Path(str(module.__file__)) for module in (errors, limits, calls, classify)]
    digest = hashlib.sha256()
    for source in [*ours, Path(__file__), policy]:
        try:
            digest.update(source.read_bytes())
        except OSError:  # installed without its source: its name stands for it
            digest.update(str(source).encode())
    return digest.hexdigest()[:16]


def note_outcome(
    run_dir: Path,
    marker: Marker,
    outcome: Outcome,
    *,
    group_readable: bool,
    reward_key: str | None,
) -> None:
    """Append the trial's entry to this worker's file of the index: one line, in one write
    (O_APPEND), to a file no other process writes; `reward_key`: the one it was read by."""
    mask = run_umask(group_readable)
    folder = RunPaths(run_dir).outcomes
    folder.mkdir(mode=0o777 & ~mask, exist_ok=True)
    name = f"{marker.job or 'none'}.{marker.host}.{marker.pid}.jsonl".replace(os.sep, "_")
    entry = {
        "schema": SCHEMA,
        "rules": rules(),
        "reward_key": reward_key,
        "marker": asdict(marker),
        "outcome": asdict(outcome),
    }
    data = (json.dumps(entry) + "\n").encode()
    fd = os.open(folder / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666 & ~mask)
    try:
        while data:  # one write, unless the filesystem takes it in parts
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


def _outcome_of(data: dict[str, Any]) -> Outcome:
    """An outcome as `note_outcome` wrote it (by these rules: its types are ours)."""
    failure, limits = data["failure"], data["limits"]
    return Outcome(
        None if failure is None else FailureClass(failure),
        data["message"],
        data["reward"],
        data["rewards"],
        data["valid"],
        tuple(limits) if limits else (),
    )


def _entries(run_dir: Path, reward_key: str | None) -> dict[str, tuple[Marker, Outcome]]:
    """The index's entries that hold, by trial: whole lines of these rules and this reward key;
    a trial that two entries tell apart is left out."""
    folder = RunPaths(run_dir).outcomes
    try:
        names = sorted(name for name in os.listdir(folder) if name.endswith(".jsonl"))
    except OSError:
        return {}
    key = rules()
    found: dict[str, tuple[Marker, Outcome]] = {}
    clashes: set[str] = set()
    for data in read_in_threads(_read_or_nothing, [folder / name for name in names]):
        for line in data.split(b"\n")[:-1]:  # after the last newline: a line not yet whole
            try:
                entry = json.loads(line)
                if (
                    entry["schema"] != SCHEMA
                    or entry["rules"] != key
                    or entry.get("reward_key") != reward_key
                ):
                    continue
                marker = Marker(**entry["marker"])
                outcome = _outcome_of(entry["outcome"])
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # half a line, glued to the next one, or a foreign one
            if found.setdefault(marker.trial, (marker, outcome)) != (marker, outcome):
                clashes.add(marker.trial)
    for trial in clashes:
        del found[trial]
    return found


def _read_or_nothing(path: Path) -> bytes:
    try:
        return read_bytes(path)
    except OSError:
        return b""


class RunTrials:
    """Every trial of a run, as its markers say (oldest first), and what the ended ones came
    to: from the outcomes index where it holds them, else from their folders, each reward read
    by the run's `reward_key` (`RunRecord.reward_key`)."""

    def __init__(self, run_dir: Path, *, reward_key: str | None) -> None:
        paths = RunPaths(run_dir)
        self.run_dir = run_dir
        self.reward_key = reward_key
        try:
            names = os.listdir(paths.markers)
            marked = [name.removesuffix(".json") for name in names if name.endswith(".json")]
        except OSError:
            marked = []
        entries = _entries(run_dir, reward_key) if marked else {}
        if entries:  # an entry stands for a trial whose marker and folder are still there
            try:
                there = set(marked).intersection(os.listdir(paths.trials))
            except OSError:
                there = set()
            entries = {trial: entry for trial, entry in entries.items() if trial in there}
        unread = [paths.marker(trial) for trial in marked if trial not in entries]
        read = [m for m in read_in_threads(read_marker, unread) if m is not None]
        self.markers = [marker for marker, _ in entries.values()] + read
        self.markers.sort(key=lambda m: (m.started_at, m.trial))
        self._noted = {trial: outcome for trial, (_, outcome) in entries.items()}

    def outcomes(self, markers: Iterable[Marker]) -> list[Outcome | None]:
        """What each trial of `markers` came to (None: it has not ended), in their order; the
        folders the index does not answer for read many at once."""
        listed = list(markers)
        unread = [m for m in listed if m.trial not in self._noted]
        read = dict(zip(
            (m.trial for m in unread),
            read_in_threads(functools.partial(read_outcome, self.run_dir, self.reward_key), unread),
            strict=True,
        ))  # fmt: skip
        return [self._noted.get(m.trial) or read.get(m.trial) for m in listed]

    def noted(self, trial: str) -> Outcome | None:
        """What the trial came to, where the index holds it."""
        return self._noted.get(trial)
