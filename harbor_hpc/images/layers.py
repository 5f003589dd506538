"""An image's root file system made without Docker or Apptainer, for `convert` on nodes that have
neither (enroot clusters: containers/store.py makes the .sif from it).

The image's config and layers come from its registry (the manifest for this node's architecture)
or from a `docker save` archive (`docker-daemon://` saves one first). `apply` lays the layers
into a folder, lowest first, as Docker applies them: whiteouts (`.wh.NAME` removes NAME of the
layers below, `.wh..wh..opq` everything below in its folder), owners, modes (setuid included),
times, hard and symbolic links, fifos; device nodes are left out (a container gets a /dev of its
own, Apptainer's builds leave them out too).

A layer is its author's: no member may write outside the folder. A member's parent is found
inside the folder as the container would find it (a symbolic link's absolute target is the
folder's root, `..` stops there), so a link an earlier layer made leads where it leads in the
container, never out; the member itself is made without following anything. A name with `..`,
or a hard link to what the layers below do not hold, refuses the image, naming the member.

Owners other than root need the user's subordinate ids: `python -m harbor_hpc.images.layers`
runs as root of a user namespace mapped as the user (`unshare --map-root-user --map-auto`), and
there squashes the folder too (mksquashfs then records the owners the container will see).
Without subordinate ids every file is root's (the container's one id: environment_limits).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from harbor_hpc.core.errors import HarborHpcError

if TYPE_CHECKING:
    from harbor_hpc.images.registry import Registry

_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"
_MAX_LINK_FOLLOWS = 40  # the kernel's own bound (ELOOP)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}


class LayerError(HarborHpcError):
    """A layer that cannot be applied as Docker applies it (the image is refused)."""


@dataclass(frozen=True)
class ImageLayers:
    """What a root file system is made of: the image config's `config` (Env, Cmd, WorkingDir,
    User: what the .sif's oci-config.json holds), its architecture, and its layer files."""

    config: dict[str, Any]
    architecture: str
    layers: tuple[Path, ...]


def from_registry(
    registry: Registry, repository: str, digest: str, architecture: str, into: Path
) -> ImageLayers:
    """The image `repository@digest` of `registry` (images.registry.Registry; for an index, its
    linux/`architecture` image), its blobs downloaded into the folder `into`."""
    manifest = registry.manifest(repository, digest)
    if manifest.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:
        chosen = [
            entry
            for entry in manifest.get("manifests") or []
            if (entry.get("platform") or {}).get("os") == "linux"
            and (entry.get("platform") or {}).get("architecture") == architecture
        ]
        if not chosen:
            raise HarborHpcError(
                f"{repository}@{digest} has no image for linux/{architecture}",
                hint=f"build and push it for linux/{architecture} (`docker build --platform`)",
            )
        manifest = registry.manifest(repository, chosen[0]["digest"])
    config_file = into / "config.json"
    registry.blob(repository, manifest["config"]["digest"], config_file)
    layers = []
    for number, layer in enumerate(manifest.get("layers") or []):
        path = into / f"layer-{number}"
        registry.blob(repository, layer["digest"], path)
        layers.append(path)
    return _image(json.loads(config_file.read_text()), layers, f"{repository}@{digest}")


def from_archive(archive: Path, into: Path) -> ImageLayers:
    """The image a `docker save` archive holds (its first), its layers copied into `into`."""
    try:
        with tarfile.open(archive) as saved:
            index = _member_json(saved, "manifest.json")
            if not isinstance(index, list) or not index:
                raise HarborHpcError(f"{archive}: not an archive of `docker save` (no images)")
            config = _member_json(saved, index[0]["Config"])
            layers = []
            for number, name in enumerate(index[0]["Layers"]):
                source = saved.extractfile(name)
                if source is None:
                    raise HarborHpcError(f"{archive}: layer {name} is not a file")
                path = into / f"layer-{number}"
                with source, path.open("wb") as target:
                    shutil.copyfileobj(source, target, 1 << 20)
                layers.append(path)
    except (OSError, tarfile.TarError, KeyError, TypeError, ValueError) as exc:
        raise HarborHpcError(
            f"{archive}: not a readable `docker save` archive ({type(exc).__name__}: {exc})",
            hint="make it again with `docker save IMAGE -o FILE.tar`",
        ) from None
    return _image(config, layers, str(archive))


def _member_json(saved: tarfile.TarFile, name: str) -> Any:
    member = saved.extractfile(name)
    if member is None:
        raise KeyError(name)
    with member:
        return json.load(member)


def _image(config: Any, layers: list[Path], what: str) -> ImageLayers:
    if not isinstance(config, dict):
        raise HarborHpcError(f"{what}: its image config is not a JSON object")
    return ImageLayers(
        config=dict(config.get("config") or {}),
        architecture=str(config.get("architecture") or ""),
        layers=tuple(layers),
    )


def apply(layers: Sequence[Path], root: Path) -> int:
    """Lay `layers` (tar files: plain, gzip or zstd; lowest first) into the folder `root`, as
    Docker does; the number of device nodes left out. Raises LayerError naming the member."""
    folders: dict[str, tuple[float, float]] = {}
    devices = 0
    for layer in layers:
        with _opened(layer) as tar:
            for info in tar:  # the whiteouts first: they undo the layers below, never this one
                _whiteout(str(root), info, layer)
        with _opened(layer) as tar:
            for info in tar:
                devices += _make(tar, str(root), info, layer, folders)
    for path, times in sorted(folders.items(), reverse=True):  # children's times first
        os.utime(path, times, follow_symlinks=False)
    return devices


@contextmanager
def _opened(layer: Path) -> Iterator[tarfile.TarFile]:
    """The layer as a tar (Python reads gzip itself; zstd through `zstd -dc`)."""
    with layer.open("rb") as file:
        zstd = file.read(4) == _ZSTD_MAGIC
    if not zstd:
        with tarfile.open(layer, "r:*") as tar:
            yield tar
        return
    if shutil.which("zstd") is None:
        raise HarborHpcError(f"{layer.name}: a zstd layer, and no zstd on PATH to read it")
    with subprocess.Popen(["zstd", "-dc", str(layer)], stdout=subprocess.PIPE) as unzstd:
        assert unzstd.stdout is not None
        with tarfile.open(fileobj=unzstd.stdout, mode="r|") as tar:
            yield tar
        unzstd.stdout.close()
    if unzstd.returncode not in (0, -13):  # -13: closed before its end (SIGPIPE)
        raise HarborHpcError(f"{layer.name}: zstd could not read it (exit {unzstd.returncode})")


def _parts(name: str, info: tarfile.TarInfo, layer: Path) -> list[str]:
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise LayerError(f"layer {layer.name}: member {info.name!r} climbs out with '..'")
    return parts


def _inside(root: str, parts: Sequence[str], info: tarfile.TarInfo, layer: Path) -> str:
    """The folder `parts` name inside `root`, each symbolic link on the way followed as the
    container follows it: an absolute target from `root`, `..` never above it."""
    found: list[str] = []
    pending = list(parts)
    follows = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if found:
                found.pop()
            continue
        here = os.path.join(root, *found, part)
        if os.path.islink(here):
            follows += 1
            if follows > _MAX_LINK_FOLLOWS:
                raise LayerError(f"layer {layer.name}: {info.name!r} goes through a link loop")
            target = os.readlink(here)
            if target.startswith("/"):
                found = []
            pending = target.split("/") + pending
            continue
        found.append(part)
    return os.path.join(root, *found)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _whiteout(root: str, info: tarfile.TarInfo, layer: Path) -> None:
    parts = _parts(info.name, info, layer)
    if not parts or not parts[-1].startswith(_WHITEOUT):
        return
    folder = _inside(root, parts[:-1], info, layer)
    if parts[-1] == _OPAQUE:
        if os.path.isdir(folder) and not os.path.islink(folder):
            for child in os.listdir(folder):
                _remove(os.path.join(folder, child))
        return
    _remove(os.path.join(folder, parts[-1].removeprefix(_WHITEOUT)))


def _make(
    tar: tarfile.TarFile,
    root: str,
    info: tarfile.TarInfo,
    layer: Path,
    folders: dict[str, tuple[float, float]],
) -> int:
    """Make `info` in `root`; 1 for a device node left out, else 0."""
    parts = _parts(info.name, info, layer)
    if not parts or parts[-1].startswith(_WHITEOUT):
        return 0
    if info.ischr() or info.isblk():
        return 1
    parent = _inside(root, parts[:-1], info, layer)
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise LayerError(
            f"layer {layer.name}: {info.name!r} is under a file, not a folder"
        ) from None
    path = os.path.join(parent, parts[-1])
    if info.isdir():
        if not (os.path.isdir(path) and not os.path.islink(path)):
            _remove(path)
            os.mkdir(path, 0o700)
        folders[path] = (info.mtime, info.mtime)
    else:
        _remove(path)
        if info.isreg():
            _write(tar, info, path)
        elif info.issym():
            os.symlink(info.linkname, path)
        elif info.islnk():
            link = _parts(info.linkname, info, layer)
            source = os.path.join(_inside(root, link[:-1], info, layer), link[-1] if link else "")
            folder = os.path.isdir(source) and not os.path.islink(source)
            if not link or folder or not os.path.lexists(source):
                raise LayerError(
                    f"layer {layer.name}: hard link {info.name!r} to {info.linkname!r}, which "
                    "the image does not hold"
                )
            os.link(source, path, follow_symlinks=False)
            return 0  # one inode: its owner, mode and times are the first name's
        elif info.isfifo():
            os.mkfifo(path, 0o600)
        else:
            return 0  # nothing else is made by Docker either
    _own(path, info)
    if not info.issym():
        os.chmod(path, info.mode & 0o7777)
    os.utime(path, (info.mtime, info.mtime), follow_symlinks=False)
    return 0


def _write(tar: tarfile.TarFile, info: tarfile.TarInfo, path: str) -> None:
    source: IO[bytes] | None = tar.extractfile(info)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with os.fdopen(os.open(path, flags, 0o600), "wb") as target:
        if source is not None:
            with source:
                shutil.copyfileobj(source, target, 1 << 20)


def _own(path: str, info: tarfile.TarInfo) -> None:
    """The member's owner, where this namespace maps it (without subordinate ids only root is
    mapped: the file stays root's)."""
    try:
        os.chown(path, info.uid, info.gid, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EPERM):
            raise


def squash_command(root: Path, squashfs: Path, squash_args: Sequence[str]) -> list[str]:
    """mksquashfs making `squashfs` of the folder `root` with `squash_args` (its compression)."""
    return ["mksquashfs", str(root), str(squashfs), "-noappend", "-no-progress", *squash_args]


def main(root: Path, squashfs: Path, squash_args: Sequence[str], layers: Sequence[Path]) -> int:
    """Apply `layers` into `root`, squash it into `squashfs`, remove `root`: run as root of the
    user's namespace, so that owners are the container's and the folder can be removed."""
    try:
        root.mkdir(mode=0o755)
        devices = apply(layers, root)
        os.chmod(root, 0o755)
        done = subprocess.run(
            squash_command(root, squashfs, squash_args),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            sys.stderr.write(f"mksquashfs failed: {done.stderr.strip()[-500:]}\n")
            return 1
    except HarborHpcError as exc:
        sys.stderr.write(exc.message + "\n")
        return 2
    except OSError as exc:
        sys.stderr.write(f"{exc.filename or root}: {exc.strerror or exc}\n")
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if devices:
        sys.stderr.write(f"{devices} device node(s) left out\n")
    return 0


if __name__ == "__main__":
    _root, _squashfs, _args, *_layers = sys.argv[1:]
    sys.exit(main(Path(_root), Path(_squashfs), json.loads(_args), [Path(a) for a in _layers]))
