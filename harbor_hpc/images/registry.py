"""Asking a registry (Docker Registry HTTP API v2) whether an image is there, as the user's login.

Credentials are the user's `docker login` ones: docker-py reads the Docker config file (honouring
DOCKER_CONFIG, credential stores and helpers) exactly as `docker push` would. They go into request
headers only; nothing here prints or stores them. Both schemes registries use are handled: Basic
(a plain htpasswd registry) and Bearer tokens fetched from the realm the registry names.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from docker import auth

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.images.reference import is_loopback

MANIFEST_TYPES = ", ".join(
    (
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    )
)
_TIMEOUT = 30
_CHUNK = 1 << 20


def login_hint(host: str) -> str:
    return f"run `docker login {host}` (as the user who runs harbor-hpc), then run again"


@dataclass
class Registry:
    """A registry host; `plain_http` for loopback registries and `nohttps` setups.

    `credentials` (`{"username", "password"}`) default to the user's `docker login` for the host.
    """

    host: str
    plain_http: bool = False
    credentials: dict[str, str] | None = field(default=None, repr=False)
    _session: requests.Session = field(default_factory=requests.Session, repr=False)
    _tokens: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if is_loopback(self.host):
            self.plain_http = True
        if self.credentials is None:
            self.credentials = _docker_login(self.host)

    @property
    def base_url(self) -> str:
        return f"{'http' if self.plain_http else 'https'}://{self.host}/v2/"

    @property
    def logged_in(self) -> bool:
        return self.credentials is not None

    def check_access(self, repository_path: str) -> None:
        """Fail with one clear line unless we may pull and push `repository_path` here."""
        response = self._get("", scope=f"repository:{repository_path}:pull,push")
        if response.status_code in (401, 403):
            if not self.logged_in:
                raise HarborHpcError(
                    f"registry {self.host} asks for a login and the Docker config has none for it",
                    hint=login_hint(self.host),
                )
            raise HarborHpcError(
                f"registry {self.host} refused the credentials of your Docker login",
                hint=login_hint(self.host),
            )
        if response.status_code != 200:
            raise HarborHpcError(
                f"registry {self.host} answered HTTP {response.status_code} to /v2/",
                hint="check the registry address (REGISTRY/NAMESPACE)",
            )

    def manifest_digest(self, repository_path: str, reference: str) -> str | None:
        """The digest of `repository_path:reference` (a tag or digest), None when absent."""
        response = self._get(
            f"{repository_path}/manifests/{reference}",
            scope=f"repository:{repository_path}:pull",
            method="HEAD",
        )
        if response.status_code == 404:
            return None
        if response.status_code in (401, 403):
            raise HarborHpcError(
                f"registry {self.host} refused to show {repository_path}",
                hint=login_hint(self.host),
            )
        if response.status_code != 200:
            raise HarborHpcError(
                f"registry {self.host} answered HTTP {response.status_code} for "
                f"{repository_path}:{reference}"
            )
        digest = response.headers.get("Docker-Content-Digest")
        return digest or (reference if reference.startswith("sha256:") else None)

    def manifest(self, repository_path: str, reference: str) -> dict[str, Any]:
        """The manifest (or image index) of `repository_path` at `reference` (a digest), as
        the registry serves it, checked against the digest."""
        what = f"{repository_path}@{reference}"
        response = self._get(
            f"{repository_path}/manifests/{reference}", scope=f"repository:{repository_path}:pull"
        )
        self._answered(response, what)
        if reference.startswith("sha256:") and (
            f"sha256:{hashlib.sha256(response.content).hexdigest()}" != reference
        ):
            raise HarborHpcError(f"registry {self.host} sent a manifest of {what} not its digest")
        body: dict[str, Any] = response.json()
        return body

    def blob(self, repository_path: str, digest: str, into: Path) -> None:
        """Download blob `digest` of `repository_path` into the file `into`, checked against
        its digest (a file that does not match is removed)."""
        what = f"{repository_path}@{digest}"
        response = self._get(
            f"{repository_path}/blobs/{digest}",
            scope=f"repository:{repository_path}:pull",
            stream=True,
        )
        self._answered(response, what)
        hashed = hashlib.sha256()
        try:
            with response, into.open("wb") as file:
                for chunk in response.iter_content(_CHUNK):
                    hashed.update(chunk)
                    file.write(chunk)
        except requests.RequestException as exc:
            into.unlink(missing_ok=True)
            raise HarborHpcError(
                f"registry {self.host}: the download of {what} broke off ({type(exc).__name__})"
            ) from None
        if f"sha256:{hashed.hexdigest()}" != digest:
            into.unlink(missing_ok=True)
            raise HarborHpcError(f"registry {self.host} sent a blob of {what} not its digest")

    def _answered(self, response: requests.Response, what: str) -> None:
        """Raise, in one line, unless `response` (to a pull of `what`) is the content."""
        if response.status_code == 200:
            return
        if response.status_code in (401, 403):
            raise HarborHpcError(
                f"registry {self.host} refused to give {what}", hint=login_hint(self.host)
            )
        if response.status_code == 404:
            raise HarborHpcError(f"registry {self.host} has no {what}")
        raise HarborHpcError(
            f"registry {self.host} answered HTTP {response.status_code} for {what}"
        )

    def _get(
        self, path: str, *, scope: str, method: str = "GET", stream: bool = False
    ) -> requests.Response:
        url = self.base_url + path
        headers = {"Accept": MANIFEST_TYPES}
        token = self._tokens.get(scope)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            response = self._request(method, url, headers, stream=stream)
            if response.status_code == 401:
                challenge = response.headers.get("WWW-Authenticate", "")
                retry = self._authorize(challenge, scope, headers)
                if retry:
                    response = self._request(method, url, headers, stream=stream)
        except requests.RequestException as exc:
            raise HarborHpcError(
                f"registry {self.host} does not answer ({type(exc).__name__})",
                hint="check the address and that the registry is up; plain-HTTP registries "
                "other than localhost need `nohttps = true` in harbor-hpc.toml",
            ) from None
        return response

    def _request(
        self, method: str, url: str, headers: dict[str, str], *, stream: bool = False
    ) -> requests.Response:
        return self._session.request(method, url, headers=headers, timeout=_TIMEOUT, stream=stream)

    def _authorize(self, challenge: str, scope: str, headers: dict[str, str]) -> bool:
        """Fill `headers` with what the challenge asks for; False when we have nothing to offer."""
        scheme, _, params_text = challenge.partition(" ")
        params = dict(re.findall(r'(\w+)="([^"]*)"', params_text))
        basic = self.credentials
        if scheme.lower() == "basic":
            if basic is None:
                return False
            pair = f"{basic['username']}:{basic['password']}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
            return True
        if scheme.lower() != "bearer" or "realm" not in params:
            return False
        query = {"service": params.get("service", ""), "scope": params.get("scope", scope)}
        token_response = self._session.get(
            params["realm"],
            params=query,
            auth=(basic["username"], basic["password"]) if basic else None,
            timeout=_TIMEOUT,
        )
        if token_response.status_code != 200:
            return False
        body: dict[str, Any] = token_response.json()
        token = body.get("token") or body.get("access_token")
        if not token:
            return False
        self._tokens[scope] = token
        headers["Authorization"] = f"Bearer {token}"
        return True


def _docker_login(host: str) -> dict[str, str] | None:
    """`{"username", "password"}` of the user's `docker login` to `host`, or None."""
    entry = auth.load_config().resolve_authconfig(host)
    if not entry:
        return None
    username, password = entry.get("username"), entry.get("password")
    if not username or password is None:
        return None
    return {"username": username, "password": password}
