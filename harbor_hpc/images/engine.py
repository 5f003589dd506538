"""Which engine builds images (`BuilderKind`, `choose_builder`), and the Docker Engine the build
role talks to, through DOCKER_HOST or the default socket.

`engine_finding` is what `harbor-hpc doctor --role build` shows, `ping` what `build` asks before
it builds with Docker (and `--builder auto` to choose Docker); `unreachable` turns whatever the
Docker client raised when it could not talk to the engine into the reason and the fix a user
needs (the client raises DockerException, requests' errors or OSError, with long texts).
"""

from __future__ import annotations

import os
from enum import StrEnum

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.probe import Finding, Status, current_user

# Short enough that a dead socket cannot stall the doctor, long enough for a busy machine.
PING_TIMEOUT_S = 5


def engine_finding() -> Finding:
    """Whether the engine answers, with its version, or why not and what to do."""
    import docker  # imported here: it takes a few tenths of a second and only this probe needs it

    try:
        client = docker.from_env(timeout=PING_TIMEOUT_S)
        try:
            client.ping()
            version = client.version()
        finally:
            client.close()
    except Exception as exc:  # see the module docstring: no one exception type covers them
        reason, fix = unreachable(exc)
        return Finding("engine", Status.MISSING, f"{where()}: {reason}", fix)
    detail = (
        f"Docker {version.get('Version', '?')} (API {version.get('ApiVersion', '?')}) at {where()}"
    )
    return Finding("engine", Status.OK, detail)


def ping() -> None:
    """Return when the engine answers; else raise `HarborHpcError` saying why and what to do."""
    import docker  # imported here: see engine_finding

    try:
        client = docker.from_env(timeout=PING_TIMEOUT_S)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # see the module docstring
        reason, fix = unreachable(exc)
        message = f"cannot reach the Docker Engine at {where()}: {reason}"
        raise HarborHpcError(message, hint=fix) from None


def where() -> str:
    return os.environ.get("DOCKER_HOST") or "the default socket (/var/run/docker.sock)"


def unreachable(exc: Exception) -> tuple[str, str]:
    """(why the engine could not be reached, what to do) from the client's exception."""
    text = str(exc)
    if "Permission denied" in text:
        return (
            "permission denied on the socket",
            f"an admin adds {current_user()} to the docker group (then log in again)",
        )
    fix = (
        "start the engine (`systemctl start docker`, or `dockerd &`), or point at one: "
        "`export DOCKER_HOST=unix:///run/user/$UID/docker.sock` (rootless) or tcp://HOST:2375"
    )
    if "No such file" in text or "FileNotFoundError" in text:
        return "no socket there", fix
    if "Connection refused" in text:
        return "connection refused (is dockerd running?)", fix
    return text[-200:], fix


class BuilderKind(StrEnum):
    """`build --builder`: which backend makes the images."""

    AUTO = "auto"
    DOCKER = "docker"
    APPTAINER = "apptainer"


def choose_builder(kind: BuilderKind) -> tuple[BuilderKind, str]:
    """The backend `auto` means here, and why: Docker when an engine answers, else Apptainer."""
    if kind is not BuilderKind.AUTO:
        return kind, "as asked"
    try:
        ping()
    except HarborHpcError as exc:
        return BuilderKind.APPTAINER, f"{exc.message}; building with Apptainer instead"
    return BuilderKind.DOCKER, f"a Docker Engine answers at {where()}"
