"""A Hugging Face hub on loopback that serves one dataset folder, for tests.

It answers the few endpoints huggingface_hub's `snapshot_download` calls, with the headers the
real hub sends, so the real client code runs end to end:

- `GET /api/datasets/ORG/NAME/revision/REV`: the repository info (`sha`, `siblings`);
- `GET /api/datasets/ORG/NAME/tree/REV?recursive=true`: the file listing (path, size, oid);
- `HEAD|GET /datasets/ORG/NAME/resolve/REV/PATH`: a file, with `ETag`, `X-Repo-Commit`,
  `Content-Length`.

The commit hash is derived from the folder's content, so changing a file makes a new commit,
as a push would. Errors look like the hub's: 404 with `X-Error-Code: RepoNotFound`,
`RevisionNotFound` or `EntryNotFound`; with `token` set, 401 (`Invalid credentials in
Authorization header`) for a wrong token and a RepoNotFound 401 for none, as for a private repo.
Every request is recorded in `requests` as (method, path) so tests can check what was fetched.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

_CHUNK = 1 << 16


class FakeHub:
    def __init__(self, root: Path, repo_id: str = "org/tasks", *, token: str | None = None) -> None:
        self.root = root
        self.repo_id = repo_id
        self.token = token
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        # A short poll so that leaving the `with` block does not wait half a second.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def files(self) -> dict[str, Path]:
        """Repository path -> file, for every file under `root`."""
        return {
            path.relative_to(self.root).as_posix(): path
            for path in sorted(self.root.rglob("*"))
            if path.is_file()
        }

    def commit(self) -> str:
        digest = hashlib.sha1()
        for name, path in self.files().items():
            digest.update(name.encode() + b"\0" + _sha256(path).encode() + b"\n")
        return digest.hexdigest()

    def downloads(self) -> list[str]:
        """Repository paths whose content was sent (GET on resolve)."""
        marker = f"/datasets/{self.repo_id}/resolve/"
        return [
            path.split(marker, 1)[1].split("/", 1)[1]
            for method, path in self.requests
            if method == "GET" and marker in path
        ]


def dead_endpoint() -> str:
    """A loopback URL where nothing listens: a port that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: tests read `hub.requests` instead of stderr."""

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def _answer(self, *, send_body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            api = f"/api/datasets/{hub.repo_id}/"
            resolve = f"/datasets/{hub.repo_id}/"
            if not (path.startswith(api) or path.startswith(resolve)):
                self._error(404, "RepoNotFound", "Repository not found")
                return
            if not self._authorized():
                return
            if path.startswith(api + "revision/"):
                if self._commit(path.removeprefix(api + "revision/")) is not None:
                    self._info()
            elif path.startswith(api + "tree/"):
                if self._commit(path.removeprefix(api + "tree/").split("/", 1)[0]) is not None:
                    self._tree()
            elif path.startswith(resolve + "resolve/"):
                revision, _, name = path.removeprefix(resolve + "resolve/").partition("/")
                commit = self._commit(revision)
                if commit is not None:
                    self._file(commit, name, send_body=send_body)
            else:
                self._error(404, None, "Not found")

        def _authorized(self) -> bool:
            if hub.token is None:
                return True
            sent = self.headers.get("Authorization")
            if sent == f"Bearer {hub.token}":
                return True
            if sent is None:
                self._error(401, "RepoNotFound", "Repository not found")
            else:
                self._error(401, None, "Invalid credentials in Authorization header")
            return False

        def _commit(self, revision: str) -> str | None:
            commit = hub.commit()
            if revision in ("main", commit):
                return commit
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None

        def _info(self) -> None:
            siblings = [{"rfilename": name} for name in hub.files()]
            self._json({"id": hub.repo_id, "sha": hub.commit(), "siblings": siblings})

        def _tree(self) -> None:
            entries = [
                {"type": "file", "path": name, "size": path.stat().st_size, "oid": _sha256(path)}
                for name, path in hub.files().items()
            ]
            self._json(entries)

        def _file(self, commit: str, name: str, *, send_body: bool) -> None:
            path = hub.files().get(name)
            if path is None:
                self._error(404, "EntryNotFound", f"{name} does not exist", commit=commit)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            self.send_header("ETag", f'"{_sha256(path)}"')
            self.send_header("X-Repo-Commit", commit)
            self.end_headers()
            if send_body:
                with path.open("rb") as handle:
                    while chunk := handle.read(_CHUNK):
                        self.wfile.write(chunk)

        def _json(self, data: Any) -> None:
            body = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(
            self, status: int, code: str | None, message: str, *, commit: str | None = None
        ) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code is not None:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit is not None:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler
