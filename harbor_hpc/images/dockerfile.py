"""The project's one Dockerfile reader: every stage's instructions in order, as Docker builds them.

Three readers use it. Planning (`build`) refuses a COPY/ADD that reaches outside the build context
(`outside`: Docker cannot send such a file, and identical contexts would then not mean identical
images) and hashes only the build args that can change the image (`args`, the names every `ARG`
declares). The Apptainer builder (images/definition.py) replays `stages`: each stage's RUN,
COPY/ADD and WORKDIR in order, every RUN with the environment, working directory, user and shell
Docker gives it, and each stage's image config (ENV, WORKDIR, USER, ENTRYPOINT, CMD, ...) as
Docker writes it. `setup-sh --replay-copy` repeats the local-file copies of the final image
(`final`: the last stage and the stages it is built FROM; `COPY --from` and heredocs are named,
not replayed).

Words are read as Docker's shell lexer reads them (quotes, backslash escapes, `$VAR`, `${VAR}`,
`${VAR:-word}`, `${VAR:+word}`), with the values Docker would have: a given build arg
(`--build-arg`) for an `ARG` that declares it, else the `ARG`'s default; `ENV`s; and, when the
caller has them (`base_configs`), the base images' own config, so that `ENV PATH=/opt/bin:$PATH`
means what it means in Docker. Without base configs a variable with no value is a problem to
name; with them it is empty, as in Docker. ARGs are scoped as Docker scopes them: those before
the first FROM reach FROM lines, and a stage that declares one again; a stage's own end at the
next FROM. A stage built FROM an earlier stage starts from that stage's config and WORKDIR.

What cannot be replayed is named with its line (`Stage.problems`): heredocs, RUN flags
(`--mount`, `--network`, ...), COPY/ADD flags other than --chown/--chmod/--link/--from, remote
sources, words that do not parse, instructions Docker does not know. MAINTAINER changes nothing
a task runs and is skipped; ONBUILD and HEALTHCHECK (which a compose service waited for as
`service_healthy` runs) are recorded in the config, as Docker does.
"""

from __future__ import annotations

import copy as copying
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# What Docker puts on PATH when the image's config sets none, and the shell of shell-form RUN,
# CMD and ENTRYPOINT until a SHELL instruction changes it.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_SHELL = ("/bin/sh", "-c")
SCRATCH = "scratch"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A heredoc opener (`<<EOF`, `<<-"EOF"`), not a here-string (`<<<`); as BuildKit, no space.
_HEREDOC = re.compile(r"(?<!<)<<(-?)([\"']?)([A-Za-z_][A-Za-z0-9_]*)\2")
_KNOWN_COPY_FLAGS = ("--chown", "--chmod", "--link", "--from")
_SKIPPED = ("MAINTAINER",)
# HEALTHCHECK's options, as Docker records them in the config (nanoseconds, a count).
_HEALTH_OPTIONS = {
    "interval": "Interval",
    "timeout": "Timeout",
    "start-period": "StartPeriod",
    "start-interval": "StartInterval",
    "retries": "Retries",
}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|ms|s|m|h)")
_NANOSECONDS = {"ns": 1, "us": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}
_COPIES = ("COPY", "ADD")


class DockerfileError(ValueError):
    """A Dockerfile instruction harbor-hpc cannot follow; the message names it."""


@dataclass(frozen=True)
class Problem:
    """An instruction that cannot be replayed: its line, its keyword and why (one line)."""

    line: int
    keyword: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.text}"


@dataclass(frozen=True)
class Copy:
    """One `COPY`/`ADD`: sources (relative to the context, or paths in the `from_stage` stage
    or image), dest absolute."""

    instruction: str
    sources: tuple[str, ...]
    dest: str
    # Docker's reading of the destination as a folder: a trailing slash, several sources, or a
    # glob (setup-sh's rule; the builder looks at what a glob matches).
    dest_is_dir: bool
    chown: str | None = None
    chmod: str | None = None
    # `--from=`: an earlier stage's name or index, or an image.
    from_stage: str | None = None
    line: int = 0
    # The destination was written as a folder (`dir/`, `.`): what Docker decides by.
    dest_slash: bool = False

    @property
    def extracts_archives(self) -> bool:
        return self.instruction == "ADD"


@dataclass(frozen=True)
class Run:
    """One RUN, with what Docker runs it with: `argv` (the stage's SHELL plus the command, or the
    exec form as written), the environment (ENV, then the ARGs in scope; PATH's default when
    the config has none), the working directory and the user."""

    line: int
    text: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    workdir: str
    user: str


@dataclass(frozen=True)
class Workdir:
    """A WORKDIR: Docker creates the folder there and then."""

    line: int
    path: str


Step = Run | Copy | Workdir


@dataclass
class Stage:
    """One `FROM` and what follows it. `base` is as expanded: an image reference, `scratch`, a
    .sif path, or the name of the earlier stage (`parent`) it is built from."""

    index: int
    name: str | None
    base: str
    line: int
    parent: int | None
    steps: list[Step] = field(default_factory=list)
    # The stage's image config at its end, in the OCI shape (`Env`, `WorkingDir`, `User`,
    # `Entrypoint`, `Cmd`, `Shell`, `Labels`, ...), starting from its base image's.
    config: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)


@dataclass(frozen=True)
class FinalImageCopies:
    copies: list[Copy]
    problems: list[str]


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
    stages: list[Stage] = field(default_factory=list)
    # Instructions outside any stage that are not ARGs, a Dockerfile without FROM.
    problems: list[Problem] = field(default_factory=list)

    def source_stage(self, ref: str, before: int) -> Stage | None:
        """The stage `COPY --from=ref` in stage `before` names (by name or index), or None when
        `ref` is an image."""
        earlier = self.stages[:before]
        if ref.isdigit():
            return earlier[int(ref)] if int(ref) < len(earlier) else None
        return next((s for s in earlier if s.name and s.name.lower() == ref.lower()), None)

    def images(self) -> list[str]:
        """The images the build starts FROM or copies from (not stages, not scratch), in
        order, each once."""
        found: dict[str, None] = {}
        for stage in self.stages:
            if stage.parent is None and stage.base != SCRATCH:
                found[stage.base] = None
            for step in stage.steps:
                if (
                    isinstance(step, Copy)
                    and step.from_stage is not None
                    and self.source_stage(step.from_stage, stage.index) is None
                ):
                    found[step.from_stage] = None
        return list(found)


@dataclass(frozen=True)
class _Line:
    number: int
    text: str
    heredoc: bool

    @property
    def keyword(self) -> str:
        return self.text.split(None, 1)[0].upper()

    @property
    def rest(self) -> str:
        parts = self.text.split(None, 1)
        return parts[1].strip() if len(parts) > 1 else ""


def logical_lines(text: str) -> list[str]:
    """Instructions with their line continuations joined and comment lines dropped."""
    return [line.text for line in _instructions(text)]


def _instructions(text: str) -> list[_Line]:
    """Each instruction with the line it starts on; a heredoc's body stays with its
    instruction (it is not read as instructions)."""
    raw = text.splitlines()
    found: list[_Line] = []
    pending, start, index = "", 0, 0
    while index < len(raw):
        stripped = raw[index].strip()
        index += 1
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = index
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        line = (pending + stripped).strip()
        pending = ""
        if not line:
            continue
        heredoc = False
        if line.split(None, 1)[0].upper() in ("RUN", *_COPIES):
            for match in _HEREDOC.finditer(line):
                heredoc = True
                body = []
                while index < len(raw):
                    candidate = raw[index]
                    index += 1
                    if (candidate.lstrip("\t") if match.group(1) else candidate) == match.group(3):
                        break
                    body.append(candidate)
                line += "\n" + "\n".join([*body, match.group(3)])
        found.append(_Line(start, line, heredoc))
    if pending.strip():
        found.append(_Line(start, pending.strip(), False))
    return found


class _Words:
    """Docker's shell lexer: words from text, quotes and escapes removed, variables expanded
    from `variables`; a variable with no value is `missing` (None: a DockerfileError)."""

    def __init__(self, variables: Mapping[str, str], missing: str | None) -> None:
        self.variables = variables
        self.missing = missing

    def split(self, text: str) -> list[str]:
        return self._process(text, split=True)

    def one(self, text: str) -> str:
        """The whole text as one word (spaces kept), as ENV's `NAME value` form reads it."""
        words = self._process(text, split=False)
        return words[0] if words else ""

    def _process(self, text: str, *, split: bool) -> list[str]:
        words: list[str] = []
        current: list[str] = []
        started = False
        i, n = 0, len(text)
        while i < n:
            char = text[i]
            if split and char in " \t\n":
                if started:
                    words.append("".join(current))
                    current, started = [], False
                i += 1
                continue
            started = True
            if char == "\\":
                current.append(text[i + 1] if i + 1 < n else char)
                i += 2
            elif char == "'":
                end = text.find("'", i + 1)
                if end < 0:
                    raise DockerfileError("a single quote is never closed")
                current.append(text[i + 1 : end])
                i = end + 1
            elif char == '"':
                i = self._double_quoted(text, i + 1, current)
            elif char == "$":
                value, i = self._dollar(text, i)
                current.append(value)
            else:
                current.append(char)
                i += 1
        if started:
            words.append("".join(current))
        return words

    def _double_quoted(self, text: str, i: int, current: list[str]) -> int:
        while i < len(text) and text[i] != '"':
            if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in '"$\\':
                current.append(text[i + 1])
                i += 2
            elif text[i] == "$":
                value, i = self._dollar(text, i)
                current.append(value)
            else:
                current.append(text[i])
                i += 1
        if i >= len(text):
            raise DockerfileError("a double quote is never closed")
        return i + 1

    def _dollar(self, text: str, i: int) -> tuple[str, int]:
        """The value of the variable at `text[i]` (a `$`) and where the text goes on."""
        if not text.startswith("${", i):
            name = _NAME.match(text, i + 1)
            if name is None:
                return "$", i + 1
            return self._value(name.group()), name.end()
        name = _NAME.match(text, i + 2)
        if name is None:
            raise DockerfileError(f"{text[i:]}: a bad ${{...}} substitution")
        at = name.end()
        if text.startswith("}", at):
            return self._value(name.group()), at + 1
        operator = text[at : at + 2] if text.startswith(":", at) else text[at : at + 1]
        if operator not in (":-", ":+", ":?", "-", "+", "?"):
            raise DockerfileError(f"{text[i:]}: a substitution Docker does not know")
        end = _closing_brace(text, at + len(operator))
        word = self.one(text[at + len(operator) : end])
        value = self.variables.get(name.group())
        given = value is not None and (value != "" or not operator.startswith(":"))
        if operator.endswith("-"):
            return (value if given and value is not None else word), end + 1
        if operator.endswith("+"):
            return (word if given else ""), end + 1
        if not given:
            raise DockerfileError(f"${name.group()}: {word or 'has no value'}")
        return value or "", end + 1

    def _value(self, name: str) -> str:
        if name in self.variables:
            return self.variables[name]
        if self.missing is None:
            raise DockerfileError(f"${name} has no value in the Dockerfile")
        return self.missing


def _closing_brace(text: str, start: int) -> int:
    depth = 0
    for index in range(start, len(text)):
        if text.startswith("${", index):
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return index
            depth -= 1
    raise DockerfileError(f"{text}: a ${{ is never closed")


def _json_list(rest: str) -> list[str] | None:
    """The exec (JSON) form of an instruction's arguments, or None for the shell form."""
    if not rest.startswith("["):
        return None
    try:
        parsed = json.loads(rest)
    except json.JSONDecodeError:
        return None
    if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
        return parsed
    return None


def _leading_flags(rest: str) -> tuple[list[str], str]:
    """`--name=value` words at the start of an instruction's arguments, and the rest."""
    flags = []
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
        rest = rest.lstrip()
    return flags, rest


def _env_of(config: Mapping[str, Any]) -> dict[str, str]:
    values = {}
    for item in config.get("Env") or []:
        name, _, value = str(item).partition("=")
        if name:
            values[name] = value
    return values


def _set_env(config: dict[str, Any], updates: Mapping[str, str]) -> None:
    values = _env_of(config)
    values.update(updates)
    config["Env"] = [f"{name}={value}" for name, value in values.items()]


class _Reader:
    """Walks the instructions once, keeping what Docker keeps between them."""

    def __init__(
        self, build_args: Mapping[str, str], base_configs: Mapping[str, Mapping[str, Any]] | None
    ) -> None:
        self.given = build_args
        self.base_configs = base_configs
        self.missing = None if base_configs is None else ""
        self.stages: list[Stage] = []
        self.problems: list[Problem] = []
        self.outside: list[str] = []
        self.declared: set[str] = set()
        self.global_args: dict[str, str] = {}
        self.args: dict[str, str] = {}  # the current stage's ARGs with a value
        self.cmd_set = False

    @property
    def stage(self) -> Stage:
        return self.stages[-1]

    def variables(self) -> dict[str, str]:
        """What `$NAME` means here: the stage's ENV over its ARGs (the global ARGs before the
        first FROM)."""
        if not self.stages:
            return dict(self.global_args)
        return {**self.args, **_env_of(self.stage.config)}

    def words(self) -> _Words:
        return _Words(self.variables(), self.missing)

    def read(self, line: _Line) -> None:
        keyword, rest = line.keyword, line.rest
        if keyword == "ARG":
            self.declared.update(word.split("=", 1)[0] for word in _raw_words(rest))
        if keyword in _COPIES and "--from" not in rest and not line.heredoc:
            self.outside.extend(self._outside(keyword, rest))
        if keyword == "FROM":
            self._from(line)
        elif not self.stages:
            if keyword == "ARG":
                self.global_args.update(self._arg_values(rest, self.global_args))
            else:
                self.problems.append(Problem(line.number, keyword, f"{keyword} before any FROM"))
        else:
            try:
                self._instruction(line)
            except DockerfileError as exc:
                self._problem(line, f"{_shown(line)}: {exc}")

    def _problem(self, line: _Line, text: str) -> None:
        self.stage.problems.append(Problem(line.number, line.keyword, text))

    def _from(self, line: _Line) -> None:
        _, rest = _leading_flags(line.rest)  # --platform: one platform here
        try:
            words = _Words(self.global_args, self.missing).split(rest)
        except DockerfileError as exc:
            words = rest.split()
            self.problems.append(Problem(line.number, "FROM", f"{_shown(line)}: {exc}"))
        base = words[0] if words else ""
        name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
        parent = next(
            (s.index for s in self.stages if s.name and s.name.lower() == base.lower()), None
        )
        if parent is not None:
            config = copying.deepcopy(self.stages[parent].config)
        else:
            config = copying.deepcopy(dict((self.base_configs or {}).get(base) or {}))
            config.pop("Image", None)
        self.stages.append(Stage(len(self.stages), name, base, line.number, parent, config=config))
        self.args, self.cmd_set = {}, False
        if parent is None and config.get("OnBuild"):
            self._problem(line, f"FROM {base}: the base image's ONBUILD triggers are not run")

    def _instruction(self, line: _Line) -> None:
        keyword, rest, stage = line.keyword, line.rest, self.stage
        config = stage.config
        if line.heredoc:
            self._problem(line, f"{keyword} with a heredoc")
        elif keyword == "ARG":
            self.args.update(self._arg_values(rest, self.variables()))
        elif keyword in ("ENV", "LABEL"):
            values = self._assignments(rest)
            if keyword == "ENV":
                _set_env(config, values)
            else:
                config["Labels"] = {**(config.get("Labels") or {}), **values}
        elif keyword == "WORKDIR":
            path = posixpath.normpath(posixpath.join(self._workdir(), self.words().one(rest)))
            config["WorkingDir"] = path
            stage.steps.append(Workdir(line.number, path))
        elif keyword == "USER":
            config["User"] = self.words().one(rest).strip()
        elif keyword == "SHELL":
            shell = _json_list(rest)
            if not shell:
                raise DockerfileError('SHELL takes the JSON form, e.g. ["/bin/bash", "-c"]')
            config["Shell"] = shell
        elif keyword == "RUN":
            self._run(line)
        elif keyword in ("CMD", "ENTRYPOINT"):
            argv = self._command(rest)
            if keyword == "CMD":
                config["Cmd"], self.cmd_set = argv, True
            else:
                config["Entrypoint"] = argv
                if not self.cmd_set:  # Docker drops an inherited CMD when ENTRYPOINT changes
                    config["Cmd"] = None
        elif keyword in _COPIES:
            parsed = _parse_copy(keyword, rest, self._workdir(), self.words(), line.number)
            if isinstance(parsed, Copy):
                stage.steps.append(parsed)
            else:
                self._problem(line, parsed)
        elif keyword == "EXPOSE":
            ports: dict[str, Any] = {
                (p if "/" in p else f"{p}/tcp"): {} for p in self.words().split(rest)
            }
            config["ExposedPorts"] = {**(config.get("ExposedPorts") or {}), **ports}
        elif keyword == "VOLUME":
            paths = _json_list(rest) or self.words().split(rest)
            config["Volumes"] = {**(config.get("Volumes") or {}), **{p: {} for p in paths}}
        elif keyword == "STOPSIGNAL":
            config["StopSignal"] = self.words().one(rest)
        elif keyword == "ONBUILD":
            config["OnBuild"] = [*(config.get("OnBuild") or []), rest]
        elif keyword == "HEALTHCHECK":
            config["Healthcheck"] = self._healthcheck(rest)
        elif keyword not in _SKIPPED:
            self._problem(line, f"{keyword}: not a Dockerfile instruction")

    def _workdir(self) -> str:
        return str(self.stage.config.get("WorkingDir") or "/")

    def _run(self, line: _Line) -> None:
        flags, rest = _leading_flags(line.rest)
        if flags:
            self._problem(line, f"RUN {' '.join(flags)}")
            return
        environment = {**self.args, **_env_of(self.stage.config)}
        environment.setdefault("PATH", DEFAULT_PATH)
        self.stage.steps.append(
            Run(
                line.number,
                _shown(line),
                tuple(self._command(rest)),
                tuple(environment.items()),
                self._workdir(),
                str(self.stage.config.get("User") or ""),
            )
        )

    def _healthcheck(self, rest: str) -> dict[str, Any]:
        """`HEALTHCHECK [--interval=D ...] CMD command` or `HEALTHCHECK NONE`, as Docker records
        it: `Test` is ["NONE"], ["CMD", argv...] (the exec form) or ["CMD-SHELL", text]."""
        check: dict[str, Any] = {}
        words = rest.split(None, 1)
        while words and words[0].startswith("--"):
            name, _, value = words[0][2:].partition("=")
            if name not in _HEALTH_OPTIONS or not value:
                raise DockerfileError(f"HEALTHCHECK option {words[0]!r} is not one Docker knows")
            if name == "retries":
                check["Retries"] = int(value)
            else:
                parts = _DURATION.findall(value)
                if "".join(a + b for a, b in parts) != value:
                    raise DockerfileError(f"HEALTHCHECK --{name}={value}: not a duration")
                check[_HEALTH_OPTIONS[name]] = sum(
                    int(float(amount) * _NANOSECONDS[unit]) for amount, unit in parts
                )
            words = words[1].split(None, 1) if len(words) > 1 else []
        if words and words[0].upper() == "NONE":
            return {"Test": ["NONE"]}
        if not words or words[0].upper() != "CMD" or len(words) < 2:
            raise DockerfileError("HEALTHCHECK takes NONE, or CMD and a command")
        exec_form = _json_list(words[1])
        check["Test"] = ["CMD", *exec_form] if exec_form is not None else ["CMD-SHELL", words[1]]
        return check

    def _command(self, rest: str) -> list[str]:
        """A RUN/CMD/ENTRYPOINT's argv: the exec form as written, else SHELL plus the text (the
        shell expands it at run time, not Docker)."""
        exec_form = _json_list(rest)
        if exec_form is not None:
            return exec_form
        return [*(self.stage.config.get("Shell") or DEFAULT_SHELL), rest]

    def _assignments(self, rest: str) -> dict[str, str]:
        """`ENV A=1 B="x y"` (every value expanded as things were before the line, as Docker
        does), or `ENV A 1 2` (one name, the rest its value)."""
        raw = _raw_words(rest)
        words = self.words()
        if raw and "=" not in raw[0]:
            return {raw[0]: words.one(rest[len(raw[0]) :].strip())}
        values = {}
        for word in words.split(rest):
            name, has_value, value = word.partition("=")
            if not name or not has_value:
                raise DockerfileError(f"{word!r} is not NAME=VALUE")
            values[name] = value
        return values

    def _arg_values(self, rest: str, variables: Mapping[str, str]) -> dict[str, str]:
        """`ARG A=1 B`: a given build arg wins over the default (taken as is, as Docker does),
        then the default, then (in a stage) the global ARG's value; an `ARG` with none is left
        out. A default that cannot be expanded leaves the line's ARGs without a value."""
        try:
            words = _Words(variables, self.missing).split(rest)
        except DockerfileError:
            return {name: self.given[name] for name in _raw_names(rest) if name in self.given}
        values = {}
        for word in words:
            name, has_default, default = word.partition("=")
            if name in self.given:
                values[name] = self.given[name]
            elif has_default:
                values[name] = default
            elif self.stages and name in self.global_args:
                values[name] = self.global_args[name]
        return values

    def _outside(self, keyword: str, rest: str) -> list[str]:
        """The sources of one `COPY`/`ADD` that point above the context, expanded where they can
        be (a source that cannot is checked as written)."""
        _, rest = _leading_flags(rest)
        words = _json_list(rest) or _raw_words(rest)
        found = []
        for word in words[:-1]:
            try:
                source = _Words(self.variables(), None).one(word)
            except DockerfileError:
                source = word
            if escapes_context(source):
                found.append(f"{keyword} {source}")
        return found


def _raw_words(rest: str) -> list[str]:
    """Words as written: quoted parts kept whole, nothing expanded."""
    return re.findall(r'(?:[^\s"\']+|"[^"]*"|\'[^\']*\')+', rest)


def _raw_names(rest: str) -> list[str]:
    return [word.split("=", 1)[0] for word in _raw_words(rest)]


def _shown(line: _Line) -> str:
    """An instruction for a message: its first line, at most 120 characters."""
    text = line.text.splitlines()[0]
    return text if len(text) <= 120 else text[:117] + "..."


def _parse_copy(
    instruction: str, rest: str, workdir: str, words: _Words, number: int
) -> Copy | str:
    """A Copy, or a problem (one line) when the instruction cannot be replayed."""
    if rest.startswith("<<"):
        return f"{instruction} with a heredoc"
    flag_words, rest = _leading_flags(rest)
    flags: dict[str, str] = {}
    for word in flag_words:
        flag, _, value = word.partition("=")
        if flag not in _KNOWN_COPY_FLAGS or (flag == "--from" and instruction == "ADD"):
            return f"{instruction} {flag}"
        flags[flag] = value
    try:
        exec_form = _json_list(rest)
        arguments = [words.one(w) for w in exec_form] if exec_form else words.split(rest)
        values = {flag: words.one(value) for flag, value in flags.items()}
    except DockerfileError as exc:
        shown = " ".join([*flag_words, rest])
        return f"{instruction} {shown}: {exc}"
    if len(arguments) < 2:
        return f"{instruction} {rest}: needs a source and a destination"
    sources, dest = arguments[:-1], arguments[-1]
    from_stage = values.get("--from")
    if from_stage is None:
        for source in sources:
            if re.match(r"^[a-z][a-z0-9+.-]*://", source) or source.startswith("git@"):
                return f"{instruction} {source}: a remote source"
    dest_slash = dest.endswith("/") or dest == "." or dest.endswith("/.")
    return Copy(
        instruction=instruction,
        sources=tuple(sources),
        dest=posixpath.normpath(posixpath.join(workdir, dest)),
        dest_is_dir=dest_slash or len(sources) > 1 or any(is_glob(s) for s in sources),
        chown=values.get("--chown") or None,
        chmod=values.get("--chmod") or None,
        from_stage=from_stage,
        line=number,
        dest_slash=dest_slash,
    )


def is_glob(source: str) -> bool:
    return any(char in source for char in "*?[")


def read_dockerfile(
    text: str,
    build_args: Mapping[str, str] | None = None,
    base_configs: Mapping[str, Mapping[str, Any]] | None = None,
) -> Dockerfile:
    """Read a Dockerfile's stages, expanding variables as a build with `build_args` would.

    `base_configs` maps each image the stages start FROM (as `Dockerfile.images()` names them)
    to its OCI config; with them, stages start from their base's config and a variable without
    a value is empty, as in Docker.
    """
    reader = _Reader(build_args or {}, base_configs)
    for line in _instructions(text):
        reader.read(line)
    problems = reader.problems
    if not reader.stages:
        problems = [*problems, Problem(0, "FROM", "no FROM instruction")]
        final = FinalImageCopies([], ["no FROM instruction"])
    else:
        final = _collect(reader.stages, len(reader.stages) - 1)
    return Dockerfile(final, reader.outside, reader.declared, reader.stages, problems)


def _collect(stages: list[Stage], index: int) -> FinalImageCopies:
    """A stage's local-file copies, after those of the earlier stage it is built FROM (if any),
    and what setup-sh cannot replay of them."""
    stage = stages[index]
    copies, problems = [], []
    for step in stage.steps:
        if isinstance(step, Copy) and step.from_stage is not None:
            problems.append((step.line, f"{step.instruction} --from={step.from_stage}"))
        elif isinstance(step, Copy):
            copies.append(step)
    problems += [(p.line, p.text) for p in stage.problems if p.keyword in (*_COPIES, "WORKDIR")]
    own = [text for _, text in sorted(problems, key=lambda item: item[0])]
    if stage.parent is None:
        return FinalImageCopies(copies, own)
    inherited = _collect(stages, stage.parent)
    return FinalImageCopies(inherited.copies + copies, inherited.problems + own)


def escapes_context(source: str) -> bool:
    """True when a COPY/ADD source names a path above the build context (a leading `/` means
    the context's root, as in Docker)."""
    return posixpath.normpath(posixpath.join("ctx", source.lstrip("/"))).split("/")[0] != "ctx"
