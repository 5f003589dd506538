"""Download the wanted files of a Hugging Face dataset repository into the Hugging Face cache.

huggingface_hub does the transfer (`snapshot_download`), so HF_TOKEN, HF_HOME, HF_HUB_CACHE,
HF_ENDPOINT and HF_HUB_OFFLINE mean what they mean everywhere else, files already in the cache
are not downloaded again, and an interrupted download resumes. Its failures are turned here into
one line that says what went wrong and what to do.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    DryRunError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

# What snapshot_download matches files with. Public: in huggingface_hub.utils.__all__, which the
# package builds at run time, where mypy cannot read it (checked with huggingface_hub 1.33).
from huggingface_hub.utils import filter_repo_objects  # type: ignore[attr-defined]

from harbor_hpc.core.errors import HarborHpcError, InputError

_TOKEN_HINT = "set HF_TOKEN to a token that can read this dataset (or run `hf auth login`)"


@dataclass(frozen=True)
class Hub:
    """Where to fetch from: None means huggingface_hub's own default (from the environment)."""

    endpoint: str | None = None
    cache_dir: Path | None = None
    token: str | None = None

    @property
    def address(self) -> str:
        return (self.endpoint or constants.ENDPOINT).rstrip("/")


@dataclass(frozen=True)
class Snapshot:
    """The wanted files of one commit, in the cache: `files` are repository paths."""

    repo_id: str
    commit: str
    folder: Path
    files: list[str]

    def local(self, repo_path: str) -> Path:
        return self.folder / repo_path


@dataclass(frozen=True)
class PlannedFile:
    path: str
    size: int | None
    cached: bool
    local: Path


def download(
    repo_id: str,
    *,
    include: Sequence[str] = (),
    revision: str | None = None,
    hub: Hub | None = None,
) -> Snapshot:
    """Download the files of dataset `repo_id` matching `include` (all when empty)."""
    hub = hub or Hub()
    patterns = list(include) or None
    with _hub_errors(repo_id, revision, hub):
        folder = Path(
            snapshot_download(
                repo_id,
                repo_type="dataset",
                revision=revision,
                allow_patterns=patterns,
                endpoint=hub.endpoint,
                cache_dir=hub.cache_dir,
                token=hub.token,
            )
        )
    files = sorted(filter_repo_objects(_files_under(folder), allow_patterns=patterns))
    if not files:
        raise _nothing_matches(repo_id, include)
    return Snapshot(repo_id=repo_id, commit=folder.name, folder=folder, files=files)


def plan(
    repo_id: str,
    *,
    include: Sequence[str] = (),
    revision: str | None = None,
    hub: Hub | None = None,
) -> list[PlannedFile]:
    """What `download` would fetch, asking the hub but writing nothing."""
    hub = hub or Hub()
    with _hub_errors(repo_id, revision, hub):
        infos = snapshot_download(
            repo_id,
            repo_type="dataset",
            revision=revision,
            allow_patterns=list(include) or None,
            endpoint=hub.endpoint,
            cache_dir=hub.cache_dir,
            token=hub.token,
            dry_run=True,
        )
    if not infos:
        raise _nothing_matches(repo_id, include)
    return sorted(
        (
            PlannedFile(
                path=info.filename,
                size=info.file_size,
                cached=info.is_cached,
                local=Path(info.local_path),
            )
            for info in infos
        ),
        key=lambda planned: planned.path,
    )


def _files_under(folder: Path) -> list[str]:
    """Repository paths of the files in a cached snapshot (links into the cache's blobs)."""
    found = []
    for dirpath, _dirnames, filenames in os.walk(folder):
        for name in filenames:
            found.append((Path(dirpath) / name).relative_to(folder).as_posix())
    return found


def _nothing_matches(repo_id: str, include: Sequence[str]) -> InputError:
    return InputError(
        f"{repo_id}: no file matches --include {' '.join(include)}",
        hint="patterns are matched against repository paths such as "
        "'skill_based/mixed/scientific_computing.tar.gz'; a folder takes a trailing '/' "
        "('skill_based/mixed/') or '/*'",
    )


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, hub: Hub) -> Iterator[None]:
    """Turn huggingface_hub's failures into one line each; anything else is a bug and passes."""
    where = f"dataset {repo_id} on {hub.address}"
    try:
        yield
    except HFValidationError as exc:
        raise InputError(f"{repo_id!r} is not a repository id: {exc}") from None
    except RevisionNotFoundError:
        raise InputError(
            f"{where}: no revision {revision!r}",
            hint="give a branch, tag or commit that exists in the repository",
        ) from None
    except GatedRepoError:
        raise HarborHpcError(
            f"{where} is gated: your account has not been granted access",
            hint="accept the dataset's conditions on its hub page, then " + _TOKEN_HINT,
        ) from None
    except RepositoryNotFoundError:
        raise HarborHpcError(
            f"{where}: no such dataset (or it is private and the token cannot read it)",
            hint="check the name (ORG/NAME); for a private dataset, " + _TOKEN_HINT,
        ) from None
    except RemoteEntryNotFoundError as exc:
        raise HarborHpcError(
            f"{where}: a listed file is missing on the hub ({exc.response.url})",
            hint="try again later, or pin an older commit with --revision",
        ) from None
    except IncompleteSnapshotError:
        raise HarborHpcError(
            f"{where}: cannot reach the hub, and the cached copy lacks some of the files asked for",
            hint="fetch again when the hub is reachable",
        ) from None
    except DryRunError as exc:
        if constants.HF_HUB_OFFLINE:
            raise HarborHpcError(
                "--dry-run asks the hub what would be downloaded, and HF_HUB_OFFLINE is set",
                hint="unset HF_HUB_OFFLINE, or fetch without --dry-run to work from the cache",
            ) from None
        raise _not_reachable(where, exc.__cause__ or exc) from None
    except LocalEntryNotFoundError as exc:
        raise _not_reachable(where, exc.__cause__ or exc) from None
    except HfHubHTTPError as exc:
        raise _http_refusal(where, exc) from None
    except httpx.HTTPError as exc:
        raise _not_reachable(where, exc) from None
    except OSError as exc:
        raise HarborHpcError(
            f"{where}: the download failed ({exc})",
            hint="check the free space and permissions of the Hugging Face cache "
            f"({hub.cache_dir or constants.HF_HUB_CACHE}), or set HF_HOME elsewhere",
        ) from None


def _not_reachable(where: str, cause: BaseException) -> HarborHpcError:
    if isinstance(cause, OfflineModeIsEnabled) or constants.HF_HUB_OFFLINE:
        return HarborHpcError(
            f"{where}: HF_HUB_OFFLINE is set and the files asked for are not in the cache",
            hint="unset HF_HUB_OFFLINE to download them, or point HF_HOME at a cache that has them",
        )
    if isinstance(cause, HfHubHTTPError):
        return _http_refusal(where, cause)
    return HarborHpcError(
        f"{where}: the hub cannot be reached ({type(cause).__name__}: {cause})",
        hint="check the network, proxy and HF_ENDPOINT; with HF_HUB_OFFLINE=1 fetch works from "
        "the cache alone",
    )


def _http_refusal(where: str, exc: HfHubHTTPError) -> HarborHpcError:
    status = exc.response.status_code
    if status in (401, 403):
        return HarborHpcError(
            f"{where}: the hub refused the token (HTTP {status})", hint=_TOKEN_HINT
        )
    reason = exc.server_message or exc.response.reason_phrase
    return HarborHpcError(
        f"{where}: the hub answered HTTP {status} ({reason})",
        hint="try again later",
    )
