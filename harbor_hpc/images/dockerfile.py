"""Just enough of a Dockerfile parser to see which local files its final image copies in.

`build` uses it to refuse a COPY/ADD that reaches outside the build context (Docker cannot send
such a file, and identical contexts would then not mean identical images), and `setup-sh
--replay-copy` uses it to repeat those copies inside a shared base image. Only the final stage
matters, plus the stages it is built `FROM`; `COPY --from=` and heredocs are reported, not
replayed. Variables are expanded from the build args given (`--build-arg`) for the `ARG`s that
take them, else from the Dockerfile's own `ARG`/`ENV` defaults; the `ARG` names are the build
args that can change the image, so only those count in its content hash. The package's one
Dockerfile reader: the runtime takes WORKDIR, ENV and ENTRYPOINT from the image itself.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_VARIABLE = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::?[-+][^}]*)?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)
# A word of an ENV/ARG line: quoted parts kept whole.
_WORDS = re.compile(r'(?:[^\s"\']+|"[^"]*"|\'[^\']*\')+')
_KNOWN_COPY_FLAGS = ("--chown", "--chmod", "--link", "--from")


class DockerfileError(ValueError):
    """A Dockerfile instruction harbor-hpc cannot follow; the message names it."""


@dataclass(frozen=True)
class Copy:
    """One `COPY`/`ADD` of local files, sources relative to the context, dest absolute."""

    instruction: str
    sources: tuple[str, ...]
    dest: str
    dest_is_dir: bool
    chown: str | None = None
    chmod: str | None = None

    @property
    def extracts_archives(self) -> bool:
        return self.instruction == "ADD"


@dataclass
class _Stage:
    base: str
    name: str | None
    copies: list[Copy] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FinalImageCopies:
    copies: list[Copy]
    problems: list[str]


def logical_lines(text: str) -> list[str]:
    """Instructions with their line continuations joined and comment lines dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#"):
            continue
        if not stripped and not pending:
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        line = (pending + stripped).strip()
        pending = ""
        if line:
            lines.append(line)
    if pending.strip():
        lines.append(pending.strip())
    return lines


def _expand(value: str, variables: dict[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        name = match.group("braced") or match.group("bare")
        if name not in variables:
            raise DockerfileError(f"${name} has no value in the Dockerfile")
        return variables[name]

    return _VARIABLE.sub(substitute, value)


def _split_arguments(rest: str) -> list[str]:
    if rest.startswith("["):
        try:
            parsed = json.loads(rest)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
            return parsed
    return rest.split()


def _parse_assignments(rest: str) -> dict[str, str]:
    """`ENV A=1 B="x y"`, `ENV A 1`."""
    words = _WORDS.findall(rest)
    if len(words) >= 2 and "=" not in words[0]:
        return {words[0]: rest.split(None, 1)[1].strip()}
    values = {}
    for word in words:
        if "=" in word:
            key, value = word.split("=", 1)
            values[key] = value.strip("\"'")
    return values


def _arg_values(
    rest: str, variables: dict[str, str], build_args: Mapping[str, str]
) -> dict[str, str]:
    """`ARG A=1 B`: a given build arg wins over the default (taken as is, as Docker does); an
    `ARG` with neither is left out. Raises DockerfileError for a default that cannot expand."""
    values = {}
    for word in _WORDS.findall(rest):
        name, has_default, default = word.partition("=")
        if name in build_args:
            values[name] = build_args[name]
        elif has_default:
            values[name] = _expand(default.strip("\"'"), variables)
    return values


def _parse_copy(instruction: str, rest: str, workdir: str, variables: dict[str, str]) -> Copy | str:
    """A Copy, or a problem (one line) when the instruction cannot be replayed."""
    if rest.startswith("<<"):
        return f"{instruction} with a heredoc"
    words = _split_arguments(rest) if not rest.startswith("--") else rest.split()
    flags: dict[str, str] = {}
    while words and words[0].startswith("--"):
        flag, _, value = words.pop(0).partition("=")
        if flag not in _KNOWN_COPY_FLAGS:
            return f"{instruction} {flag}"
        flags[flag] = value
    if words and words[0].startswith("["):
        words = _split_arguments(" ".join(words))
    if "--from" in flags:
        return f"{instruction} --from={flags['--from']}"
    if len(words) < 2:
        return f"{instruction} {rest}: needs a source and a destination"
    try:
        sources = [_expand(source, variables) for source in words[:-1]]
        dest = _expand(words[-1], variables)
    except DockerfileError as exc:
        return f"{instruction} {rest}: {exc}"
    for source in sources:
        if re.match(r"^[a-z][a-z0-9+.-]*://", source) or source.startswith("git@"):
            return f"{instruction} {source}: a remote source"
    dest_is_dir = dest.endswith("/") or len(sources) > 1 or any(_is_glob(s) for s in sources)
    absolute = posixpath.normpath(posixpath.join(workdir, dest))
    return Copy(
        instruction=instruction,
        sources=tuple(sources),
        dest=absolute,
        dest_is_dir=dest_is_dir,
        chown=flags.get("--chown"),
        chmod=flags.get("--chmod"),
    )


def _is_glob(source: str) -> bool:
    return any(char in source for char in "*?[")


@dataclass(frozen=True)
class Dockerfile:
    """What harbor-hpc reads of a Dockerfile, with the build args it is built with."""

    # The local-file copies that end up in the final image, in order, and what cannot be
    # replayed.
    final: FinalImageCopies
    # `COPY`/`ADD` sources of any stage that point above the build context.
    outside: list[str]
    # The names every `ARG` declares: the build args that can change the image.
    args: set[str]


def read_dockerfile(text: str, build_args: Mapping[str, str] | None = None) -> Dockerfile:
    """Read a Dockerfile's stages, expanding variables as a build with `build_args` would."""
    given = build_args or {}
    stages: list[_Stage] = []
    outside: list[str] = []
    declared: set[str] = set()
    variables: dict[str, str] = {}
    workdir = "/"
    for line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "FROM":
            words = [word for word in rest.split() if not word.startswith("--")]
            base = words[0] if words else ""
            name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
            stages.append(_Stage(base, name))
            workdir = "/"
            continue
        if keyword == "ARG":
            declared.update(_arg_names(rest))
            # A default that cannot be expanded leaves the line's ARGs without a value.
            with contextlib.suppress(DockerfileError):
                variables.update(_arg_values(rest, variables, given))
            continue
        if keyword in ("COPY", "ADD") and "--from" not in rest:
            outside.extend(_outside(keyword, rest, variables))
        if not stages:
            continue
        stage = stages[-1]
        if keyword == "ENV":
            try:
                values = _parse_assignments(rest)
                variables.update({key: _expand(v, variables) for key, v in values.items()})
            except DockerfileError:
                continue
        elif keyword == "WORKDIR":
            try:
                workdir = posixpath.normpath(posixpath.join(workdir, _expand(rest, variables)))
            except DockerfileError as exc:
                stage.problems.append(f"WORKDIR {rest}: {exc}")
        elif keyword in ("COPY", "ADD"):
            parsed = _parse_copy(keyword, rest, workdir, variables)
            if isinstance(parsed, Copy):
                stage.copies.append(parsed)
            else:
                stage.problems.append(parsed)
    if not stages:
        final = FinalImageCopies([], ["no FROM instruction"])
    else:
        final = _collect(stages, len(stages) - 1)
    return Dockerfile(final, outside, declared)


def _arg_names(rest: str) -> list[str]:
    return [word.split("=", 1)[0] for word in _WORDS.findall(rest)]


def _outside(keyword: str, rest: str, variables: dict[str, str]) -> list[str]:
    """The sources of one `COPY`/`ADD` that point above the context, expanded where they can
    be (a source that cannot is checked as written)."""
    words = [word for word in _split_arguments(rest) if not word.startswith("--")]
    found = []
    for word in words[:-1]:
        try:
            source = _expand(word, variables)
        except DockerfileError:
            source = word
        if escapes_context(source):
            found.append(f"{keyword} {source}")
    return found


def _collect(stages: list[_Stage], index: int) -> FinalImageCopies:
    """A stage's copies, after those of the earlier stage it is built FROM (if any)."""
    stage = stages[index]
    earlier = {s.name.lower(): i for i, s in enumerate(stages[:index]) if s.name}
    parent = earlier.get(stage.base.lower())
    if parent is None:
        return FinalImageCopies(list(stage.copies), list(stage.problems))
    inherited = _collect(stages, parent)
    return FinalImageCopies(inherited.copies + stage.copies, inherited.problems + stage.problems)


def escapes_context(source: str) -> bool:
    """True when a COPY/ADD source names a path above the build context."""
    return posixpath.normpath(posixpath.join("ctx", source)).split("/")[0] != "ctx"
