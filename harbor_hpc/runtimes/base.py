"""What starts a task's container, behind one protocol: a runtime is one module of this folder
(apptainer.py, enroot.py) with one `Runtime`; what the container is, whatever starts it (its own
root, namespaces, network, pod, watchdog, command channel), is harbor_hpc/containers'."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Start:
    """One container to start, as containers/container.py asks it of the runtime."""

    # The container's command (its command server's launcher).
    command: Sequence[str]
    # Its binds (`-B SOURCE:TARGET[:ro]`), variables (`--env NAME=VALUE`), name (`--hostname`).
    options: Sequence[str]
    own_network: bool
    # The .sif, or the container's own root (a merged overlay, holder.py) where `own_root`.
    image: Path
    own_root: bool
    # Whether the user's subordinate ids map the image's other users (else root alone).
    subids: bool
    # The container's private folder, for the runtime's own files.
    private: Path
    # On the .sif: Apptainer's flags for this user (`run_flags`), its overlay folder, and what
    # of the node it leaves out (`--no-mount`; None: ours, Harbor's default).
    flags: Sequence[str] = ()
    overlay: Path | None = None
    no_mount: str | None = None


class Runtime(Protocol):
    """A program that starts task containers, and what it can and cannot do for a task."""

    name: str
    # It starts containers on a root of our own only (never on the .sif itself).
    own_root_only: bool
    # It can start a task as the user rather than as root (`fakeroot=false`).
    as_user: bool
    # Without a subuid range, it fakes the image's other users (Apptainer's fakeroot command).
    fakes_other_ids: bool
    # It writes /etc/hostname from `--hostname` itself (else the environment binds one).
    writes_hostname: bool

    def command(self, start: Start) -> list[str]:
        """The command that starts `start`'s container (run in the holder's namespaces where
        `start.own_root`)."""
        ...
