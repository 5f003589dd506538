"""What a .sif remembers of the OCI image it was made from: ENTRYPOINT, CMD, ENV, WORKDIR, USER.

Apptainer keeps the image's OCI config as a JSON descriptor named `oci-config.json` inside the
SIF. Docker runs a container from exactly that config, so our environment reads it too rather
than guessing from a Dockerfile (which may be multi-stage, or not be the one the image came
from). The SIF layout is fixed and little-endian (github.com/apptainer/sif): a 128-byte global
header, then a table of 585-byte descriptors; reading it directly costs a fraction of a
millisecond, where `apptainer sif dump` costs two process starts.

`build --builder apptainer` writes the config of the image it built from a Dockerfile into the
same descriptor (`write_image_config`), so the environment starts its images exactly as it
starts converted ones. Where there is no Apptainer, `convert` writes the SIF itself
(`write_sif`): a root partition and that descriptor, laid out as Apptainer lays them out, a file
Apptainer runs as its own.

The container mounts the image's root partition (`root_partition`) a second time, read-only,
for its command server's python3 (container.py says why). The partition also says which
architecture the image's programs are for (`foreign_architecture` compares it to the node's).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import IO, Any

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.proc import run
from harbor_hpc.runtimes.apptainer import find_apptainer

_MAGIC = b"SIF_MAGIC"
_HEADER = struct.Struct("<32s10s3s3s16s8q")
_DESCRIPTOR_FIXED = struct.Struct("<i?IIIqq")  # type, used, id, group, link, offset, size
_NAME_AT, _NAME_LEN = 73, 128
_EXTRA_AT = _NAME_AT + _NAME_LEN
_PARTITION = struct.Struct("<ii")  # a partition's file system and kind, at _EXTRA_AT
_JSON_GENERIC, _PARTITION_TYPE = 0x4006, 0x4004
_SQUASHFS, _PRIMARY_SYSTEM = 1, 2
_ARCH_AT = _EXTRA_AT + _PARTITION.size  # a partition's architecture: 3 bytes, "02" for amd64
# The SIF's architecture codes (github.com/apptainer/sif, as `apptainer sif list` names them).
_ARCHITECTURES = {
    b"01": "386",
    b"02": "amd64",
    b"03": "arm",
    b"04": "arm64",
    b"05": "ppc64",
    b"06": "ppc64le",
    b"07": "mips",
    b"08": "mipsle",
    b"09": "mips64",
    b"10": "mips64le",
    b"11": "s390x",
    b"12": "riscv64",
}
# What `uname -m` says on a machine of each (the names qemu's binfmt_misc handlers carry).
_MACHINES = {
    "386": "i386",
    "amd64": "x86_64",
    "arm": "arm",
    "arm64": "aarch64",
    "ppc64": "ppc64",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
}
_BINFMT = Path("/proc/sys/fs/binfmt_misc")
_OCI_CONFIG_NAME = b"oci-config.json"
# `apptainer sif add --datatype` for JSON.Generic; the system partition's group, as Apptainer's own.
_JSON_DATATYPE, _SYSTEM_GROUP = "6", "1"
_MAX_CONFIG_BYTES = 1 << 20
# How Apptainer lays a SIF out (sif's defaults): its launch line, room for 48 descriptors from
# 4096 on, the data after them, a partition on a 4096-byte boundary, the system group's id.
_LAUNCH = b"#!/usr/bin/env run-singularity\n"
_DESCRIPTOR_FULL = struct.Struct("<i?IIIqqqqqqq128s384s")
_TABLE_AT, _TABLE_ENTRIES, _ALIGN = 4096, 48, 4096
_GROUP_ID = 0xF0000000 | 1


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an OCI image config that decide how Docker starts a container."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    user: str = ""
    # Docker's `Healthcheck` (Test, Interval, Timeout, StartPeriod in ns, Retries), or empty.
    healthcheck: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageConfig:
        env = {}
        for item in data.get("Env") or []:
            name, _, value = str(item).partition("=")
            if name:
                env[name] = value
        return cls(
            entrypoint=tuple(str(arg) for arg in data.get("Entrypoint") or ()),
            cmd=tuple(str(arg) for arg in data.get("Cmd") or ()),
            env=env,
            workdir=str(data.get("WorkingDir") or ""),
            user=str(data.get("User") or ""),
            healthcheck=dict(data.get("Healthcheck") or {}),
        )


def image_config(sif: Path) -> ImageConfig | None:
    """The OCI config stored in `sif`, or None (not a SIF, or built without one)."""
    try:
        stat = sif.stat()
    except OSError:
        return None
    return _image_config(sif.resolve(), stat.st_mtime_ns, stat.st_size)


@cache
def _image_config(sif: Path, mtime_ns: int, size: int) -> ImageConfig | None:
    # mtime and size are part of the key: a .sif replaced in place is read again.
    del mtime_ns, size
    data = raw_config(sif)
    return ImageConfig.from_json(data) if data is not None else None


def raw_config(sif: Path) -> dict[str, Any] | None:
    """The OCI config stored in `sif` as it is (every field), or None."""
    try:
        with sif.open("rb") as file:
            for _, offset, length in _configs(file):
                if not 0 < length <= _MAX_CONFIG_BYTES:
                    return None
                file.seek(offset)
                data = json.loads(file.read(length))
                return data if isinstance(data, dict) else None
    except (OSError, ValueError, struct.error):
        return None
    return None


@dataclass(frozen=True)
class RootPartition:
    """Where in a SIF the image's root file system is: its descriptor id, and its bytes."""

    id: int
    offset: int
    size: int
    arch: str = ""  # the architecture its programs are for (Apptainer's name), "" unknown


def root_partition(sif: Path) -> RootPartition | None:
    """The squashfs partition holding the image's root file system (what `apptainer exec`
    mounts as /), or None (not a SIF, or its root is not squashfs)."""
    try:
        with sif.open("rb") as file:
            for kind, number, entry in _descriptors(file):
                if kind == _PARTITION_TYPE and _PARTITION.unpack_from(entry, _EXTRA_AT) == (
                    _SQUASHFS,
                    _PRIMARY_SYSTEM,
                ):
                    _, _, _, _, _, offset, size = _DESCRIPTOR_FIXED.unpack_from(entry)
                    code = entry[_ARCH_AT : _ARCH_AT + 3].rstrip(b"\0")
                    return RootPartition(number, offset, size, _ARCHITECTURES.get(code, ""))
    except (OSError, struct.error):
        return None
    return None


def node_architecture() -> str:
    """This machine's architecture in Apptainer's (Go's) names: amd64 for x86_64."""
    machine = platform.machine().lower()
    named = {machine: arch for arch, machine in _MACHINES.items()}
    named |= {"arm64": "arm64", "i686": "386", "i586": "386"}
    return named.get(machine, "arm" if machine.startswith("arm") else machine)


def foreign_architecture(sif: Path) -> str | None:
    """Why `sif`'s programs cannot run on this node, or None when they can: its root partition
    is for another architecture than the node's, and no binfmt_misc handler (qemu-user) of this
    node runs that architecture's programs (Apptainer's own test). An unknown one is let be."""
    partition = root_partition(sif)
    if partition is None or not partition.arch:
        return None
    node = node_architecture()
    if partition.arch == node:
        return None
    machine = _MACHINES.get(partition.arch, partition.arch)
    try:
        handlers = [name for name in os.listdir(_BINFMT) if machine in name]
    except OSError:
        handlers = []
    if handlers:
        return None
    return (
        f"built for {partition.arch} ({machine}), but this node, {os.uname().nodename}, is "
        f"{node} ({platform.machine()}) and cannot run its programs: build the image for "
        f"linux/{node} (`docker build --platform linux/{node}`, FROM an image for {node}) and "
        "convert it again, or run the task on a partition of nodes of its architecture"
    )


def write_image_config(sif: Path, config: dict[str, Any]) -> None:
    """Make `config` the OCI config `sif` holds, in place of any it has (a build from a local
    image inherits that image's)."""
    with sif.open("rb") as file:
        old = [number for number, _, _ in _configs(file)]
    apptainer = find_apptainer()
    for number in old:
        _sif_tool([apptainer, "sif", "del", str(number), str(sif)])
    with tempfile.TemporaryDirectory(prefix="harbor-hpc-config-") as scratch:
        descriptor = Path(scratch) / _OCI_CONFIG_NAME.decode()
        descriptor.write_text(json.dumps(config, separators=(",", ":")))
        _sif_tool(
            [
                *(apptainer, "sif", "add", "--datatype", _JSON_DATATYPE),
                *("--groupid", _SYSTEM_GROUP, "--filename", descriptor.name),
                *(str(sif), str(descriptor)),
            ]
        )


def write_sif(squashfs: Path, config: dict[str, Any], architecture: str, target: Path) -> None:
    """Write `target`, a SIF of the root file system `squashfs` (its primary system partition,
    for `architecture`, Apptainer's name) and of `config` (its oci-config.json descriptor)."""
    code = {name: code for code, name in _ARCHITECTURES.items()}.get(architecture, b"00")
    blob = json.dumps(config, separators=(",", ":")).encode()
    data_at = _TABLE_AT + _TABLE_ENTRIES * _DESCRIPTOR_FULL.size
    partition_at = -(-(data_at + len(blob)) // _ALIGN) * _ALIGN
    size = squashfs.stat().st_size
    now = int(time.time())
    extra = _PARTITION.pack(_SQUASHFS, _PRIMARY_SYSTEM) + code + b"\0"
    table = b"".join(
        [
            _DESCRIPTOR_FULL.pack(
                _JSON_GENERIC, True, 1, _GROUP_ID, 0, data_at, len(blob), len(blob),
                now, now, 0, 0, _OCI_CONFIG_NAME, b"",
            ),
            _DESCRIPTOR_FULL.pack(
                _PARTITION_TYPE, True, 2, _GROUP_ID, 0, partition_at, size,
                size + partition_at - data_at - len(blob), now, now, 0, 0, b"", extra,
            ),
        ]
    )  # fmt: skip
    header = _HEADER.pack(
        _LAUNCH, _MAGIC + b"\0", b"01\0", code + b"\0", uuid.uuid4().bytes,
        now, now, _TABLE_ENTRIES - 2, _TABLE_ENTRIES, _TABLE_AT,
        _TABLE_ENTRIES * _DESCRIPTOR_FULL.size, data_at, partition_at + size - data_at,
    )  # fmt: skip
    with target.open("wb") as out, squashfs.open("rb") as root:
        out.write(header)
        out.seek(_TABLE_AT)
        out.write(table.ljust(_TABLE_ENTRIES * _DESCRIPTOR_FULL.size, b"\0"))
        out.write(blob)
        out.seek(partition_at)
        shutil.copyfileobj(root, out, 1 << 20)


def _sif_tool(command: list[str]) -> None:
    done = run(command, timeout=120)
    if not done.ok:
        raise HarborHpcError(f"{' '.join(command[1:3])} on {command[-2]}: {done.why()}")


def _configs(file: IO[bytes]) -> Iterator[tuple[int, int, int]]:
    """(descriptor id, offset, length) of each OCI config descriptor in an open SIF, in order;
    nothing for a file that is not a SIF."""
    for kind, number, entry in _descriptors(file):
        _, _, _, _, _, offset, length = _DESCRIPTOR_FIXED.unpack_from(entry)
        name = entry[_NAME_AT : _NAME_AT + _NAME_LEN].rstrip(b"\0")
        if kind == _JSON_GENERIC and name == _OCI_CONFIG_NAME:
            yield number, offset, length


def _descriptors(file: IO[bytes]) -> Iterator[tuple[int, int, bytes]]:
    """(data type, descriptor id, raw descriptor) of each descriptor in use in an open SIF, in
    order; nothing for a file that is not a SIF."""
    header = file.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return
    fields = _HEADER.unpack(header)
    if not fields[1].startswith(_MAGIC):
        return
    total, table_offset, table_size = fields[8], fields[9], fields[10]
    if total <= 0 or table_size % total:
        return
    file.seek(table_offset)
    table = file.read(table_size)
    width = table_size // total
    for index in range(total):
        entry = table[index * width : (index + 1) * width]
        kind, used, number, _, _, _, _ = _DESCRIPTOR_FIXED.unpack_from(entry)
        if used:
            yield kind, number, entry
