"""A pool of sandboxes: open one for a task, exec / upload / download, verify, close.

    pool = SandboxPool(SandboxOptions(executor="local", ahead=7))
    sandbox = pool.open("tasks/write-gamma")    # at once: its start goes on in the background
    sandbox.instruction                          # the task's instruction.md
    sandbox.exec("ls /app")                      # waits for the start, then runs as the agent
    result = sandbox.verify()                    # the task's verifier, as Harbor's trial runs it
    result.reward, result.trainable, result.failure, result.message

Each sandbox is a Harbor trial (`agent.py`): its outcome is read by the rule `run_rollouts`
reads trials by (results/classify.py), so a reward is the policy's or names what failed. A
sandbox is started ahead in two ways: `open` returns before the container is up, so that a
trainer's serial resets start their sandboxes side by side; and `ahead` more of a task are
started when it is opened with none ahead (a GRPO group's next rollouts of the same task), or
`prefetch(tasks)` starts those a trainer knows it will ask for. At most `starts` sandboxes
start at once, the ones asked for before the ones ahead; a sandbox nobody used for `idle_sec`
is given back. Every call may come from any thread or event loop (`loop.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import logging
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.errors import SnapshotRefused, error_policy_overrides
from harbor_hpc.containers.snapshot import Restorable
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.ray.environment import RaySingularityEnvironment
from harbor_hpc.results.classify import (
    FailureClass,
    Outcome,
    failure_class,
    outcome_of_trial,
    short_message,
)
from harbor_hpc.results.record import seal, waiting_for
from harbor_hpc.sandbox.agent import AGENT, HANDOFFS, Handoff
from harbor_hpc.sandbox.loop import on_sandbox_loop, run_async, run_sync
from harbor_hpc.steps.rollouts import Backend, python_words
from harbor_hpc.steps.submit.checks import check_environment, preflight, verifier_problem
from harbor_hpc.steps.submit.options import placed
from harbor_hpc.tasks.discovery import Task, TaskProblem, load_task

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.environment_type import ExecResult
    from harbor.trial.trial import Trial

log = logging.getLogger(__name__)

# How often the pool looks for sandboxes idle past their time, and a call waiting for a start
# looks at what it waits for.
_IDLE_CHECK_S = 1.0
_WAITING_CHECK_S = 1.0


class SandboxEnded(HarborHpcError):
    """A call on a sandbox that is no longer there: it failed to start (an image, the
    cluster), its episode ended (the task's agent timeout), or it was verified or closed.
    The message says which; `result` is what the sandbox came to, where it came to one."""

    def __init__(self, message: str, result: SandboxResult | None = None) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class Branch:
    """Where a forked sandbox branched off (`Sandbox.fork`): its parent sandbox (`parent`, its
    `id`) and the parent's step then (the commands it had run, or the trainer's own count)."""

    parent: str
    step: int


@dataclass(frozen=True)
class SandboxResult:
    """What a sandbox came to, by the validity rule of docs/results.md. `reward`: the
    verifier's (by the pool's `reward_key`), None where it gave none; `trainable`: whether the
    policy alone made it, so that a trainer may learn from `reward`; otherwise `failure` names
    what failed and `message` says how. `trial_dir`: the trial's folder (Harbor's files), where
    the pool keeps them. `sandbox`: the sandbox's `id`; `branch`: where it was forked from,
    for a forked one (a trainer rebuilds the tree of a branching rollout from these)."""

    task: Path
    reward: float | None
    trainable: bool
    failure: FailureClass | None
    message: str | None
    rewards: dict[str, float]
    trial_dir: Path | None
    sandbox: str = ""
    branch: Branch | None = None

    @classmethod
    def of(cls, task: Path, outcome: Outcome, trial_dir: Path | None) -> SandboxResult:
        return cls(
            task=task,
            reward=outcome.reward,
            trainable=outcome.trainable,
            failure=outcome.failure,
            message=outcome.message,
            rewards=dict(outcome.rewards),
            trial_dir=trial_dir,
        )

    @property
    def training_reward(self) -> float | None:
        """The reward to train on: `reward` where `trainable`, else None (what TRL skips)."""
        return self.reward if self.trainable else None


@dataclass(frozen=True)
class SandboxOptions:
    """How a pool's sandboxes run. `executor`: `local` (containers beside this process) or
    `ray` (on the nodes of the Ray cluster `harbor-hpc ray up` started, or `ray_address` in
    `environment_kwargs`); `environment_kwargs`: our environment's options, as for
    `run_rollouts`; `cache_dir` / `scratch_dir`: where .sif images are and containers write
    (None: harbor-hpc.toml, $HARBOR_HPC_CACHE, $TMPDIR). `trials_dir`: where each sandbox's
    Harbor trial folder is kept (None: a private temporary folder, each trial's removed once
    read). `reward_key`: the reward.json key to train on (None: `reward`, else a lone value).
    `ahead`: sandboxes of a task started ahead once it is opened; `starts`: how many start at
    once; `idle_sec`: a sandbox nobody called for this long is given back."""

    executor: Backend | str = Backend.LOCAL
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    cache_dir: Path | None = None
    scratch_dir: Path | None = None
    trials_dir: Path | None = None
    reward_key: str | None = None
    ahead: int = 0
    starts: int = 4
    idle_sec: float = 600.0


class _Starts:
    """At most `n` sandboxes starting at once, the ones a trainer waits for first."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self, urgent: asyncio.Event) -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (0 if urgent.is_set() else 1, next(self._order), turn))
        if not urgent.is_set():
            # Claimed while it waits: it goes before every sandbox started ahead.
            async def hurry() -> None:
                await urgent.wait()
                if not turn.done():
                    heapq.heappush(self._waiting, (0, next(self._order), turn))

            hurrying = asyncio.create_task(hurry())
            turn.add_done_callback(lambda _: hurrying.cancel())
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # handed a turn as it was cancelled: pass it on
            raise

    def release(self) -> None:
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1


class Sandbox:
    """One task's sandbox (see the module's docstring). Blocking methods for threads, `a...`
    coroutines for event loops; every one safe from any thread or loop."""

    def __init__(
        self,
        pool: SandboxPool,
        task: Task,
        *,
        claimed: bool,
        branch: Branch | None = None,
        restore: dict[str, Any] | None = None,
    ) -> None:
        self.task = task.path
        self.instruction = (task.path / "instruction.md").read_text()
        self.id = uuid.uuid4().hex[:12]
        # Where it was forked from, and the environment kwargs that start it from its parent's
        # snapshot (`Restorable`).
        self.branch = branch
        self._restore = restore or {}
        # The commands it ran (`exec`): the step a fork of it branches at, unless told.
        self.steps = 0
        self._pool = pool
        self._handoff = Handoff()
        HANDOFFS[self.id] = self._handoff
        if claimed:
            self._handoff.claimed.set()
        self._used = time.monotonic()
        self._busy = 0
        self._given_back: str | None = None
        self._result: SandboxResult | None = None
        self._trial_dir: Path | None = None
        self._run = asyncio.create_task(self._lifetime(task), name=f"sandbox {self.id}")

    # ----- on the sandboxes' loop

    async def _lifetime(self, task: Task) -> SandboxResult:
        """Start the trial (in its turn), run it to its end, and read what it came to; cancelled
        (given back), stop it as Harbor stops a cancelled trial."""
        pool = self._pool
        running: asyncio.Task[Any] | None = None
        try:
            await pool._starts.acquire(self._handoff.claimed)
            try:
                trial = await pool._trial(task, self.id, self._restore)
                self._trial_dir = trial.paths.trial_dir
                running = asyncio.create_task(trial.run())
                await asyncio.wait(
                    {running, self._handoff.environment}, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                pool._starts.release()
            self._used = time.monotonic()  # idle from now: a start is not idleness
            result = await running
            read = pool._read(task, trial.paths.trial_dir, result.model_dump(mode="json"))
            return self._named(read)
        except asyncio.CancelledError:
            if running is not None:
                running.cancel()
                with contextlib.suppress(BaseException):
                    await running  # Harbor stops the environment of a cancelled trial
                if self._trial_dir is not None and pool._own_trials:
                    shutil.rmtree(self._trial_dir, ignore_errors=True)
            why = self._given_back or "this process is ending"
            message = f"the sandbox was given back before it was verified: {why}"
            return self._named(
                SandboxResult(
                    task.path, None, False, FailureClass.INFRASTRUCTURE, message, {}, None
                )
            )
        except Exception as exc:  # before Harbor's trial could record it
            name = type(exc).__name__
            failure = failure_class(name, agent_started=False)
            message = short_message(name, str(exc))
            return self._named(SandboxResult(task.path, None, False, failure, message, {}, None))
        finally:
            HANDOFFS.pop(self.id, None)

    def _named(self, result: SandboxResult) -> SandboxResult:
        return dataclasses.replace(result, sandbox=self.id, branch=self.branch)

    async def _environment(self) -> BaseEnvironment:
        """The running environment, once the episode began; SandboxEnded once it is over. A
        start that waits (for a Ray node with room) is said, at once and while it waits."""
        self._handoff.claimed.set()
        said = None
        running = asyncio.ensure_future(self._handoff.running.wait())
        try:
            while not running.done() and not self._run.done():
                await asyncio.wait(
                    {running, self._run},
                    timeout=_WAITING_CHECK_S,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                why = self.waiting
                if why is not None and why != said:
                    log.warning("sandbox of %s: %s", self.task, why)
                    said = why
        finally:
            running.cancel()
        if self._handoff.over.is_set() or self._run.done():
            raise SandboxEnded(await self._over(), self._result)
        return self._handoff.environment.result()

    async def _over(self) -> str:
        """Why calls are refused: what the sandbox came to, or that it is being verified."""
        if self._given_back is not None:
            return f"the sandbox of {self.task} was given back: {self._given_back}"
        if not self._run.done():
            return (
                f"the sandbox of {self.task} is being verified: its episode is over (verify "
                "was called, or the task's [agent] timeout_sec ran out)"
            )
        result = await self._finished()
        said = result.message or "its verifier ran"
        return f"the sandbox of {self.task} has ended: {said}"

    async def _finished(self) -> SandboxResult:
        if self._result is None:
            self._result = await asyncio.shield(self._run)
            self._pool._done(self)
        return self._result

    async def _call[T](self, make: Callable[[BaseEnvironment], Awaitable[T]]) -> T:
        self._busy += 1
        try:
            environment = await self._environment()
            return await make(environment)
        except SandboxEnded:
            raise
        except Exception:
            if self._run.done() or self._handoff.over.is_set():
                raise SandboxEnded(await self._over(), self._result) from None
            raise
        finally:
            self._busy -= 1
            self._used = time.monotonic()

    # ----- the API: coroutines

    async def aexec(
        self,
        command: str,
        *,
        timeout_sec: int | None = None,
        user: str | int | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run `command` in the sandbox as the task's agent user (or `user`), as Harbor's
        `environment.exec`."""

        async def run(environment: BaseEnvironment) -> ExecResult:
            self.steps += 1
            result: ExecResult = await environment.exec(
                command, cwd=cwd, env=env, timeout_sec=timeout_sec, user=user
            )
            return result

        return await run_async(self._call(run))

    async def aupload(self, source: Path | str, target: str) -> None:
        """Copy a file or folder of this machine into the sandbox at `target`."""

        async def put(environment: BaseEnvironment) -> None:
            if Path(source).is_dir():
                await environment.upload_dir(source, target)
            else:
                await environment.upload_file(source, target)

        await run_async(self._call(put))

    async def adownload(self, source: str, target: Path | str, *, folder: bool = False) -> None:
        """Copy the sandbox's file (a folder with `folder`) at `source` to `target` here."""

        async def get(environment: BaseEnvironment) -> None:
            if folder:
                await environment.download_dir(source, target)
            else:
                await environment.download_file(source, target)

        await run_async(self._call(get))

    async def afork(self, count: int, *, step: int | None = None) -> list[Sandbox]:
        """`count` new sandboxes of the task whose files are this one's now: `snapshot`, then
        its `restore(count)`, then its release. Each its own container, written apart from
        this one and from each other, its episode started anew (no process is carried: a
        harness re-opens its shell); each one's result says its `branch`: this sandbox and
        `step` (default: the commands it ran). Returns once they started (or failed: their
        results say how)."""
        if count < 1:
            raise InputError(f"fork({count}): at least 1 sandbox")
        taken = await self.asnapshot(step=step)
        try:
            return await taken.arestore(count)
        finally:
            await taken.arelease()

    async def asnapshot(self, *, step: int | None = None) -> SandboxSnapshot:
        """This sandbox's files now, for `restore` (as often as asked) until `release`: its
        processes stopped while they are copied, then going on. Local and on Ray (restored on
        the node that holds it), where the containers have a root of our own (`harbor-hpc
        doctor`'s `container root`); else refused in one line."""
        at = self.steps if step is None else step
        return await run_async(self._snapshot(at))

    async def _snapshot(self, step: int) -> SandboxSnapshot:
        async def take(environment: BaseEnvironment) -> Restorable:
            if not isinstance(environment, (SingularityEnvironment, RaySingularityEnvironment)):
                raise InputError(
                    f"the sandbox of {self.task} runs on {type(environment).__name__}, which "
                    "has no snapshots"
                )
            try:
                return await environment.restorable(step)
            except SnapshotRefused as exc:
                raise InputError(str(exc)) from None

        taken = await self._call(take)
        snapshot = SandboxSnapshot(self._pool, self._pool._task(self.task), taken, self.id, step)
        self._pool._snapshots.add(snapshot)
        return snapshot

    async def averify(self) -> SandboxResult:
        """End the episode: the task's verifier runs as Harbor's trial runs it, the sandbox
        stops, and its result comes back (the same on every later call)."""
        return await run_async(self._verify())

    async def _verify(self) -> SandboxResult:
        self._handoff.claimed.set()
        self._handoff.done.set()
        return await self._finished()

    async def aclose(self) -> SandboxResult:
        """Give the sandbox back unverified (where it was not verified yet): its container
        stops. Its result then says it was given back (not trainable)."""
        return await run_async(self._close("closed by its owner"))

    def _give_back(self, why: str) -> None:
        """Stop it unverified (its result says why), unless it is being verified."""
        if not self._run.done() and not self._handoff.done.is_set():
            self._given_back = why
            self._run.cancel()

    async def _close(self, why: str) -> SandboxResult:
        self._give_back(why)
        return await self._finished()

    async def aenvironment(self) -> BaseEnvironment:
        """The sandbox's live Harbor environment, for a harness that calls it itself; on the
        sandboxes' loop only (await it from a coroutine `run_async` or `run_sync` runs)."""
        if not on_sandbox_loop():
            raise RuntimeError("aenvironment() is the sandboxes' loop's: run it with run_sync")
        return await self._environment()

    @property
    def waiting(self) -> str | None:
        """What the sandbox's start waits for, where it waits (a Ray node with room), else None."""
        return waiting_for(self._trial_dir) if self._trial_dir is not None else None

    @property
    def ready(self) -> bool:
        """Whether its container is up (a call would not wait for the start)."""
        return self._handoff.environment.done() and not self._run.done()

    # ----- the API: blocking

    def exec(
        self,
        command: str,
        *,
        timeout_sec: int | None = None,
        user: str | int | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        return run_sync(self.aexec(command, timeout_sec=timeout_sec, user=user, cwd=cwd, env=env))

    def upload(self, source: Path | str, target: str) -> None:
        run_sync(self.aupload(source, target))

    def download(self, source: str, target: Path | str, *, folder: bool = False) -> None:
        run_sync(self.adownload(source, target, folder=folder))

    def fork(self, count: int, *, step: int | None = None) -> list[Sandbox]:
        return run_sync(self.afork(count, step=step))

    def snapshot(self, *, step: int | None = None) -> SandboxSnapshot:
        return run_sync(self.asnapshot(step=step))

    def verify(self) -> SandboxResult:
        return run_sync(self.averify())

    def close(self) -> SandboxResult:
        if self._result is not None:  # verified, or closed with its pool
            return self._result
        return run_sync(self.aclose())


class SandboxSnapshot:
    """A sandbox's files at one step (`Sandbox.snapshot`): `restore(n)` opens n sandboxes of
    its task from them, as often as asked, each result's `branch` naming the sandbox it was
    taken of and the step; held on its node until `release()` or its pool's close."""

    def __init__(
        self, pool: SandboxPool, task: Task, taken: Restorable, sandbox: str, step: int
    ) -> None:
        self.task = task.path
        self.branch = Branch(parent=sandbox, step=step)
        self._pool = pool
        self._of = task
        self._taken: Restorable | None = taken

    async def arestore(self, count: int = 1) -> list[Sandbox]:
        """`count` sandboxes started from it, once they started (or failed: their results
        say how)."""
        if count < 1:
            raise InputError(f"restore({count}): at least 1 sandbox")
        return await run_async(self._restore(count))

    async def _restore(self, count: int) -> list[Sandbox]:
        if self._taken is None:
            raise InputError(f"this snapshot of {self.task} was released: take another")
        if self._pool._closed:
            raise InputError("this SandboxPool is closed: open sandboxes from a new one")
        children = [
            self._pool._new(self._of, claimed=True, branch=self.branch, restore=self._taken.kwargs)
            for _ in range(count)
        ]
        # Started (each holding the copy itself), or failed, before the caller may let go.
        await asyncio.gather(*(child._environment() for child in children), return_exceptions=True)
        return children

    async def arelease(self) -> None:
        """Let go of it: its copy goes once no sandbox restored from it runs either."""
        await run_async(self._release())

    async def _release(self) -> None:
        taken, self._taken = self._taken, None
        self._pool._snapshots.discard(self)
        if taken is not None:
            await taken.release()

    def restore(self, count: int = 1) -> list[Sandbox]:
        return run_sync(self.arestore(count))

    def release(self) -> None:
        run_sync(self.arelease())


# Every pool not closed yet, closed when the process exits.
_open_pools: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


class SandboxPool:
    """Sandboxes for tasks (see the module's docstring); its settings checked once, here."""

    def __init__(self, options: SandboxOptions | None = None) -> None:
        self.options = options = options or SandboxOptions()
        with python_words():
            try:
                backend = Backend(options.executor)
            except ValueError:
                raise InputError(
                    f"executor={options.executor!r}: sandboxes run `local` or on `ray`"
                ) from None
            if backend not in (Backend.LOCAL, Backend.RAY):
                raise InputError(
                    f"executor={options.executor!r}: sandboxes run `local` or on `ray` (a "
                    "trainer's sandbox lives as long as its episode: not a Slurm job's element)"
                )
            for name, value, low in (("ahead", options.ahead, 0), ("starts", options.starts, 1)):
                if value < low:
                    raise InputError(f"{name}={value}: at least {low}")
            if not options.idle_sec > 0:
                raise InputError(f"idle_sec={options.idle_sec}: a number of seconds above 0")
            self._environment = backend.environment
            self._kwargs = placed(
                self._environment,
                options.environment_kwargs,
                cache_dir=options.cache_dir,
                scratch_dir=options.scratch_dir,
            )
            found = check_environment(self._environment, self._kwargs)
            preflight(found, self._kwargs, here=backend is Backend.LOCAL)
        # Harbor's trial (and the model clients it imports: seconds) here, not on the loop.
        import harbor.trial.trial  # noqa: F401

        self._own_trials = options.trials_dir is None
        trials = options.trials_dir or Path(tempfile.mkdtemp(prefix="harbor-hpc-sandboxes-"))
        try:
            trials.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"trials_dir={trials}: cannot make it ({exc.strerror})") from None
        self.trials_dir = trials
        self._tasks: dict[Path, Task] = {}
        self._tasks_lock = threading.Lock()
        self._spares: dict[Path, list[Sandbox]] = {}
        self._open: set[Sandbox] = set()
        self._snapshots: set[SandboxSnapshot] = set()
        self._closed = False
        run_sync(self._begin())
        _open_pools.add(self)

    async def _begin(self) -> None:
        self._starts = _Starts(self.options.starts)
        self._reaper = asyncio.create_task(self._give_back_idle())

    def _task(self, task_dir: Path | str) -> Task:
        """The task at `task_dir`, read and checked once (one line naming what is wrong)."""
        path = Path(task_dir).expanduser().absolute()
        with self._tasks_lock:
            known = self._tasks.get(path)
        if known is not None:
            return known
        if not (path / "task.toml").is_file():
            raise InputError(f"{task_dir}: no task.toml there (a task is a folder with one)")
        found = load_task(path.parent, path, require_dockerfile=False)
        if isinstance(found, TaskProblem):
            raise InputError(f"{task_dir}: {found.message}")
        problem = verifier_problem(found)
        if problem is not None:
            raise InputError(problem)
        with self._tasks_lock:
            self._tasks[path] = found
        return found

    # ----- on the sandboxes' loop

    async def _trial(self, task: Task, sandbox: str, restore: dict[str, Any]) -> Trial:
        from harbor.models.trial.config import (
            AgentConfig,
            EnvironmentConfig,
            TaskConfig,
            TrialConfig,
        )
        from harbor.trial.trial import Trial

        from harbor_hpc.slurm.secrets import redact_secrets_only

        config = TrialConfig(
            task=TaskConfig(path=task.path),
            trial_name=f"{task.path.name[:40]}__{sandbox}",
            trials_dir=self.trials_dir,
            agent=AgentConfig(import_path=AGENT, kwargs={"sandbox": sandbox}),
            environment=EnvironmentConfig(
                import_path=self._environment,
                kwargs={**self._kwargs, **restore},
            ),
            override_error_policy=error_policy_overrides(),
        )
        redact_secrets_only()
        return await Trial.create(config)

    def _read(self, task: Task, trial_dir: Path, result: dict[str, Any]) -> SandboxResult:
        seal(trial_dir, group_readable=False)
        outcome = outcome_of_trial(trial_dir, result, reward_key=self.options.reward_key)
        if self._own_trials:
            shutil.rmtree(trial_dir, ignore_errors=True)
        return SandboxResult.of(task.path, outcome, None if self._own_trials else trial_dir)

    def _done(self, sandbox: Sandbox) -> None:
        self._open.discard(sandbox)

    def _new(
        self,
        task: Task,
        *,
        claimed: bool,
        branch: Branch | None = None,
        restore: dict[str, Any] | None = None,
    ) -> Sandbox:
        sandbox = Sandbox(self, task, claimed=claimed, branch=branch, restore=restore)
        self._open.add(sandbox)
        return sandbox

    async def _take(self, task: Task) -> Sandbox:
        if self._closed:
            raise InputError("this SandboxPool is closed: open sandboxes from a new one")
        spares = self._spares.setdefault(task.path, [])
        while spares:
            spare = spares.pop(0)
            if not spare._run.done():
                spare._handoff.claimed.set()
                spare._used = time.monotonic()
                break
        else:
            # A task opened with none ahead: its next `ahead` rollouts (a GRPO group's) start
            # now. One taken from those ahead starts no other: the group is already under way.
            spare = self._new(task, claimed=True)
            self._ahead(task, self.options.ahead)
        return spare

    def _ahead(self, task: Task, count: int) -> None:
        spares = self._spares.setdefault(task.path, [])
        spares[:] = [spare for spare in spares if not spare._run.done()]
        while len(spares) < count:
            spares.append(self._new(task, claimed=False))

    async def _give_back_idle(self) -> None:
        while True:
            await asyncio.sleep(min(_IDLE_CHECK_S, self.options.idle_sec / 4))
            now = time.monotonic()
            for sandbox in list(self._open):
                idle = now - sandbox._used
                if (
                    idle < self.options.idle_sec
                    or sandbox._busy
                    or sandbox._handoff.done.is_set()
                    or not sandbox._handoff.environment.done()  # starting
                ):
                    continue
                log.info("sandbox of %s idle for %.0f s: given back", sandbox.task, idle)
                for spares in self._spares.values():
                    if sandbox in spares:
                        spares.remove(sandbox)
                sandbox._give_back(f"nobody called it for {self.options.idle_sec:g} s (idle_sec)")

    async def _close_all(self) -> None:
        self._closed = True
        self._reaper.cancel()
        self._spares.clear()
        await asyncio.gather(
            *(snapshot._release() for snapshot in list(self._snapshots)),
            *(sandbox._close("its pool was closed") for sandbox in list(self._open)),
            return_exceptions=True,
        )

    # ----- the API

    def open(self, task_dir: Path | str) -> Sandbox:
        """A sandbox of the task at `task_dir`, returned at once (its start goes on)."""
        task = self._task(task_dir)
        return run_sync(self._take(task))

    async def aopen(self, task_dir: Path | str) -> Sandbox:
        task = await asyncio.to_thread(self._task, task_dir)
        return await run_async(self._take(task))

    def prefetch(self, task_dirs: list[Path | str], count: int = 1) -> None:
        """Start `count` sandboxes of each task ahead, for `open` to take."""
        tasks = [self._task(task_dir) for task_dir in task_dirs]

        async def start() -> None:
            for task in tasks:
                self._ahead(task, max(count, self.options.ahead))

        run_sync(start())

    def close(self) -> None:
        """Give back every sandbox still open (their containers stop), and the pool's folder
        where it made one."""
        if not self._closed:
            run_sync(self._close_all())
            _open_pools.discard(self)
        if self._own_trials:
            shutil.rmtree(self.trials_dir, ignore_errors=True)

    async def aclose(self) -> None:
        await run_async(self._close_all())
        _open_pools.discard(self)
        if self._own_trials:
            await asyncio.to_thread(shutil.rmtree, self.trials_dir, True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _close_pools() -> None:
    """At exit, every sandbox still open is stopped (its container with it)."""
    for pool in list(_open_pools):
        with contextlib.suppress(Exception):
            run_sync(pool._close_all(), timeout=60)
        if pool._own_trials:
            shutil.rmtree(pool.trials_dir, ignore_errors=True)


# Before the interpreter's exit shuts down the thread pools the environments' stop runs in
# (`asyncio.to_thread`): where concurrent.futures registers that shutdown, run after ours.
threading._register_atexit(_close_pools)  # type: ignore[attr-defined]
