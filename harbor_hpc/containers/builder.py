"""`build --builder apptainer`: each build context built from its Dockerfile straight into the
.sif store, as an ordinary user, without Docker or a registry.

For each planned image (one per distinct context, `images/build.py`):

1. `env-<context hash>.sif` already in the store (`is_ready`): nothing to do.
2. The Dockerfile is read with the build args; what cannot be translated (images/definition.py)
   fails this context only, naming the file, line and instruction.
3. Each image the stages start FROM or copy from enters the store as `convert` puts it there
   (`ensure_sif`: pinned by digest, APPTAINER_DOCKER_USERNAME/PASSWORD, --nohttps); a `.sif`
   named instead (through a build arg, say) is used as it is. Their configs start the stages'
   ENV, WORKDIR, USER..., so the Dockerfile is read again with them.
4. The definition, the staged context files and Apptainer's own scratch go into a private folder
   on local scratch space (`--scratch-dir`, APPTAINER_TMPDIR, else the system's); the
   definition is also kept beside the build log.
5. `apptainer build --fakeroot`: root in a user namespace (with the user's /etc/subuid range,
   so RUN can chown to the image's users: `doctor --role build` checks it). A failed RUN is
   named with its line and exit code, and the log.
6. The final stage's config is written into the .sif (`oci-config.json`, containers/sif.py),
   which is checked to run and moved into the store with its sha256 (`store_built`), recorded in
   the manifest: `rewrite --sif`, `convert` and `submit` take it as a converted image.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from harbor_hpc.containers.sif import raw_config, write_image_config
from harbor_hpc.containers.store import (
    CONVERT_TIMEOUT_S,
    ensure_sif,
    is_ready,
    recorded_sha256,
    sif_file,
    store_built,
)
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import atomic_write_text
from harbor_hpc.core.proc import run
from harbor_hpc.core.scratch import PrivateDir
from harbor_hpc.images.build import (
    Builder,
    BuildPlan,
    ImageAction,
    ImageFailed,
    PlannedImage,
    one_line,
)
from harbor_hpc.images.context import DOCKERFILE
from harbor_hpc.images.definition import DefinitionError, write_definition
from harbor_hpc.images.dockerfile import Dockerfile, Run, read_dockerfile
from harbor_hpc.images.engine import BuilderKind
from harbor_hpc.runtimes.apptainer import build_command, find_apptainer
from harbor_hpc.tasks.manifest import ImageRecord

# What the build's %post prints when a step fails (templates/apptainer_build.sh).
_FAILED = re.compile(r"^harbor-hpc: FAILED: .*$", re.M)
_AT_LINE = re.compile(r"Dockerfile line (\d+): (.*)")
_RUN_FAILED = re.compile(r"RUN returned a non-zero code: (\d+)")
_UNTRANSLATABLE = "cannot be built by Apptainer here (build this context with --builder docker)"


def scratch_dir(chosen: Path | None = None) -> Path:
    """Where builds unpack images and stage files: `--scratch-dir`, else APPTAINER_TMPDIR (as
    Apptainer itself), else the system's temporary folder ($TMPDIR)."""
    folder = chosen or os.environ.get("APPTAINER_TMPDIR") or tempfile.gettempdir()
    return Path(folder).expanduser().absolute()


def sif_name(context: str) -> str:
    """The store's file for a context built here: there is no registry digest to name it by."""
    return f"env-{context}.sif"


def _base_hint(dockerfile: Dockerfile, text: str, ref: str) -> str | None:
    """How to name another base image, when the FROM lines that give `ref` take it from build
    args (`FROM ${BASE_IMAGE}`): offline machines name one they reach."""
    lines = text.splitlines()
    froms = [lines[s.line - 1] for s in dockerfile.stages if s.base == ref and s.line <= len(lines)]
    names = sorted({n for line in froms for n in re.findall(r"\$\{?(\w+)", line)})
    if not names:
        return None
    return (
        f"name an image this machine can pull with --build-arg {names[0]}=REGISTRY/IMAGE:TAG "
        "(--nohttps for a plain-HTTP registry), or a .sif file"
    )


class ApptainerBuilder(Builder):
    """Builds with `apptainer build --fakeroot` into the store `store`."""

    kind = BuilderKind.APPTAINER

    def __init__(
        self,
        store: Path,
        *,
        build_args: dict[str, str],
        nohttps: bool | None = None,
        scratch: Path | None = None,
    ) -> None:
        self.store = store.expanduser().absolute()
        self.build_args = build_args
        self.nohttps = nohttps
        self.scratch = scratch_dir(scratch)

    @property
    def destination(self) -> str:
        return str(self.store)

    def prepare(self, plan: BuildPlan) -> None:
        self.check_here()

    def check_here(self) -> None:
        """Raise when this machine cannot build: no Apptainer, a store or scratch folder it
        cannot make (also where a Slurm element builds, harbor_hpc/slurm/build.py)."""
        find_apptainer()  # raises, with the fix, when there is none
        for folder, what in ((self.store, "the .sif store"), (self.scratch, "--scratch-dir")):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise HarborHpcError(
                    f"{folder}: cannot make {what}: {exc.strerror}",
                    hint="use a folder you can write (--cache-dir, --scratch-dir)",
                ) from None

    def make(
        self, image: PlannedImage, record: ImageRecord, log: Path, progress: Callable[[str], None]
    ) -> ImageAction:
        final = self.store / sif_name(image.context)
        record.sif = record.sif_sha256 = None
        if is_ready(final):
            record.sif, record.sif_sha256 = str(final), recorded_sha256(final)
            return ImageAction.IN_STORE
        dockerfile_path = image.build_dir / DOCKERFILE
        text = dockerfile_path.read_text(errors="replace")
        bases = self._bases(read_dockerfile(text, self.build_args), text, image, progress)
        configs = {ref: raw_config(sif) or {} for ref, sif in bases.items()}
        dockerfile = read_dockerfile(text, self.build_args, configs)
        problems = [*dockerfile.problems, *(p for s in dockerfile.stages for p in s.problems)]
        if problems:
            shown = "; ".join(f"line {p.line}: {p.text}" for p in problems)
            raise ImageFailed(f"{dockerfile_path}: {shown}: {_UNTRANSLATABLE}")
        private = PrivateDir("harbor-hpc-build-", self.scratch, name=f"{image.name}-")
        work = private.path
        try:
            try:
                definition = write_definition(dockerfile, image.build_dir, work / "ctx", bases)
            except DefinitionError as exc:
                raise ImageFailed(f"{dockerfile_path} {exc}: {_UNTRANSLATABLE}") from None
            recipe = log.with_suffix(".def")
            atomic_write_text(recipe, definition.text)
            built = work / "image.sif"
            progress("building with apptainer")
            self._build(recipe, built, work, dockerfile, log)
            write_image_config(built, definition.config)
            progress("checking and storing")
            origin = f"harbor-hpc build --builder apptainer {image.build_dir}"
            record.sif_sha256 = store_built(built, final, origin)
            record.sif = str(final)
        finally:
            private.remove()
        return ImageAction.BUILT_SIF

    def _bases(
        self,
        dockerfile: Dockerfile,
        text: str,
        image: PlannedImage,
        progress: Callable[[str], None],
    ) -> dict[str, Path]:
        """Every image `dockerfile` (read from `text`) starts FROM or copies from, as a .sif."""
        bases = {}
        for ref in dockerfile.images():
            own = sif_file(ref, image.build_dir)
            if own is not None:
                if not own.is_file():
                    raise ImageFailed(f"FROM {ref}: no such .sif file")
                bases[ref] = own
                continue
            progress(f"converting {ref}")
            try:
                bases[ref] = ensure_sif(ref, self.store, nohttps=self.nohttps)
            except HarborHpcError as exc:
                raise ImageFailed(
                    f"FROM {ref}: cannot be pulled here ({exc.message}); "
                    f"{_base_hint(dockerfile, text, ref) or exc.hint or 'check the reference'}"
                ) from None
        return bases

    def _build(
        self, recipe: Path, built: Path, work: Path, dockerfile: Dockerfile, log: Path
    ) -> None:
        """`apptainer build --fakeroot`, its output (in order) into `log`; a failure named by
        the step that failed."""
        scratch = work / "apptainer"
        (scratch / "cache").mkdir(parents=True)
        env = dict(os.environ)
        for prefix in ("APPTAINER", "SINGULARITY"):
            env[f"{prefix}_TMPDIR"] = str(scratch)
            env[f"{prefix}_CACHEDIR"] = str(scratch / "cache")
        command = build_command("--fakeroot", str(built), str(recipe))
        # One stream, in the order Apptainer wrote it: the log reads as the build went.
        done = run(
            ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *command],
            timeout=CONVERT_TIMEOUT_S,
            env=env,
        )
        atomic_write_text(log, done.stdout)
        if done.ok and built.is_file():
            return
        failure = _failure(done.stdout, dockerfile) or done.why()
        raise ImageFailed(f"build failed: {failure} (log: {log})")


def _failure(output: str, dockerfile: Dockerfile) -> str | None:
    """What failed, as the build's %post said it (the step's line and instruction, the RUN's
    exit code, and any reason given before); else Apptainer's own complaint."""
    said: list[str] = [
        line.removeprefix("harbor-hpc: FAILED: ") for line in _FAILED.findall(output)
    ]
    if said:
        runs = {s.line: s.text for st in dockerfile.stages for s in st.steps if isinstance(s, Run)}
        last = _AT_LINE.match(said[-1])
        text = said[-1]
        if last is not None:
            number, what = int(last.group(1)), last.group(2)
            code = _RUN_FAILED.fullmatch(what)
            if code is not None:
                what = f"`{runs.get(number, 'RUN')}` returned a non-zero code: {code.group(1)}"
            text = f"Dockerfile line {number}: {what}"
        reasons = [line for line in said[:-1] if not _AT_LINE.match(line)]
        return text + (f" ({'; '.join(reasons)})" if reasons else "")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", output)
    fatal = [line for line in plain.splitlines() if line.startswith(("FATAL", "ERROR"))]
    return one_line(fatal[-1]) if fatal else None
