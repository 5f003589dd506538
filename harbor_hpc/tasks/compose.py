"""A task's Docker Compose services, read as Harbor's Docker environment merges them.

Harbor runs every Docker task as a compose project: its own `main` service (the task's image,
`sleep infinity`) merged with `environment/docker-compose.yaml` and any `extra_docker_compose`
files, later files winning. `load_compose` reads the same files the same way into typed
services: `main` (what the task's compose adds to the agent's container) and the others, each
from an `image:` or a `build:` context, with its command, environment, volumes, healthcheck and
what it waits for. What cannot be honoured in one shared network namespace, Docker's
`${VAR}` interpolation included, is named in an `UnsupportedCompose` error.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harbor_hpc.tasks.discovery import compose_file

MAIN = "main"
# Keys that change nothing a task can see in one pod (publishing ports to the host, restart
# policies, resource hints the watchdog supersedes, capabilities root in the pod already has).
IGNORED = frozenset(
    {
        "cap_add",
        "cap_drop",
        "container_name",
        "cpus",
        "deploy",
        "expose",
        "init",
        "labels",
        "logging",
        "mem_limit",
        "mem_reservation",
        "platform",
        "ports",
        "pull_policy",
        "restart",
        "security_opt",
        "shm_size",
        "stdin_open",
        "stop_grace_period",
        "stop_signal",
        "tty",
        "ulimits",
    }
)
SERVICE_KEYS = frozenset(
    {
        "image",
        "build",
        "command",
        "entrypoint",
        "environment",
        "env_file",
        "working_dir",
        "user",
        "volumes",
        "depends_on",
        "healthcheck",
        "hostname",
        "networks",
        "network_mode",
    }
)
# What a task's compose may add to `main`. Its image and command are Harbor's whatever the file
# says (Harbor's own terminal-bench mapper writes them as `${MAIN_IMAGE_NAME}`, `sleep infinity`).
MAIN_KEYS = frozenset(
    {"environment", "env_file", "volumes", "depends_on", "networks", "build", "image", "command"}
)
CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
_VARIABLE = re.compile(
    r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))"
)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class UnsupportedCompose(Exception):
    """A compose file asks for what one pod of Apptainer containers cannot give (or is not a
    compose file): the message names the file, the service and the key."""


@dataclass(frozen=True)
class Healthcheck:
    """A healthcheck as a compose file or an image's HEALTHCHECK gives it; a field it leaves
    out (None) comes from the image's, then from Docker's defaults (`resolved`)."""

    # The argv to run: CMD's as given, CMD-SHELL's and a string's through `/bin/sh -c`.
    test: tuple[str, ...] | None = None
    interval_sec: float | None = None
    timeout_sec: float | None = None
    retries: int | None = None
    start_period_sec: float | None = None
    # `disable: true`, or a test of NONE: no healthcheck, whatever the image has.
    disabled: bool = False

    def over(self, image: Healthcheck | None) -> HealthProbe | None:
        """This healthcheck over the image's, with Docker's defaults for what neither sets;
        None when there is none to run."""
        if self.disabled:
            return None
        base = image or Healthcheck()
        test = self.test or base.test
        if not test or (base.disabled and not self.test):
            return None
        return HealthProbe(
            test,
            _first(self.interval_sec, base.interval_sec, 30.0),
            _first(self.timeout_sec, base.timeout_sec, 30.0),
            int(_first(self.retries, base.retries, 3)),
            _first(self.start_period_sec, base.start_period_sec, 0.0),
        )


@dataclass(frozen=True)
class HealthProbe:
    """A healthcheck to run, every field settled (`Healthcheck.over`)."""

    test: tuple[str, ...]
    interval_sec: float
    timeout_sec: float
    retries: int
    start_period_sec: float


def _first(*values: float | None) -> float:
    return next(value for value in values if value is not None)


def health_argv(test: Sequence[Any], where: str) -> tuple[str, ...]:
    """Docker's `test` (a string, or ["CMD", ...] / ["CMD-SHELL", text]) as the argv to run."""
    if isinstance(test, str):
        return ("/bin/sh", "-c", test)
    if test and test[0] == "CMD":
        return tuple(str(part) for part in test[1:])
    if test and test[0] == "CMD-SHELL":
        return ("/bin/sh", "-c", " ".join(str(part) for part in test[1:]))
    raise UnsupportedCompose(
        f"{where}: healthcheck test {test!r} is not CMD, CMD-SHELL or a string"
    )


@dataclass(frozen=True)
class Volume:
    """One `volumes:` entry: a host folder or file (`source` absolute), or a named volume the
    project's services share (`source` its name, `named`)."""

    source: str
    target: str
    read_only: bool = False
    named: bool = False


@dataclass
class Service:
    name: str
    image: str | None = None
    # A `build:` context (absolute), built from its Dockerfile.
    build: Path | None = None
    command: tuple[str, ...] | None = None
    entrypoint: tuple[str, ...] | None = None
    environment: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None
    volumes: list[Volume] = field(default_factory=list)
    # Service -> the condition it must reach before this one starts.
    depends_on: dict[str, str] = field(default_factory=dict)
    healthcheck: Healthcheck | None = None


@dataclass
class Compose:
    """A task's compose project: `main` and the services beside it, in start order."""

    files: list[Path]
    main: Service
    services: list[Service]

    def names(self) -> list[str]:
        return [MAIN, *(service.name for service in self.services)]


def load_compose(environment_dir: Path, extra: Sequence[Path] = ()) -> Compose | None:
    """The task's compose project (its own file, then `extra`, merged), or None when it has
    none. Raises UnsupportedCompose naming what cannot be run."""
    own = compose_file(environment_dir)
    files = [*([own] if own else []), *(Path(path) for path in extra)]
    if not files:
        return None
    variables = {**_dotenv(environment_dir / ".env"), **os.environ}
    variables.setdefault("CONTEXT_DIR", str(environment_dir.resolve()))
    merged: dict[str, dict[str, Any]] = {}
    for path in files:
        for name, config in _read(path, variables).items():
            merged[name] = _merge(merged.get(name, {}), _normal(config))
    merged.setdefault(MAIN, {})
    services = {
        name: _service(name, config, environment_dir, files[-1], variables)
        for name, config in merged.items()
    }
    for service in services.values():
        for needed in service.depends_on:
            if needed not in services:
                raise UnsupportedCompose(
                    f"{files[-1]}: service {service.name!r} depends on {needed!r}, which no "
                    "compose file defines"
                )
    order = _start_order(services, files[-1])
    return Compose(files, services[MAIN], [services[name] for name in order if name != MAIN])


def _read(path: Path, variables: Mapping[str, str]) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UnsupportedCompose(f"{path}: not a readable compose file: {exc}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise UnsupportedCompose(f"{path}: a compose file is a mapping with `services:`")
    for key in document:
        if key not in {"services", "volumes", "networks", "version", "name"} and not str(
            key
        ).startswith("x-"):
            raise UnsupportedCompose(f"{path}: top-level `{key}` is not supported here")
    services = _interpolate(document.get("services") or {}, variables, path)
    if not isinstance(services, dict) or not all(isinstance(v, dict) for v in services.values()):
        raise UnsupportedCompose(f"{path}: `services:` is a mapping of service mappings")
    return services


def _interpolate(value: Any, variables: Mapping[str, str], path: Path) -> Any:
    """Docker's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `$VAR`, `$$`."""
    if isinstance(value, dict):
        return {key: _interpolate(item, variables, path) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, variables, path) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        dollar, braced, operator, argument, bare = match.groups()
        if dollar:
            return "$"
        name = braced or bare
        present = variables.get(name)
        if operator in {":-", "-"}:
            empty = present is None or (operator == ":-" and present == "")
            return argument if empty else str(present)
        if operator in {":?", "?"} and (present is None or (operator == ":?" and present == "")):
            raise UnsupportedCompose(f"{path}: ${{{name}}} is required: {argument}")
        return "" if present is None else str(present)

    return _VARIABLE.sub(substitute, value)


def _dotenv(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    pairs = {}
    for line in path.read_text(errors="replace").splitlines():
        name, has, value = line.strip().partition("=")
        if has and not name.startswith("#"):
            pairs[name.strip()] = value.strip().strip("'\"")
    return pairs


def _normal(config: dict[str, Any]) -> dict[str, Any]:
    """The list forms of `environment` and `depends_on` as mappings, for merging."""
    config = dict(config)
    if isinstance(config.get("environment"), list):
        config["environment"] = dict(
            (str(item).partition("=")[0], str(item).partition("=")[2])
            for item in config["environment"]
        )
    if isinstance(config.get("depends_on"), list):
        config["depends_on"] = {
            str(name): {"condition": "service_started"} for name in config["depends_on"]
        }
    return config


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge: mappings merge, `volumes` add up, anything else is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        elif key == "volumes" and isinstance(value, list):
            merged[key] = [*merged.get(key, []), *value]
        else:
            merged[key] = value
    return merged


def _service(
    name: str,
    config: dict[str, Any],
    environment_dir: Path,
    path: Path,
    variables: Mapping[str, str],
) -> Service:
    where = f"{path}: service {name!r}"
    allowed = MAIN_KEYS if name == MAIN else SERVICE_KEYS
    for key in config:
        if key not in allowed and key not in IGNORED:
            what = "the main service's" if name == MAIN else "a service's"
            raise UnsupportedCompose(f"{where}: `{key}` ({what}) cannot be honoured here")
    _check_networking(config, where)
    service = Service(name)
    if name != MAIN:
        service.image = str(config["image"]) if config.get("image") else None
        service.build = _build_context(config.get("build"), environment_dir, where)
        if service.image is None and service.build is None:
            raise UnsupportedCompose(f"{where}: neither `image:` nor `build:`")
        service.command = _argv(config.get("command"), where, "command")
        service.entrypoint = _argv(config.get("entrypoint"), where, "entrypoint")
        service.working_dir = config.get("working_dir")
        service.user = str(config["user"]) if config.get("user") is not None else None
        service.healthcheck = _healthcheck(config.get("healthcheck"), where)
    for env_file in _list(config.get("env_file")):
        env_path = environment_dir / str(
            env_file.get("path") if isinstance(env_file, dict) else env_file
        )
        if not env_path.is_file():
            raise UnsupportedCompose(f"{where}: env_file {env_path} does not exist")
        service.environment.update(_dotenv(env_path))
    for key, value in (config.get("environment") or {}).items():
        # `KEY` alone takes the value from the environment compose runs in.
        text = variables.get(str(key)) if value is None else value
        if text is not None:
            service.environment[str(key)] = (
                str(text).lower() if isinstance(text, bool) else str(text)
            )
    service.volumes = [
        _volume(entry, environment_dir, where) for entry in config.get("volumes") or []
    ]
    for needed, condition in (config.get("depends_on") or {}).items():
        wanted = (condition or {}).get("condition", "service_started")
        if wanted not in CONDITIONS:
            raise UnsupportedCompose(
                f"{where}: depends_on condition {wanted!r} is not one of {CONDITIONS}"
            )
        service.depends_on[str(needed)] = wanted
    return service


def _check_networking(config: dict[str, Any], where: str) -> None:
    """Every service shares one network namespace (a pod): names resolve to 127.0.0.1. Fixed
    addresses, and a service kept off the others' network, cannot be given."""
    mode = config.get("network_mode")
    if mode is not None and mode != "bridge":
        raise UnsupportedCompose(f"{where}: network_mode {mode!r} cannot be honoured here")
    networks = config.get("networks")
    if isinstance(networks, dict):
        for network, settings in networks.items():
            fixed = {"ipv4_address", "ipv6_address"} & set(settings or {})
            if fixed:
                raise UnsupportedCompose(
                    f"{where}: networks.{network}.{sorted(fixed)[0]} (a fixed address) cannot be "
                    "honoured: services share one network namespace here"
                )


def _build_context(build: Any, environment_dir: Path, where: str) -> Path | None:
    if build is None:
        return None
    settings = {"context": build} if isinstance(build, str) else dict(build)
    extra = set(settings) - {"context", "dockerfile"}
    if extra:
        raise UnsupportedCompose(f"{where}: build.{sorted(extra)[0]} is not supported here")
    if settings.get("dockerfile", "Dockerfile") != "Dockerfile":
        raise UnsupportedCompose(
            f"{where}: build.dockerfile other than Dockerfile is not supported"
        )
    context = (environment_dir / str(settings.get("context", "."))).resolve()
    if not (context / "Dockerfile").is_file():
        raise UnsupportedCompose(f"{where}: the build context {context} has no Dockerfile")
    return context


def _argv(value: Any, where: str, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list):
        return tuple(str(part) for part in value)
    raise UnsupportedCompose(f"{where}: `{key}` is a string or a list")


def _list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _seconds(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    parts = _DURATION.findall(str(value))
    if not parts or "".join(a + b for a, b in parts) != str(value).replace(" ", ""):
        raise UnsupportedCompose(f"{where}: {value!r} is not a duration (like 2s, 1m30s)")
    return sum(float(amount) * _UNITS[unit] for amount, unit in parts)


def _healthcheck(value: Any, where: str) -> Healthcheck | None:
    if not value:
        return None
    test = value.get("test")
    if value.get("disable") or test in (["NONE"], "NONE"):
        return Healthcheck(disabled=True)
    retries = value.get("retries")
    return Healthcheck(
        None if test is None else health_argv(test, where),
        interval_sec=_seconds(value.get("interval"), where),
        timeout_sec=_seconds(value.get("timeout"), where),
        retries=None if retries is None else int(retries),
        start_period_sec=_seconds(value.get("start_period"), where),
    )


def _volume(entry: Any, environment_dir: Path, where: str) -> Volume:
    if isinstance(entry, str):
        parts = entry.split(":")
        if len(parts) == 1:
            raise UnsupportedCompose(f"{where}: volume {entry!r} (anonymous) is not supported here")
        source, target = parts[0], parts[1]
        read_only = len(parts) > 2 and "ro" in parts[2].split(",")
    elif isinstance(entry, dict) and entry.get("type", "volume") in {"bind", "volume"}:
        source, target = str(entry.get("source", "")), str(entry.get("target", ""))
        read_only = bool(entry.get("read_only"))
    else:
        raise UnsupportedCompose(f"{where}: volume {entry!r} is not supported here")
    if not source or not target:
        raise UnsupportedCompose(f"{where}: volume {entry!r} needs a source and a target")
    if source.startswith((".", "/", "~")):
        host = (environment_dir / os.path.expanduser(source)).resolve()
        return Volume(str(host), target, read_only)
    return Volume(source, target, read_only, named=True)


def _start_order(services: Mapping[str, Service], path: Path) -> list[str]:
    """The services in an order where each comes after what it depends on."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise UnsupportedCompose(f"{path}: depends_on makes a cycle through {name!r}")
        visiting.add(name)
        for needed in sorted(services[name].depends_on):
            visit(needed)
        visiting.discard(name)
        order.append(name)

    for name in sorted(services):
        visit(name)
    return order
