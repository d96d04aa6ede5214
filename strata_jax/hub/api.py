"""A Hugging Face-compatible hub's HTTP API, as far as pulling files needs it: the repo listing at a
revision (commit, each file's size and the sha256 of LFS files) and a GET of a file that follows
redirects by hand, so a token goes to the hub only and never to the CDN it redirects to.

The endpoint is $HF_ENDPOINT (default https://huggingface.co); the token $HF_TOKEN, else the one
huggingface_hub stores (`hf auth login`) where it is installed. $HF_HUB_OFFLINE=1 forbids any request,
as it does to huggingface_hub: a model already verified in the pull cache still resolves.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request

from strata_jax.core.errors import HubError

DEFAULT_ENDPOINT = "https://huggingface.co"
USER_AGENT = "strata-jax"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_REDIRECTS = 10

__all__ = ["HubError", "RemoteFile", "RepoListing", "endpoint", "token", "listing", "open_file", "file_url"]


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    path: str  # inside the repo
    size: int  # bytes, as the hub publishes it
    sha256: str | None  # lowercase hex; None where the hub publishes none (a non-LFS file)


@dataclasses.dataclass(frozen=True)
class RepoListing:
    repo: str
    revision: str  # as asked
    commit: str | None  # what it resolved to, where the hub says
    files: dict[str, RemoteFile]
    endpoint: str


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token() -> str | None:
    tok = os.environ.get("HF_TOKEN")
    if tok:
        return tok
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    try:
        return get_token()
    except Exception:  # noqa: BLE001 - an unreadable token file is no token
        return None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D401 - urllib's hook
        return None  # a 3xx comes back as an HTTPError; open_file follows it itself


_OPENER = urllib.request.build_opener(_NoRedirect)


def _origin(url: str) -> tuple[str, str]:
    u = urllib.parse.urlsplit(url)
    return u.scheme, u.netloc.lower()


def check_repo(repo: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo or ""):
        raise HubError(f"{repo!r} is not a hub repository id; write OWNER/NAME, e.g. Qwen/Qwen3-30B-A3B-GGUF.")
    return repo


def file_url(base: str, repo: str, revision: str, path: str) -> str:
    return (f"{base}/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/"
            f"{urllib.parse.quote(path, safe='/')}")


def open_file(url: str, *, headers: dict[str, str] | None = None, auth: str | None = None,
              timeout: float = 60.0) -> http.client.HTTPResponse:
    """GET url, following redirects (the Authorization header only on the first origin). Returns the
    final response, whatever its status below 400; raises HubError for >= 400 with the reason, or
    urllib.error.URLError / OSError for a connection that failed (the caller retries those)."""
    if offline():
        raise HubError(f"HF_HUB_OFFLINE is set, so strata-jax does not ask the hub for {_show(url)}; unset it, or "
                       "use a local path or a model already pulled into the cache.")
    first = _origin(url)
    for _ in range(MAX_REDIRECTS + 1):
        h = {"User-Agent": USER_AGENT, **(headers or {})}
        if auth and _origin(url) == first:
            h["Authorization"] = f"Bearer {auth}"
        try:
            return _OPENER.open(urllib.request.Request(url, headers=h), timeout=timeout)
        except urllib.error.HTTPError as e:
            if e.code in (301, 302, 303, 307, 308) and e.headers.get("Location"):
                url = urllib.parse.urljoin(url, e.headers["Location"])
                e.close()
                continue
            if 500 <= e.code < 600 or e.code == 429:
                raise ConnectionError(f"HTTP {e.code} from {_show(url)}") from None  # retried by the caller
            raise _http_error(e, url) from None
    raise HubError(f"more than {MAX_REDIRECTS} redirects fetching {_show(url)}; the hub or its CDN loops.")


def _show(url: str) -> str:
    u = urllib.parse.urlsplit(url)
    return f"{u.scheme}://{u.netloc}{u.path}"  # no query string: CDN URLs carry signatures


def _http_error(e: urllib.error.HTTPError, url: str) -> HubError | urllib.error.HTTPError:
    try:
        body = e.read(2000).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001
        body = ""
    detail = ""
    try:
        detail = json.loads(body).get("error", "") if body else ""
    except (ValueError, AttributeError):
        detail = body[:200]
    detail = f" ({detail})" if detail else ""
    if e.code in (401, 403):
        return HubError(f"HTTP {e.code} from {_show(url)}{detail}: the repository is private or gated. Set HF_TOKEN "
                        "to a token with access (or `hf auth login`), and accept the model's terms on the hub.")
    if e.code == 404:
        return HubError(f"HTTP 404 from {_show(url)}{detail}: no such repository, revision or file at "
                        f"{endpoint()} (HF_ENDPOINT). Check the spelling and --revision.")
    return HubError(f"HTTP {e.code} from {_show(url)}{detail}.")


def _get_json(url: str, auth: str | None, timeout: float):
    try:
        with open_file(url, headers={"Accept": "application/json"}, auth=auth, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise HubError(f"cannot reach the hub at {_show(url)}: {e}. Check the network, or HF_ENDPOINT for a "
                       "mirror.") from None
    except ValueError as e:
        raise HubError(f"the hub's reply from {_show(url)} is not JSON ({e}); is HF_ENDPOINT a hub?") from None


def listing(repo: str, revision: str = "main", *, timeout: float = 60.0) -> RepoListing:
    """The repo's files at `revision` with their published sizes and sha256 (the LFS oid)."""
    check_repo(repo)
    base, auth = endpoint(), token()
    url = f"{base}/api/models/{repo}/revision/{urllib.parse.quote(revision, safe='')}?blobs=true"
    info = _get_json(url, auth, timeout)
    siblings = info.get("siblings") if isinstance(info, dict) else None
    if not isinstance(siblings, list):
        raise HubError(f"the hub's listing of {repo}@{revision} has no file list (siblings); is {base} a "
                       "Hugging Face-compatible hub?")
    files = {}
    for s in siblings:
        path = s.get("rfilename")
        if not isinstance(path, str):
            continue
        lfs = s.get("lfs") or {}
        size = lfs.get("size", s.get("size"))
        sha = str(lfs.get("sha256") or lfs.get("oid") or "").lower()
        files[path] = RemoteFile(path, int(size) if isinstance(size, int) and size >= 0 else -1,
                                 sha if _SHA256.match(sha) else None)
    return RepoListing(repo, revision, info.get("sha"), files, base)
