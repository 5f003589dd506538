"""Slurm commands that answer what a test says, for testing Slurm logic without Slurm.

`tests/support/fake_slurm/` holds one script linked as sbatch, squeue, sinfo, scontrol and
scancel; the `fake_slurm` fixture (tests/conftest.py) puts that folder first on PATH, points the
script at a folder of answers that `FakeSlurm.answer` writes and SLURM_CONF at a cluster of the
test's own. Outputs worth keeping verbatim, recorded from the CI's real Slurm 22.05, are in
`recorded/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BIN = Path(__file__).with_name("fake_slurm")
RECORDED = BIN / "recorded"

# What Slurm 22.05's sbatch says when it refuses a partition, and when no controller answers.
SBATCH_BAD_PARTITION = (
    "sbatch: error: invalid partition specified: {partition}\n"
    "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
)
SBATCH_UNREACHABLE = (
    "sbatch: error: Batch job submission failed: Unable to contact slurm controller "
    "(connect failure)\n"
)


@dataclass(frozen=True)
class FakeSlurm:
    state: Path

    def answer(
        self,
        command: str,
        stdout: str = "",
        *,
        stderr: str = "",
        returncode: int = 0,
        hang_s: float | None = None,
        call: int | None = None,
    ) -> None:
        """What `command` prints and exits with from now on (with `call`, only its call of that
        number, counting from 1); with `hang_s`, it only sleeps."""
        self.state.mkdir(parents=True, exist_ok=True)
        answers = {"out": stdout, "err": stderr, "rc": str(returncode)}
        if hang_s is not None:
            answers["hang"] = f"{hang_s:g}"
        name = command if call is None else f"{command}.{call}"
        for kind in ("out", "err", "rc", "hang"):
            path = self.state / f"{name}.{kind}"
            if kind in answers:
                path.write_text(answers[kind])
            else:
                path.unlink(missing_ok=True)

    def calls(self, command: str) -> list[list[str]]:
        """The arguments of every call of `command` so far, oldest first."""
        log = self.state / "calls.log"
        lines = log.read_text().splitlines() if log.is_file() else []
        return [line.split()[1:] for line in lines if line.split()[0] == command]

    def sbatch_scripts(self) -> list[str]:
        """The script of every sbatch call so far, oldest first, as it was when given."""
        count = len(self.calls("sbatch"))
        return [(self.state / f"sbatch-{n}.sh").read_text() for n in range(1, count + 1)]
